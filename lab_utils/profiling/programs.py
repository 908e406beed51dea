"""Lab 06's training programs, each with one planted bottleneck and its fix, and a wall-clock step timer.

``build(name, variant, device)`` makes a ``Program``: ``step()`` runs one training iteration, ``samples`` is the
batch size, ``close()`` stops any loader workers. ``PROGRAMS``: ``data``, ``sync``, ``launch`` and ``precision``
(one planted bottleneck each), and ``all`` (every fix that applies); ``VARIANTS`` names each one's fixes (``planted``,
``fixed``, ``gpu-data``...). ``time_steps`` returns the wall-clock ms per step.

Design notes: docs/internals.md#lab_utilsprofilingprogramspy"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from lab_utils.models import digits_png
from lab_utils.timing import cpu_cores, host_ms

__all__ = ["PROGRAMS", "VARIANTS", "Program", "PngDigits", "ImageNet", "build", "time_steps", "loader_workers",
           "Sizes", "sizes_for", "infinite_loader", "close_iterator"]

PROGRAMS = ("data", "sync", "launch", "precision", "all")
VARIANTS = {"data": ("planted", "fixed"), "sync": ("planted", "fixed"),
            "launch": ("planted", "batch", "compile", "reduce-overhead", "max-autotune"),
            "precision": ("planted", "fixed"), "all": ("planted", "fixed", "gpu-data")}


@dataclass(frozen=True)
class Sizes:
    """Problem sizes: image side (px) and batch, conv width, MLP shapes (tokens × width)."""

    image: int
    batch: int
    width: int
    mlp_batch: int
    mlp_width: int
    mlp_depth: int
    big_tokens: int
    big_width: int
    storage_ms: float  # simulated read latency per sample (network storage), hidden by loader workers
    sync_batch: int  # the sync program's batch: small, so kernels are short against the host's launch time


def sizes_for(device: str, quick: bool) -> Sizes:
    """The sizes a lab uses here: a GPU gets work large enough to time; a CPU (and CI's quick mode) small work."""
    if device.startswith("cuda"):
        return Sizes(image=64, batch=256, width=96, mlp_batch=16, mlp_width=512, mlp_depth=16,
                     big_tokens=8192, big_width=2048, storage_ms=0.02, sync_batch=256)
    if quick:
        return Sizes(image=32, batch=32, width=8, mlp_batch=16, mlp_width=128, mlp_depth=8,
                     big_tokens=256, big_width=128, storage_ms=0.4, sync_batch=32)
    return Sizes(image=48, batch=64, width=16, mlp_batch=16, mlp_width=256, mlp_depth=12,
                 big_tokens=1024, big_width=256, storage_ms=0.4, sync_batch=64)


def loader_workers() -> int:
    """Worker processes for a DataLoader: the cores this process may use, less one for the training loop (≥ 1)."""
    return max(1, min(cpu_cores() - 1, 12))


class PngDigits(torch.utils.data.Dataset):
    """The digits as PNG files would be read: each ``__getitem__`` decodes PNG bytes (Pillow), rotates by a random
    angle (augmentation) and normalizes, like an image data set on disk. ``storage_ms`` adds a read latency per
    sample (network storage), which workers hide and a 2-core machine can also show."""

    def __init__(self, size: int = 64, storage_ms: float = 0.05, seed: int = 0):
        self.png, self.labels = digits_png(size)
        self.storage_s = storage_ms / 1e3
        self.seed = seed

    def __len__(self) -> int:
        return len(self.png)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.storage_s:
            time.sleep(self.storage_s)
        angle = float(np.random.default_rng((self.seed, i)).uniform(-12, 12))
        img = Image.open(io.BytesIO(self.png[i])).rotate(angle, resample=Image.Resampling.BILINEAR)
        x = torch.from_numpy(np.asarray(img, dtype=np.float32)).div_(255.0).sub_(0.5).div_(0.5)
        return x[None], int(self.labels[i])


class ImageNet(nn.Module):
    """A plain convnet for the image programs: three stages of 3×3 convolutions (BatchNorm, ReLU), pooling, a
    linear head; ``width`` channels in the first stage, doubled per stage."""

    def __init__(self, width: int = 64, classes: int = 10):
        super().__init__()

        def stage(c_in: int, c_out: int, stride: int) -> list[nn.Module]:
            return [nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(c_out),
                    nn.ReLU(inplace=True), nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
                    nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]

        w = width
        self.body = nn.Sequential(*stage(1, w, 1), *stage(w, 2 * w, 2), *stage(2 * w, 4 * w, 2),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@dataclass
class Program:
    """One training program: ``step()`` runs an iteration; ``samples`` per step; ``close()`` frees workers."""

    name: str
    variant: str
    step: Callable[[], Any]
    samples: int
    note: str = ""
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        while self.closers:
            self.closers.pop()()

    def __enter__(self) -> Program:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def time_steps(step: Callable[[], Any], steps: int = 20, warmup: int = 3, device: str = "cpu") -> float:
    """Wall-clock ms per training step: ``warmup`` steps, a synchronize, ``steps`` steps, a synchronize.

    A loop's speed is its wall time (host and device together), so the clock is read only at both ends: a
    per-step CUDA event pair would measure the GPU's share and miss the host stalls this lab is about."""
    for _ in range(warmup):
        step()

    def loop() -> None:
        for _ in range(steps):
            step()

    return host_ms(loop, device, 1, wait=True) / steps


def infinite_loader(ds: torch.utils.data.Dataset, batch: int, workers: int, pin: bool,
                    seed: int = 0) -> torch.utils.data.DataLoader:
    """A DataLoader that never runs out (samples drawn with replacement): a timed loop needs no epoch logic."""
    sampler = torch.utils.data.RandomSampler(ds, replacement=True, num_samples=10**9,
                                             generator=torch.Generator().manual_seed(seed))
    kw: dict[str, Any] = {"persistent_workers": True, "prefetch_factor": 4} if workers else {}
    return torch.utils.data.DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=workers,
                                       pin_memory=pin, drop_last=True, **kw)


def close_iterator(it: Any) -> Callable[[], None]:
    """A function that stops a DataLoader iterator's worker processes (persistent workers outlive the loop)."""

    def close() -> None:
        if (shutdown := getattr(it, "_shutdown_workers", None)) is not None:
            shutdown()  # persistent workers otherwise live until the iterator is garbage-collected

    return close


class _LossLog:
    """The training loss as a loop logs it: ``add`` sums on the device and reads back once every ``every`` steps;
    ``read`` reads every step (the planted sync: the host waits for the step's last kernel)."""

    def __init__(self, device: str, every: int):
        self.n, self.every, self.last_mean = 0, every, math.nan
        self.running = torch.zeros((), device=device)

    def add(self, loss: torch.Tensor) -> None:
        self.n += 1
        self.running += loss.detach()  # stays on the device: no wait for the GPU
        if self.n % self.every == 0:
            self.last_mean = self.running.item() / self.every
            self.running.zero_()

    def read(self, loss: torch.Tensor) -> None:
        self.n += 1
        if not math.isfinite(value := loss.item()):
            raise FloatingPointError(f"loss {value} at step {self.n}")
        self.last_mean = value


def _image_program(name: str, variant: str, device: str, sz: Sizes, fixes: set[str], seed: int) -> Program:
    """The image classifier trained from PNG digits with the given ``fixes`` applied (data, sync, bf16, cl)."""
    torch.manual_seed(seed)
    cuda = device.startswith("cuda")
    model = ImageNet(sz.width).to(device)
    fmt = torch.channels_last if "cl" in fixes and cuda else torch.contiguous_format
    model = model.to(memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    ds = PngDigits(sz.image, storage_ms=sz.storage_ms, seed=seed)
    workers = loader_workers() if "data" in fixes else 0
    loader = infinite_loader(ds, sz.batch, workers, pin="data" in fixes and cuda, seed=seed)
    it = iter(loader)
    non_blocking = "data" in fixes
    bf16 = "bf16" in fixes
    log = _LossLog(device, 20)

    def step() -> None:
        x, y = next(it)
        x = x.to(device, non_blocking=non_blocking, memory_format=fmt)
        y = y.to(device, non_blocking=non_blocking)
        with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        log.add(loss) if "sync" in fixes else log.read(loss)

    knobs = (", bf16" if bf16 else "") + (", channels-last" if fmt is torch.channels_last else "")
    return Program(name, variant, step, sz.batch, note=f"{sz.image}×{sz.image} PNG digits, batch {sz.batch}, "
                   f"width {sz.width}, {workers} loader workers{knobs}", closers=[close_iterator(it)])


def _sync_program(variant: str, device: str, sz: Sizes, seed: int) -> Program:
    """The image model on a batch already on the device: only the per-step read-back differs."""
    torch.manual_seed(seed)
    model = ImageNet(max(sz.width // 2, 4)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sz.sync_batch, 1, sz.image, sz.image, generator=g).to(device)
    y = torch.randint(0, 10, (sz.sync_batch,), generator=g).to(device)
    state: dict[str, torch.Tensor] = {}
    log = _LossLog(device, 50)

    def train_step() -> torch.Tensor:
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    def planted() -> None:
        log.read(train_step())  # host waits for the GPU every step
        state["acc"] = (model(x[:8]).argmax(1) == y[:8]).float().mean().cpu()  # a second read-back

    def fixed() -> None:
        loss = train_step()
        state["acc"] = (model(x[:8]).argmax(1) == y[:8]).float().mean()  # the same work, kept on the device
        log.add(loss)

    return Program("sync", variant, planted if variant == "planted" else fixed, sz.sync_batch,
                   note=f"batch {sz.sync_batch} on the device, width {max(sz.width // 2, 4)}")


def _mlp(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def _launch_program(variant: str, device: str, sz: Sizes, seed: int) -> Program:
    torch.manual_seed(seed)
    batch = sz.mlp_batch * (32 if variant == "batch" else 1)
    model = _mlp(sz.mlp_width, sz.mlp_depth).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, sz.mlp_width, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    loss_fn = nn.CrossEntropyLoss()

    def train_step() -> torch.Tensor:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    step: Callable[[], Any] = train_step
    if variant in ("compile", "reduce-overhead", "max-autotune"):
        from torch._inductor import config as inductor_config

        # max-autotune prints every candidate kernel's timing to stderr: keep the notebook readable
        for key, quiet in (("autotune_num_choices_displayed", 0), ("max_autotune_report_choices_stats", False)):
            if hasattr(inductor_config, key):
                setattr(inductor_config, key, quiet)
        mode = None if variant == "compile" else variant
        step = torch.compile(train_step, mode=mode)
    return Program("launch", variant, step, batch,
                   note=f"MLP {sz.mlp_depth}×{sz.mlp_width}, batch {batch}" + (
                       f", torch.compile(mode={variant!r})" if variant not in ("planted", "batch") else ""))


def _precision_program(variant: str, device: str, sz: Sizes, seed: int) -> Program:
    torch.manual_seed(seed)
    cuda = device.startswith("cuda")
    w = sz.big_width
    model = nn.Sequential(nn.Linear(w, 4 * w), nn.GELU(), nn.Linear(4 * w, w), nn.GELU(),
                          nn.Linear(w, 4 * w), nn.GELU(), nn.Linear(4 * w, w)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sz.big_tokens, w, generator=g).to(device)
    bf16 = variant == "fixed"

    def step() -> None:
        with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Program("precision", variant, step, sz.big_tokens,
                   note=f"FFN {w}→{4 * w}→{w} ×2, {sz.big_tokens} tokens, " + ("bf16 autocast" if bf16 else
                                                                                "fp32 (TF32 off)"))


def _gpu_data_program(device: str, sz: Sizes, seed: int) -> Program:
    """Every fix, and the input pipeline on the device: PNGs decoded once into a uint8 tensor there; each step
    draws indices, rotates by random angles (affine_grid + grid_sample) and normalizes, all on the device."""
    torch.manual_seed(seed)
    cuda = device.startswith("cuda")
    png, labels = digits_png(sz.image)
    images = torch.from_numpy(np.stack([np.asarray(Image.open(io.BytesIO(b))) for b in png])).to(device)
    targets = torch.from_numpy(labels).to(device)
    fmt = torch.channels_last if cuda else torch.contiguous_format
    model = ImageNet(sz.width).to(device).to(memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator(device=device).manual_seed(seed)
    log = _LossLog(device, 20)
    max_angle = math.radians(12)

    def step() -> None:
        idx = torch.randint(0, len(images), (sz.batch,), device=device, generator=gen)
        x = images[idx].unsqueeze(1).float().div_(255.0).sub_(0.5).div_(0.5)
        angle = (torch.rand(sz.batch, device=device, generator=gen) * 2 - 1) * max_angle
        cos, sin = angle.cos(), angle.sin()
        theta = torch.stack([torch.stack([cos, -sin, torch.zeros_like(cos)], 1),
                             torch.stack([sin, cos, torch.zeros_like(cos)], 1)], 1)
        grid = torch.nn.functional.affine_grid(theta, list(x.shape), align_corners=False)
        x = torch.nn.functional.grid_sample(x, grid, align_corners=False).contiguous(memory_format=fmt)
        with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=cuda):
            loss = loss_fn(model(x), targets[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        log.add(loss)

    return Program("all", "gpu-data", step, sz.batch,
                   note=f"{sz.image}×{sz.image} digits decoded once on the {'GPU' if cuda else 'device'}, rotated "
                        f"there, batch {sz.batch}, width {sz.width}" + (", bf16, channels-last" if cuda else ""))


def build(name: str, variant: str, device: str, quick: bool = False, seed: int = 0) -> Program:
    """The program ``name`` (one of ``PROGRAMS``) in ``variant`` (see ``VARIANTS``) on ``device``."""
    if name not in VARIANTS:
        raise ValueError(f"build(name={name!r}): one of {', '.join(PROGRAMS)}")
    if variant not in VARIANTS[name]:
        raise ValueError(f"build({name!r}, variant={variant!r}): one of {', '.join(VARIANTS[name])}")
    sz = sizes_for(device, quick)
    if name == "data":
        return _image_program(name, variant, device, sz, {"sync"} | ({"data"} if variant == "fixed" else set()), seed)
    if name == "all" and variant == "gpu-data":
        return _gpu_data_program(device, sz, seed)
    if name == "all":
        fixes = {"data", "sync", "bf16", "cl"} if variant == "fixed" else set()
        return _image_program(name, variant, device, sz, fixes, seed)
    if name == "sync":
        return _sync_program(variant, device, sz, seed)
    if name == "launch":
        return _launch_program(variant, device, sz, seed)
    return _precision_program(variant, device, sz, seed)
