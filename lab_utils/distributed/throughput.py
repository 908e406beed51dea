"""Lab 02 DDP speed: images/s of a ResNet per world size (``throughput``, ``scaling``), the effect of DDP's gradient
buckets (``overlap_experiment``), and the two-H200 reference run beside the local numbers. Units are in names:
``_ms`` milliseconds, ``_mib`` MiB (2**20 bytes), ``images_per_s`` per second of wall time.

Design notes: docs/internals.md#lab_utilsdistributedddppy"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lab_utils.args import check_int
from lab_utils.course.catalog import repo_root
from lab_utils.course.specs import h200_measured
from lab_utils.distributed.ddp_base import (
    all_reduce_values,
    amp_autocast,
    check_amp,
    each_world_size,
    is_cuda,
    launch_ticking,
    share_cpu_threads,
    wrap_ddp,
)
from lab_utils.distributed.spawn import WorkerContext, choose_backend, torch_gpu_count
from lab_utils.models import MIB, make_resnet, param_mib, resnet_blocks
from lab_utils.timing import benchmark, cpu_cores, cpu_model

if TYPE_CHECKING:  # the tables are built in the launcher: ranks running a worker never import pandas
    import pandas as pd

# throughput defaults: (GPU, CPU). GPU: ResNet-18, 224 px, bf16, batch 256 per GPU: about 20 ms per step on
# an H200, GPU-bound, and DDP hides its 45 MiB all-reduce (~0.2 ms over NVLink) in the backward pass: 99 %
# scaling efficiency on 2 H200s [H200 run]. At batch 128 a step (~11 ms) is bound by the host's kernel
# launches instead, DDP's per-step host work shows, and the same run gave 79 %. CPU: a tiny ResNet.
THROUGHPUT_DEFAULTS = {"steps": (30, 10), "warmup_steps": (10, 3), "batch_size": (256, 16), "image_size": (224, 32),
                       "width": (64, 8), "depth": (18, 10), "amp": ("bf16", None), "channels_last": (True, False)}
# The variants overlap_experiment times. DDP has no "overlap" switch: it always starts a bucket's all-reduce when the
# bucket's gradients are ready, during backward. What shapes the overlap: bucket_cap_mb (smaller buckets start
# earlier), gradient_as_bucket_view (no copy into the buckets), static_graph, and no_sync (no all-reduce at all
# for the micro-batches of a gradient accumulation). ``ddp=False`` is the course's baseline without DDP: one
# all-reduce of all gradients after the whole backward pass. ``accumulate=k``: k micro-batches per optimizer step,
# the first k-1 under DDP's no_sync().
DEFAULT_BUCKETS = {"bucket_cap_mb": 25, "gradient_as_bucket_view": False, "ddp": True, "accumulate": 1}
NO_DDP = "no DDP: one all-reduce after backward"
_RECORDED_AS = {NO_DDP: "no overlap (all-reduce after backward)"}  # that variant's name in runs recorded before

# [H200 run] one H200 alone, the GPU defaults above (ResNet-18, 224 px, batch 256, bf16), ms per step (mean of 30
# after 10, best of 2 rounds; overlap_experiment on one rank): DDP over a one-rank NCCL group against the model
# without DDP. What DDP's hooks and bucket copies cost with nobody to talk to: 2.5 % of a step (2.6 % in a second run).
H200_ONE_GPU_STEP_MS = {"DDP, 25 MB buckets": 20.13, "DDP, gradient_as_bucket_view": 19.97, "no DDP": 19.64}


def _throughput_config(ctx: WorkerContext, **kw: Any) -> dict[str, Any]:
    gpu = is_cuda(ctx)
    cfg = {}
    for k, (on_gpu, on_cpu) in THROUGHPUT_DEFAULTS.items():
        v = kw.get(k, "auto")
        # 'auto' (and None, except for amp where None means fp32) takes the device's default
        cfg[k] = (on_gpu if gpu else on_cpu) if v == "auto" or (v is None and k != "amp") else v
    where = "throughput"
    for k in ("steps", "batch_size", "width"):
        check_int(cfg[k], k, where)
    check_int(cfg["warmup_steps"], "warmup_steps", where, 0)
    check_int(cfg["image_size"], "image_size", where, 8)
    check_amp(cfg["amp"], where)
    resnet_blocks(cfg["depth"])
    cfg["num_classes"] = check_int(kw.get("num_classes", 1000), "num_classes", where, 2)
    cfg["bucket_cap_mb"] = kw.get("bucket_cap_mb", DEFAULT_BUCKETS["bucket_cap_mb"])
    if not (isinstance(cfg["bucket_cap_mb"], (int, float)) and cfg["bucket_cap_mb"] > 0):
        raise ValueError(f"{where}(bucket_cap_mb={cfg['bucket_cap_mb']!r}): must be a number of MB > 0")
    cfg["gradient_as_bucket_view"] = bool(kw.get("gradient_as_bucket_view", False))
    cfg["ddp"] = bool(kw.get("ddp", True))
    cfg["accumulate"] = check_int(kw.get("accumulate", 1), "accumulate", where)
    if cfg["accumulate"] > 1 and not cfg["ddp"]:
        raise ValueError(f"{where}(accumulate={cfg['accumulate']}, ddp=False): no_sync accumulation is DDP's; "
                         "use accumulate=1 without DDP")
    return cfg


def _time_steps(ctx: WorkerContext, cfg: dict[str, Any]) -> dict[str, Any]:
    """Build model + DDP for one configuration and time ``steps`` training steps (after warm-up) on every rank."""
    if is_cuda(ctx):
        torch.backends.cudnn.benchmark = True  # fixed shapes: let cuDNN pick its fastest kernels in warm-up
    torch.manual_seed(0)
    model = make_resnet(cfg["width"], cfg["depth"], cfg["num_classes"], cfg["image_size"]).to(ctx.device)
    fmt = torch.channels_last if cfg["channels_last"] else torch.contiguous_format
    model = model.to(memory_format=fmt)  # NHWC: the layout cuDNN's tensor-core convolutions want
    b, s = cfg["batch_size"], cfg["image_size"]
    # One synthetic batch made on the device, reused every step: the loop measures compute + communication only.
    x = torch.randn(b, 3, s, s, device=ctx.device).contiguous(memory_format=fmt)  # (B, 3, H, W)
    y = torch.randint(0, cfg["num_classes"], (b,), device=ctx.device)
    params = list(model.parameters())
    net: torch.nn.Module
    if cfg["ddp"]:
        net = wrap_ddp(ctx, model, bucket_cap_mb=cfg["bucket_cap_mb"],
                   gradient_as_bucket_view=cfg["gradient_as_bucket_view"])
    else:  # the baseline without DDP: one all-reduce of all gradients after the whole backward pass
        net = model
        for p in params:
            dist.broadcast(p.data, 0, group=ctx.group)  # rank 0 of the group is global rank 0
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)

    k = cfg["accumulate"]

    def step() -> None:
        for _ in range(k - 1):  # micro-batches whose gradients only accumulate: no all-reduce under no_sync
            with net.no_sync(), amp_autocast(ctx, cfg["amp"]):
                F.cross_entropy(net(x), y).backward()
        with amp_autocast(ctx, cfg["amp"]):
            loss = F.cross_entropy(net(x), y)
        loss.backward()  # the last micro-batch: DDP all-reduces the accumulated gradients, overlapped with it
        if not cfg["ddp"] and ctx.world_size > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params])  # one flat fp32 buffer of all gradients
            dist.all_reduce(flat, group=ctx.group)
            flat /= ctx.world_size
            for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
                p.grad.copy_(g.view_as(p.grad))
        opt.step()
        # set_to_none=False zeroes in place: with gradient_as_bucket_view the gradients stay views into DDP's
        # buckets (set to None, DDP would copy fresh gradients into the buckets again each step).
        opt.zero_grad(set_to_none=False)

    timing = benchmark(step, reps=cfg["steps"], warmup=cfg["warmup_steps"], device=ctx.device, name="ddp step")
    # Ranks wait for each other in every all-reduce; the slowest one sets the job's pace.
    mean_ms, median_ms = all_reduce_values(ctx, [timing.mean_ms, timing.median_ms], op="max")
    mean_ms, median_ms = mean_ms / k, median_ms / k  # per micro-batch: variants compare at the same work
    buckets = None
    if cfg["ddp"]:
        with contextlib.suppress(Exception):  # private logging API: its keys vary between torch versions
            log = net._get_ddp_logging_data()  # the layout after the first step's rebuild, where there was one
            sizes = str(log.get("rebuilt_bucket_sizes") or log.get("bucket_sizes", "")).strip()  # "bytes, ..."
            buckets = len(sizes.split(",")) if sizes else None
    global_batch = b * ctx.world_size
    # the model, optimizer and batch go with this frame: the next variant starts with free memory
    return {"world_size": ctx.world_size, "backend": ctx.backend,
            "device": torch.cuda.get_device_name(ctx.device) if is_cuda(ctx) else f"cpu ({cpu_model()})",
            **{k: cfg[k] for k in ("batch_size", "image_size", "width", "amp", "channels_last", "bucket_cap_mb",
                                   "gradient_as_bucket_view", "ddp", "accumulate", "steps",
                                   "warmup_steps")},
            "depth": cfg["depth"] if isinstance(cfg["depth"], int) else tuple(cfg["depth"]),
            "global_batch": global_batch, "step_ms": mean_ms, "step_ms_median": median_ms,
            "images_per_s": global_batch / (mean_ms * 1e-3), "images_per_s_per_worker": b / (mean_ms * 1e-3),
            "n_params": sum(p.numel() for p in params), "params_mib": param_mib(model),
            "grads_mib": sum(p.numel() * 4 for p in params) / MIB,  # DDP reduces fp32 gradients, even under autocast
            "buckets": buckets}


def throughput(ctx: WorkerContext, steps: int | None = None, warmup_steps: int | None = None,
               batch_size: int | None = None, image_size: int | None = None, width: int | None = None,
               depth: int | Sequence[int] | None = None, amp: str | None = "auto", bucket_cap_mb: float = 25,
               gradient_as_bucket_view: bool = False, channels_last: bool | None = None, num_classes: int = 1000,
               ddp: bool = True, accumulate: int = 1, cpu_threads: int | None = None) -> dict[str, Any]:
    """Worker: DDP training steps of a ResNet on random images; time per step and images/s.

    Defaults (None/'auto'): ``THROUGHPUT_DEFAULTS`` of the device. step_ms: the mean of ``benchmark``'s repetitions,
    max over ranks, per micro-batch. ``ddp=False``: no DDP, one all-reduce after the backward pass (DDP itself has no
    switch for overlap). ``accumulate=k``: k micro-batches per optimizer step, the first k-1 under ``no_sync()``
    (gradients accumulate, no all-reduce); step_ms is per micro-batch. ``cpu_threads``: torch
    threads per CPU rank (default: the cores shared equally among the local ranks).

    Returns step_ms, step_ms_median, images_per_s (whole job), images_per_s_per_worker, n_params,
    params_mib, grads_mib (all-reduced per step), buckets (where torch reports it) and the configuration."""
    share_cpu_threads(ctx, cpu_threads)
    cfg = _throughput_config(ctx, steps=steps, warmup_steps=warmup_steps, batch_size=batch_size,
                             image_size=image_size, width=width, depth=depth, amp=amp, channels_last=channels_last,
                             bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=gradient_as_bucket_view,
                             num_classes=num_classes, ddp=ddp, accumulate=accumulate)
    ctx.status(f"timing {cfg['steps']} steps")
    return _time_steps(ctx, cfg)


def _default_nprocs() -> int:
    return max(2, torch_gpu_count())


def scaling(nprocs_list: Sequence[int] | None = None, *, backend: str = "auto", timeout_s: float = 600.0,
            progress: Callable[..., Any] | None = None, **kwargs: Any) -> pd.DataFrame:
    """Launch ``throughput`` at each world size (default 1 and max(2, GPUs)); one row per world size.

    Columns: world_size, backend, device, batch_size (per worker, fixed: weak scaling), global_batch, step_ms,
    images_per_s, images_per_s_per_worker, speedup and scaling_efficiency against the smallest world size N_0
    (images_per_s_N / ((N / N_0) × images_per_s_N0), 1.0 = perfect). CPU ranks (gloo) get cores // max(nprocs_list)
    threads each unless ``cpu_threads`` is given: a worker is a fixed unit of compute, as a GPU is. All world sizes
    run in one launch (``each_world_size``); ``progress`` steps per world size (``launch_ticking``)."""
    nprocs_list = list(nprocs_list) if nprocs_list is not None else [1, _default_nprocs()]
    for n in nprocs_list:
        check_int(n, "nprocs_list", "scaling")
    if choose_backend(max(nprocs_list), backend) == "gloo" and kwargs.get("cpu_threads") is None:
        kwargs["cpu_threads"] = max(1, cpu_cores() // max(nprocs_list))
    work = {"fn": throughput, "runs": [(n, kwargs) for n in nprocs_list]}
    rows = launch_ticking(each_world_size, max(nprocs_list), work, backend=backend, timeout_s=timeout_s,
                           progress=progress, total=len(nprocs_list), desc="DDP scaling: world sizes",
                           prefix="world size ")
    import pandas as pd

    df = pd.DataFrame(rows)
    base = df.loc[df["world_size"].idxmin()]
    df["speedup"] = df["images_per_s"] / base["images_per_s"]
    df["scaling_efficiency"] = df["speedup"] / (df["world_size"] / base["world_size"])
    first = ["world_size", "backend", "device", "batch_size", "global_batch", "step_ms", "images_per_s",
             "images_per_s_per_worker", "speedup", "scaling_efficiency"]
    return df[first + [c for c in df.columns if c not in first]]


def _variant_label(v: dict[str, Any]) -> str:
    if not v.get("ddp", True):
        return NO_DDP
    parts = [f"bucket_cap_mb={v.get('bucket_cap_mb', DEFAULT_BUCKETS['bucket_cap_mb']):g}"]
    if v.get("gradient_as_bucket_view"):
        parts.append("gradient_as_bucket_view")
    if v.get("accumulate", 1) > 1:
        parts.append(f"no_sync, all-reduce every {v['accumulate']} micro-batches")
    return ", ".join(parts)


def _normalise_variant(v: dict[str, Any]) -> dict[str, Any]:
    if unknown := set(v) - set(DEFAULT_BUCKETS):
        raise ValueError(f"overlap_experiment(variants=...): unknown key(s) {sorted(unknown)}; "
                         f"use {sorted(DEFAULT_BUCKETS)}")
    return {**DEFAULT_BUCKETS, **v}


def overlap_worker(ctx: WorkerContext, variants: Sequence[dict[str, Any]], repeats: int = 2,
                   cpu_threads: int | None = None, **kwargs: Any) -> list[dict[str, Any]]:
    """Worker: ``throughput`` for each bucket variant in one process group, round-robin ``repeats`` times.

    Round-robin (not one variant after the other) spreads slow drifts (clocks, temperature) over all
    variants; each variant keeps its fastest repeat."""
    share_cpu_threads(ctx, cpu_threads)
    best: dict[int, dict[str, Any]] = {}
    for r in range(repeats):
        for i, v in enumerate(variants):
            ctx.status(f"repeat {r + 1}/{repeats}: {_variant_label(v)}")
            res = _time_steps(ctx, _throughput_config(ctx, **{**kwargs, **v}))
            if i not in best or res["step_ms"] < best[i]["step_ms"]:
                best[i] = res
    return [best[i] for i in range(len(variants))]


def overlap_experiment(nprocs: int | None = None, variants: Sequence[dict[str, Any]] | None = None, *,
                       repeats: int = 2, backend: str = "auto", timeout_s: float = 600.0,
                       progress: Callable[..., Any] | None = None, **kwargs: Any) -> pd.DataFrame:
    """The measured effect of DDP's bucket settings on step time, at ``nprocs`` ranks (default max(2, GPUs)).

    ``variants``: dicts of bucket_cap_mb, gradient_as_bucket_view, accumulate (k micro-batches, the first k-1 under
    DDP's no_sync) and ddp (False: no DDP, one all-reduce after backward); default [{bucket_cap_mb: 1},
    {bucket_cap_mb: 25}, {gradient_as_bucket_view: True}]. The default configuration (DDP, 25 MB, no views, an
    all-reduce every micro-batch) is added when missing. Other keyword arguments go to
    ``throughput`` (model size, batch, amp...). Columns: variant, bucket_cap_mb, gradient_as_bucket_view,
    ddp, accumulate, step_ms (per micro-batch), images_per_s, step_ms_vs_default (< 1 is faster),
    images_per_s_vs_default, buckets.
    ``progress`` steps per variant timed (``launch_ticking``)."""
    nprocs = _default_nprocs() if nprocs is None else check_int(nprocs, "nprocs", "overlap_experiment")
    check_int(repeats, "repeats", "overlap_experiment")
    if variants is None:
        variants = [{"bucket_cap_mb": 1}, {"bucket_cap_mb": 25}, {"gradient_as_bucket_view": True}]
    full = [_normalise_variant(v) for v in variants]
    if DEFAULT_BUCKETS not in full:
        full.insert(0, dict(DEFAULT_BUCKETS))
    kw = {"variants": full, "repeats": repeats, **kwargs}
    rows = launch_ticking(overlap_worker, nprocs, kw, backend=backend, timeout_s=timeout_s, progress=progress,
                           total=repeats * len(full), desc="DDP bucket variants: runs", prefix="repeat ")
    import pandas as pd

    df = pd.DataFrame(rows)
    df.insert(0, "variant", [_variant_label(v) for v in full])
    base = df.loc[[v == DEFAULT_BUCKETS for v in full]].iloc[0]
    df["step_ms_vs_default"] = df["step_ms"] / base["step_ms"]
    df["images_per_s_vs_default"] = df["images_per_s"] / base["images_per_s"]
    first = ["variant", "bucket_cap_mb", "gradient_as_bucket_view", "ddp", "accumulate", "world_size", "step_ms",
             "images_per_s", "step_ms_vs_default", "images_per_s_vs_default", "buckets"]
    return df[first + [c for c in df.columns if c not in first]]


# --- The two-H200 reference run beside the local numbers ------------------------------------------

H200X2_RUN = "h200x2"  # reference_runs/h200x2: lab 02 executed on two H200 SXM joined by NV18 (NVLS off)


def record_name(variant: str) -> str:
    """The results name of an overlap variant's step time (as the lab records it): ``ddp_step_ms_<variant>``."""
    return f"ddp_step_ms_{variant}".replace(" ", "_").replace("=", "_")


def h200x2_results(run_dir: str | os.PathLike[str] | None = None) -> dict[str, float]:
    """What the committed two-H200 run recorded for lab 02, by name (empty when the run has none)."""
    return h200_measured("02", run_dir if run_dir is not None else repo_root() / "reference_runs" / H200X2_RUN)


def with_reference_scaling(df: pd.DataFrame, run_dir: str | os.PathLike[str] | None = None) -> pd.DataFrame:
    """``scaling``'s frame with the two-H200 run's images/s and efficiency at the same world size (NaN where that
    run has none): columns ``h200x2_images_per_s`` and ``h200x2_scaling_efficiency``."""
    ref = h200x2_results(run_dir)
    out = df.copy()
    out["h200x2_images_per_s"] = [ref.get(f"ddp_images_per_s_{int(n)}", math.nan) for n in out["world_size"]]
    base = ref.get("ddp_images_per_s_1", math.nan)  # efficiency as ``scaling`` computes it, against 1 GPU
    out["h200x2_scaling_efficiency"] = out["h200x2_images_per_s"] / (out["world_size"] * base)
    return out


def with_reference_overlap(df: pd.DataFrame, run_dir: str | os.PathLike[str] | None = None) -> pd.DataFrame:
    """``overlap_experiment``'s frame with the two-H200 run's step time for the same variant, and that time
    relative to its own default variant: columns ``h200x2_step_ms`` and ``h200x2_step_ms_vs_default``."""
    ref = h200x2_results(run_dir)
    out = df.copy()
    out["h200x2_step_ms"] = [ref.get(record_name(v), ref.get(record_name(_RECORDED_AS.get(v, v)), math.nan))
                             for v in out["variant"]]
    base = ref.get(record_name(_variant_label(DEFAULT_BUCKETS)), math.nan)
    out["h200x2_step_ms_vs_default"] = out["h200x2_step_ms"] / base
    return out
