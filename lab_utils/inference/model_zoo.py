"""Lab 03's two workloads: the digits CNN, trained here so that accuracy is measurable, and a ResNet-50 with
random weights, for speed; what each is (``ModelInfo``) and the random images that feed it.

The digits CNN is lab 02's, trained in seconds on scikit-learn's 8x8 digits. The ResNet-50 is torchvision's
``resnet50`` on a GPU where torchvision imports (an optional dependency, imported where it is used), else
``lab_utils.models.BottleneckResNet``; on a CPU the same layout at width 16 and 64 px, so the lab stays fast."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from lab_utils.args import check_int
from lab_utils.inference.compare import accuracy
from lab_utils.models import (
    RESNET50_BLOCKS,
    BottleneckResNet,
    DigitsCNN,
    digits_arrays,
    fit_digits_cnn,
)

# The digits CNN's training recipe (lab 02's DDP runs use the same CNN and split).
DIGITS_EPOCHS = 4
DIGITS_BATCH_SIZE = 64
DIGITS_LR = 0.05
DIGITS_MOMENTUM = 0.9
DIGITS_WIDTH = 32

# ResNet-50 sizes by device: a GPU gets the real thing (25.6 M parameters, 4.1 GFLOP per 224 px image);
# a CPU the same 50-layer bottleneck layout at a quarter of the width and 64 px (about 2 M parameters).
RESNET_SIZES = {"cuda": {"width": 64, "image_size": 224}, "cpu": {"width": 16, "image_size": 64}}


@dataclass
class ModelInfo:
    """What a model is: where it came from, its size and its input."""

    name: str
    source: str
    params_m: float  # millions of parameters
    input_shape: tuple[int, ...]  # one sample, without the batch dimension
    gflop_per_image: float  # multiply-adds x 2 of one forward pass
    notes: str = ""
    slug: str = ""  # for result names: the same slug means the same model, so runs compare as ratios

    def __str__(self) -> str:
        shape = "x".join(map(str, self.input_shape))
        return (f"{self.name}: {self.source}; {self.params_m:.2f} M parameters, input {shape}, "
                f"{self.gflop_per_image:.3g} GFLOP per image{'; ' + self.notes if self.notes else ''}")


def count_gflop(model: nn.Module, input_shape: Sequence[int]) -> float:
    """GFLOP (2 x multiply-adds) of one forward pass on one sample, counted over Conv2d and Linear layers."""
    macs: list[int] = []

    def hook(mod: nn.Module, inputs: Any, out: torch.Tensor) -> None:
        if isinstance(mod, nn.Conv2d):
            k = mod.kernel_size[0] * mod.kernel_size[1] * mod.in_channels // mod.groups
            macs.append(out[0].numel() * k)
        elif isinstance(mod, nn.Linear):
            macs.append(out[0].numel() * mod.in_features)

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    try:
        p = next(model.parameters())
        with torch.no_grad():
            model(torch.zeros((1, *input_shape), dtype=p.dtype, device=p.device))
    finally:
        for h in handles:
            h.remove()
    return 2 * sum(macs) / 1e9


def _params_m(model: nn.Module) -> float:
    return sum(p.numel() for p in model.parameters()) / 1e6


@functools.lru_cache(maxsize=4)
def trained_digits(epochs: int = DIGITS_EPOCHS, seed: int = 0) -> tuple[DigitsCNN, dict[str, Any]]:
    """Lab 02's digits CNN trained on the CPU, once per process (the lab and its exercise checks share it); returns
    (model in eval mode, facts). Its users must not train it further (copy it first).

    1440 training images, SGD with momentum, cross-entropy; a few seconds on a laptop CPU. The facts hold
    ``accuracy`` (test set, 357 images, fp32), ``train_s`` and the recipe."""
    check_int(epochs, "epochs", "trained_digits")
    data = digits_arrays()
    y = torch.from_numpy(data["y_train"])
    t0 = time.perf_counter()
    model, _ = fit_digits_cnn(torch.from_numpy(data["x_train"]), y, epochs=epochs, lr=DIGITS_LR, seed=seed,
                              width=DIGITS_WIDTH, batch_size=DIGITS_BATCH_SIZE, momentum=DIGITS_MOMENTUM)
    train_s = time.perf_counter() - t0
    with torch.no_grad():
        logits = model(torch.from_numpy(data["x_test"])).numpy()
    facts = {"accuracy": accuracy(logits, data["y_test"]), "train_s": train_s, "epochs": epochs, "seed": seed,
             "width": DIGITS_WIDTH, "train_images": int(len(y)), "test_images": int(len(data["y_test"]))}
    return model, facts


class StochasticDepthNet(nn.Module):
    """Input (B, 1, 8, 8) -> logits (B, 10): a convolution with batch norm, a residual block with stochastic depth
    and dropout before the classifier. Its training behaviour differs from its inference behaviour (the
    residual branch is dropped at random per sample in training, as in EfficientNet, ConvNeXt or Swin), which
    is what an export of a model still in train mode gets wrong."""

    def __init__(self, width: int = 8, survival: float = 0.5):
        super().__init__()
        self.survival = survival
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(width * 64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)  # (B, w, 8, 8)
        branch = self.block(x)
        if self.training:  # stochastic depth: keep the branch with probability `survival`, per sample
            keep = (torch.rand(x.shape[0], 1, 1, 1, device=x.device) < self.survival).to(x.dtype)
            branch = branch * keep / self.survival
        return self.head(torch.relu(x + branch))


def export_check_model(seed: int = 0) -> StochasticDepthNet:
    """A ``StochasticDepthNet`` with random weights and settled batch-norm statistics, left in train mode as a
    model is at the end of a training loop (what lab 03's export exercise hands the student's function)."""
    torch.manual_seed(seed)
    model = StochasticDepthNet()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(32, 1, 8, 8, generator=gen))
    return model.train()


def digits_info(model: nn.Module) -> ModelInfo:
    """The digits CNN's ``ModelInfo`` (input one 8x8 grey image)."""
    return ModelInfo("digits CNN", "lab 02's DigitsCNN, trained here", _params_m(model), (1, 8, 8),
                     count_gflop(model, (1, 8, 8)), slug="digits")


def make_resnet50(device: str = "cpu", width: int | None = None, image_size: int | None = None,
                  seed: int = 0) -> tuple[nn.Module, ModelInfo]:
    """A ResNet-50 with random weights for speed measurements, in eval mode on ``device``.

    On a GPU, at full size: ``torchvision.models.resnet50(weights=None)`` when torchvision imports, else
    ``lab_utils.models.BottleneckResNet`` (the same layout). On a CPU the same layout at width 16 and 64 px
    (``RESNET_SIZES``). BatchNorm statistics are settled on a few random batches, so activations keep a realistic scale
    (random weights with fresh statistics let values grow layer after layer, which low precision punishes unfairly)."""
    kind = "cuda" if str(device).startswith("cuda") else "cpu"
    width = RESNET_SIZES[kind]["width"] if width is None else check_int(width, "width", "make_resnet50")
    image_size = (RESNET_SIZES[kind]["image_size"] if image_size is None
                  else check_int(image_size, "image_size", "make_resnet50", 32))
    torch.manual_seed(seed)
    source = f"lab_utils bottleneck ResNet-50 layout {RESNET50_BLOCKS}, width {width}"
    model: nn.Module | None = None
    if width == 64:  # torchvision is optional: the lab's own BottleneckResNet has the same layout and parameter count
        with contextlib.suppress(ImportError):
            from torchvision.models import resnet50  # type: ignore[import-not-found,import-untyped,unused-ignore]

            model, source = resnet50(weights=None), "torchvision.models.resnet50(weights=None)"
    if model is None:
        model = BottleneckResNet(width, RESNET50_BLOCKS)
    model = model.to(device)
    _settle_batchnorm(model, image_size, device)
    model.eval()
    info = ModelInfo("ResNet-50" if width == 64 else f"ResNet-50 layout (width {width})", source,
                     _params_m(model), (3, image_size, image_size), count_gflop(model, (3, image_size, image_size)),
                     "random weights, for speed",
                     slug="resnet50" if (width, image_size) == (64, 224) else f"resnet50-w{width}-{image_size}px")
    return model, info


def _settle_batchnorm(model: nn.Module, image_size: int, device: str) -> None:
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()
            m.momentum = None  # a cumulative average over the settling batches
    model.train()
    gen = torch.Generator(device="cpu").manual_seed(1)
    with torch.no_grad():
        for _ in range(2):
            model(torch.randn(8, 3, image_size, image_size, generator=gen).to(device))
    model.eval()


def random_images(n: int, shape: Sequence[int], seed: int = 0) -> np.ndarray:
    """(n, *shape) float32 standard-normal images: random, not zeros (zeros run faster than real data)."""
    return np.random.default_rng(seed).standard_normal((n, *shape)).astype(np.float32)
