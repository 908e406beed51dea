"""Lab 02 DDP training: digits accuracy under DistributedDataParallel, and ResNet throughput scaling.

Worker functions for ``lab_utils.distributed.spawn.launch`` or torchrun (``scripts/train_ddp.py``): ``train_digits``
(correctness: N ranks reach the single-process test accuracy) and ``throughput`` (speed: images/s per world size,
scaling efficiency, DDP's gradient buckets). Units are in names: ``_ms`` milliseconds, ``_s`` seconds, ``_mib`` MiB
(2**20 bytes), ``images_per_s`` and ``samples_per_s`` per second of wall time. Accuracies are fractions in [0, 1].

Design notes: docs/internals.md#lab_utilsdistributedddppy"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler

from lab_utils.args import check_int
from lab_utils.course.catalog import repo_root
from lab_utils.course.specs import h200_measured
from lab_utils.distributed.spawn import WorkerContext, choose_backend, launch, mp_context, torch_gpu_count
from lab_utils.models import MIB, DigitsCNN, digits_arrays, make_digits_cnn, make_resnet, param_mib, resnet_blocks
from lab_utils.procs import env_int
from lab_utils.timing import benchmark, cpu_cores, cpu_model, sync

AMP_MODES = (None, "bf16", "fp16")


# Hyperparameters of the digits runs (see ``train_digits``): the GLOBAL batch is held constant across world
# sizes, so N ranks take the same number of steps of the same size as one process, with the same lr.
DIGITS_DEFAULTS = {"epochs": 8, "global_batch": 64, "lr": 0.05, "momentum": 0.9, "width": 32}


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


# --- Checks and small helpers ---------------------------------------------------------------------


def _check_amp(amp: Any, where: str) -> str | None:
    if amp not in AMP_MODES:
        raise ValueError(f"{where}(amp={amp!r}): use None (fp32), 'bf16' (autocast) or 'fp16' (autocast + GradScaler)")
    return amp


def _is_cuda(ctx: WorkerContext) -> bool:
    return str(ctx.device).startswith("cuda")


def _share_cpu_threads(ctx: WorkerContext, threads: int | None = None) -> None:
    """CPU ranks on one machine share its cores: each gets ``threads`` or an equal share of them.

    Without this every rank starts one thread per core and the ranks fight for them (slower than one rank).
    OMP_NUM_THREADS, when set (torchrun sets it to 1 for several ranks per node), is left to rule."""
    if _is_cuda(ctx):
        return
    if threads is not None:
        torch.set_num_threads(check_int(threads, "cpu_threads", "throughput"))
    elif "OMP_NUM_THREADS" not in os.environ:
        local = env_int("LOCAL_WORLD_SIZE", ctx.world_size, minimum=1)
        torch.set_num_threads(max(1, cpu_cores() // max(1, local)))


def _autocast(ctx: WorkerContext, amp: str | None) -> contextlib.AbstractContextManager[Any]:
    if amp is None:
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device_type="cuda" if _is_cuda(ctx) else "cpu", dtype=dtype)


def _grad_scaler(ctx: WorkerContext, amp: str | None) -> torch.amp.GradScaler:
    """torch.amp.GradScaler for fp16 (disabled otherwise); a torch without a CPU scaler is reported, not faked."""
    dev = "cuda" if _is_cuda(ctx) else "cpu"
    try:
        return torch.amp.GradScaler(dev, enabled=amp == "fp16")
    except (AttributeError, TypeError, RuntimeError) as exc:
        raise RuntimeError(f"amp='fp16' needs torch.amp.GradScaler({dev!r}), which torch {torch.__version__} does not "
                           f"offer ({exc}); use amp='bf16' (no scaler needed) or a GPU") from exc


def _ddp(ctx: WorkerContext, model: torch.nn.Module, **kw: Any) -> DistributedDataParallel:
    kw.setdefault("process_group", ctx.group)  # None: the default group
    if _is_cuda(ctx):  # one GPU per process: DDP must be told which one
        index = torch.device(ctx.device).index
        return DistributedDataParallel(model, device_ids=[index], output_device=index, **kw)
    return DistributedDataParallel(model, **kw)


def _all_reduce(ctx: WorkerContext, values: Sequence[float | torch.Tensor], op: str = "sum") -> list[float]:
    """All-reduce a few numbers (SUM or MAX) in float64 on the rank's device (NCCL needs GPU tensors)."""
    t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=ctx.device) for v in values])
    if dist.is_initialized() and ctx.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=ctx.group)
    return [float(v) for v in t.tolist()]


# --- Digits data ----------------------------------------------------------------------------------


def _digits_tensors(device: str) -> dict[str, torch.Tensor]:
    # The whole set is 1797 * 64 floats: it lives on the device and batches are index gathers, no DataLoader.
    return {k: torch.from_numpy(v).to(device) for k, v in digits_arrays().items()}


def per_rank_batch(global_batch: int, world_size: int, accumulate: int = 1) -> int:
    """Micro-batch per rank so that one optimizer step sees ``global_batch`` images in all (must divide evenly)."""
    check_int(global_batch, "global_batch", "per_rank_batch")
    check_int(world_size, "world_size", "per_rank_batch")
    check_int(accumulate, "accumulate", "per_rank_batch")
    if global_batch % (world_size * accumulate):
        raise ValueError(f"per_rank_batch(global_batch={global_batch}): not divisible by world_size × accumulate "
                         f"= {world_size} × {accumulate}; choose a global batch that is")
    return global_batch // (world_size * accumulate)


def sampler_orders(n: int, world_size: int, epochs: int, seed: int = 0,
                   set_epoch: bool = True) -> list[list[list[int]]]:
    """The indices DistributedSampler(shuffle=True, seed) hands each rank, by epoch: ``orders[epoch][rank]``.

    No process group needed (the sampler is told num_replicas and rank). With ``set_epoch=False`` every epoch
    repeats epoch 0's order: the bug ``sampler.set_epoch(epoch)`` prevents."""
    check_int(n, "n", "sampler_orders")
    check_int(world_size, "world_size", "sampler_orders")
    check_int(epochs, "epochs", "sampler_orders")
    samplers = [DistributedSampler(range(n), num_replicas=world_size, rank=r, shuffle=True, seed=seed)
                for r in range(world_size)]
    orders = []
    for epoch in range(epochs):
        for s in samplers:
            if set_epoch:
                s.set_epoch(epoch)
        orders.append([list(s) for s in samplers])
    return orders


# --- Evaluation -----------------------------------------------------------------------------------


def _eval_counts(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                 batch: int = 512) -> tuple[torch.Tensor, int]:
    """(number correct as a device tensor, number of samples) for inputs x (n, 1, 8, 8), labels y (n,)."""
    was_training = model.training
    model.eval()
    correct = torch.zeros((), dtype=torch.int64, device=x.device)
    with torch.no_grad():  # fp32 always, so a checkpoint evaluated later gives the same number
        for xb, yb in zip(x.split(batch), y.split(batch), strict=True):
            correct += (model(xb).argmax(1) == yb).sum()
    model.train(was_training)
    return correct, int(y.shape[0])


def _sharded_test_accuracy(ctx: WorkerContext, model: torch.nn.Module,
                           data: dict[str, torch.Tensor]) -> tuple[float, int]:
    """Each rank scores its shard of the test set; the correct counts and sample counts are summed.

    DistributedSampler(shuffle=False) gives rank r the positions r, r+N, r+2N, ... of the index list padded
    (by repeating its head) to a multiple of N; a position is a real sample when it is < n. Those come
    first in the rank's list, so the rank keeps the first len(range(r, n, N)) indices and drops the padding
    (357 test images on 2 ranks: rank 0 scores 179, rank 1 178, not 179 + 179 with one image twice)."""
    n = int(data["y_test"].shape[0])
    sampler = DistributedSampler(range(n), num_replicas=ctx.world_size, rank=ctx.rank, shuffle=False)
    real = len(range(ctx.rank, n, ctx.world_size))
    idx = torch.as_tensor(list(sampler)[:real], device=ctx.device)
    correct, count = _eval_counts(model, data["x_test"][idx], data["y_test"][idx])
    total_correct, total = _all_reduce(ctx, [correct, count])
    if int(total) != n:
        raise RuntimeError(f"sharded evaluation counted {int(total)} test samples, expected {n}")
    return total_correct / total, int(total)


def evaluate(model: torch.nn.Module, device: str = "cpu") -> float:
    """Test-set accuracy (fraction) of a digits model in one process, fp32, on ``device``."""
    data = _digits_tensors(device)
    model = model.to(device)
    correct, count = _eval_counts(model, data["x_test"], data["y_test"])
    return int(correct) / count


def load_checkpoint(path: str | os.PathLike[str], device: str = "cpu") -> DigitsCNN:
    """Rebuild the digits CNN from a checkpoint written by ``train_digits`` and load its weights (eval mode)."""
    ckpt = torch.load(os.fspath(path), map_location=device, weights_only=True)
    model = make_digits_cnn(int(ckpt["model_config"]["width"]))
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval()


def _save_checkpoint(path: str | os.PathLike[str], model: torch.nn.Module, opt: torch.optim.Optimizer, epoch: int,
                     width: int, accuracy: float) -> None:
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    state = {"model": {k: v.detach().cpu() for k, v in model.state_dict().items()},  # model.module's: no "module." keys
             "optimizer": opt.state_dict(), "epoch": epoch, "model_config": {"width": width}, "accuracy": accuracy}
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: a reader never sees half a file


# --- Digits training worker -----------------------------------------------------------------------


def train_digits(ctx: WorkerContext, epochs: int = DIGITS_DEFAULTS["epochs"], batch_size: int = 64,
                 lr: float = DIGITS_DEFAULTS["lr"], seed: int = 0, amp: str | None = None, accumulate: int = 1,
                 checkpoint_path: str | None = None, set_epoch: bool = True,
                 momentum: float = DIGITS_DEFAULTS["momentum"],
                 width: int = DIGITS_DEFAULTS["width"], cpu_threads: int | None = 1) -> dict[str, Any]:
    """Worker: train the digits CNN under DDP; every rank returns the same all-reduced metrics.

    ``batch_size`` is the micro-batch per rank: a step sees batch_size × world_size × accumulate images (keep that
    ``global_batch`` and the lr constant to compare world sizes: ``run_digits``). ``amp``: None (fp32), 'bf16' or 'fp16'
    (+ GradScaler). All but the last of ``accumulate`` micro-steps run under ``no_sync()``. ``set_epoch=False``: every
    epoch repeats one order (the bug, on purpose). Rank 0 writes ``checkpoint_path``; the others wait at a barrier.
    ``cpu_threads``: torch threads per CPU rank (1: the CNN's ops are too small to split; None shares the cores).

    Returns accuracy (test, fraction), final_loss, samples_per_s (training images per wall second, all ranks), train_s,
    history (per epoch: train_loss, train_accuracy, test_accuracy, epoch_s, first_indices: this rank's first 8) and
    the configuration."""
    where = "train_digits"
    epochs = check_int(epochs, "epochs", where)
    batch_size = check_int(batch_size, "batch_size", where)
    accumulate = check_int(accumulate, "accumulate", where)
    amp = _check_amp(amp, where)
    if not lr > 0:
        raise ValueError(f"{where}(lr={lr!r}): the learning rate must be > 0")
    _share_cpu_threads(ctx, cpu_threads)

    ctx.status("loading digits")
    data = _digits_tensors(ctx.device)
    n_train = int(data["y_train"].shape[0])
    torch.manual_seed(seed)  # same initial weights on every rank (DDP also broadcasts rank 0's at construction)
    model = make_digits_cnn(width).to(ctx.device)
    ddp = _ddp(ctx, model)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=momentum)
    scaler = _grad_scaler(ctx, amp)
    # Every rank builds the same permutation from (seed, epoch) and takes positions rank, rank+N, ...
    sampler = DistributedSampler(range(n_train), num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=seed)

    history, train_s = [], 0.0
    for epoch in range(epochs):
        ctx.status(f"epoch {epoch + 1}/{epochs}")
        if set_epoch:
            sampler.set_epoch(epoch)  # a new permutation each epoch; without it, epoch 0's order every epoch
        order = list(sampler)
        idx = torch.as_tensor(order, device=ctx.device)  # (n_train / world_size,)
        batches = idx.split(batch_size)
        loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)  # kept on the device: no sync per step
        correct = torch.zeros((), dtype=torch.int64, device=ctx.device)
        sync(ctx.device)
        t0 = time.perf_counter()
        for i, b in enumerate(batches):
            group_start = i - i % accumulate
            group_len = min(accumulate, len(batches) - group_start)  # the epoch's last group may be shorter
            last = i - group_start == group_len - 1
            x, y = data["x_train"][b], data["y_train"][b]
            # no_sync around forward AND backward: DDP decides in forward whether backward will all-reduce.
            with contextlib.nullcontext() if last else ddp.no_sync():
                with _autocast(ctx, amp):
                    logits = ddp(x)  # (b, 10)
                loss = F.cross_entropy(logits.float(), y)
                scaler.scale(loss / group_len).backward()  # mean over the group's micro-batches
            if last:
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
            loss_sum += loss.detach().double() * y.shape[0]
            correct += (logits.argmax(1) == y).sum()
        sync(ctx.device)
        epoch_s = _all_reduce(ctx, [time.perf_counter() - t0], op="max")[0]  # the slowest rank sets the pace
        train_s += epoch_s
        # Sums of counts, never an average of per-rank averages (shards may differ in size).
        tot_loss, tot_correct, tot_seen = _all_reduce(ctx, [loss_sum, correct, len(order)])
        test_acc, _ = _sharded_test_accuracy(ctx, ddp.module, data)
        history.append({"epoch": epoch + 1, "train_loss": tot_loss / tot_seen, "train_accuracy": tot_correct / tot_seen,
                        "test_accuracy": test_acc, "epoch_s": epoch_s, "first_indices": order[:8]})

    if checkpoint_path is not None:
        ctx.status("writing the checkpoint")
        if ctx.rank == 0:
            _save_checkpoint(checkpoint_path, ddp.module, opt, epochs, width, history[-1]["test_accuracy"])
        ctx.barrier()  # no rank returns (and no reader looks) before rank 0 has written the file

    global_batch = batch_size * ctx.world_size * accumulate
    return {"accuracy": history[-1]["test_accuracy"], "final_loss": history[-1]["train_loss"], "epochs": epochs,
            "samples_per_s": n_train * epochs / train_s if train_s > 0 else float("nan"), "train_s": train_s,
            "world_size": ctx.world_size, "rank": ctx.rank, "backend": ctx.backend, "device": str(ctx.device),
            "batch_size": batch_size, "accumulate": accumulate, "global_batch": global_batch,
            "steps_per_epoch": math.ceil(math.ceil(n_train / ctx.world_size / batch_size) / accumulate), "lr": lr,
            "momentum": momentum, "amp": amp, "fp16_scale": float(scaler.get_scale()) if amp == "fp16" else None,
            "seed": seed, "set_epoch": set_epoch,
            "checkpoint_path": None if checkpoint_path is None else os.fspath(checkpoint_path), "history": history}


def run_digits(nprocs: int = 1, *, global_batch: int = DIGITS_DEFAULTS["global_batch"], accumulate: int = 1,
               backend: str = "auto", timeout_s: float = 300.0, **kwargs: Any) -> dict[str, Any]:
    """Launch ``train_digits`` on ``nprocs`` ranks with a constant global batch; returns rank 0's result."""
    batch = per_rank_batch(global_batch, nprocs, accumulate)
    kw = {"batch_size": batch, "accumulate": accumulate, **kwargs}
    return launch(train_digits, nprocs, backend=backend, kwargs=kw, timeout_s=timeout_s)[0]


def each_world_size(ctx: WorkerContext, fn: Callable[..., dict[str, Any]],
                    runs: Sequence[tuple[int, dict[str, Any]]]) -> list[dict[str, Any] | None]:
    """Worker: ``fn(sub, **kw)`` for each ``(n, kw)`` in turn, on the first n ranks only (``ctx.subgroup``).

    One launch then measures several world sizes: while the first n ranks run as a job of n, the others wait at
    a barrier (an idle CPU process, or an idle GPU). Returns this rank's result of each run (None where it sat
    out); rank 0 takes part in every run."""
    out = []
    for n, kw in runs:
        sub = ctx.subgroup(n)
        ctx.status(f"world size {n} of {ctx.world_size}" if sub is not None else f"waiting while {n} rank(s) run")
        out.append(fn(sub, **kw) if sub is not None else None)
        ctx.barrier()
    return out


class _StatusTicks:
    """Rank 0's status events, passed on, and one item on ``ticks`` per status that starts with ``prefix``."""

    def __init__(self, events: Any, ticks: Any, prefix: str):
        self.events, self.ticks, self.prefix = events, ticks, prefix

    def put(self, item: tuple[str, int, Any]) -> None:
        if self.events is not None:
            self.events.put(item)
        if item[0] == "status" and str(item[2]).startswith(self.prefix):
            self.ticks.put(1)


def _ticking(ctx: WorkerContext, tick_queue: Any, tick_prefix: str, tick_work: Callable[..., Any], **kw: Any) -> Any:
    """Worker: ``tick_work(ctx, **kw)``, with rank 0's statuses that start with ``tick_prefix`` reported on
    ``tick_queue``: ``epoch k/n`` (train_digits), ``world size n of N`` (each_world_size), ``repeat r/R`` (overlap)."""
    if ctx.rank == 0:
        ctx = dataclasses.replace(ctx, _events=_StatusTicks(ctx._events, tick_queue, tick_prefix))
    return tick_work(ctx, **kw)


@contextlib.contextmanager
def _rank0_ticks(progress: Callable[..., Any], total: int | None, desc: str) -> Iterator[Any]:
    """A queue for the ranks (rank 0 puts one item on it per step) and a thread here that turns its items into
    the steps of ``progress(iterable, total=, desc=)``; the display ends when the block does."""
    ticks = mp_context().Queue()

    def show() -> None:
        for _ in progress(iter(ticks.get, None), total=total, desc=desc):
            pass

    shown = threading.Thread(target=show, name="nvlab-ddp-progress", daemon=True)
    shown.start()
    try:
        yield ticks
    finally:
        ticks.put(None)
        shown.join(timeout=10)


def _launch_ticking(worker: Callable[..., Any], nprocs: int, kw: dict[str, Any], *, backend: str, timeout_s: float,
                    progress: Callable[..., Any] | None, total: int | None, desc: str, prefix: str) -> Any:
    """Rank 0's result of ``worker`` on ``nprocs`` ranks; ``progress`` (``lab_utils.widgets.progress``, None: no
    display) steps once per status of rank 0 that starts with ``prefix``."""
    if progress is None:
        return launch(worker, nprocs, backend=backend, timeout_s=timeout_s, kwargs=kw)[0]
    with _rank0_ticks(progress, total, desc) as ticks:
        return launch(_ticking, nprocs, backend=backend, timeout_s=timeout_s,
                      kwargs={"tick_queue": ticks, "tick_prefix": prefix, "tick_work": worker, **kw})[0]


def digits_comparison(nprocs_list: Sequence[int] = (1, 2), *, global_batch: int = DIGITS_DEFAULTS["global_batch"],
                      accumulate: int | Sequence[int] = 1, backend: str = "auto", timeout_s: float = 300.0,
                      progress: Callable[..., Any] | None = None, **kwargs: Any) -> pd.DataFrame:
    """``train_digits`` at each world size (same seed, same global batch): one row each, accuracy side by side.

    ``accumulate``: micro-steps per optimizer step, one value for all or one per world size. All world sizes run
    in one launch (``each_world_size``). ``progress`` steps per epoch that rank 0 starts (``_launch_ticking``)."""
    sizes = [check_int(n, "nprocs_list", "digits_comparison") for n in nprocs_list]
    accs = [accumulate] * len(sizes) if isinstance(accumulate, int) else list(accumulate)
    if len(accs) != len(sizes):
        raise ValueError(f"digits_comparison(accumulate={accumulate!r}): one value, or one per world size")
    runs = [(n, {"batch_size": per_rank_batch(global_batch, n, a), "accumulate": a, **kwargs})
            for n, a in zip(sizes, accs, strict=True)]
    epochs = kwargs.get("epochs", DIGITS_DEFAULTS["epochs"])
    results = _launch_ticking(each_world_size, max(sizes), {"fn": train_digits, "runs": runs}, backend=backend,
                              timeout_s=timeout_s, progress=progress, prefix="epoch ", desc="digits training: epochs",
                              total=epochs * len(runs) if isinstance(epochs, int) else None)
    rows = [{k: r[k] for k in ("world_size", "backend", "global_batch", "batch_size", "accumulate", "lr", "amp",
                               "epochs", "accuracy", "final_loss", "samples_per_s")} for r in results]
    df = pd.DataFrame(rows)
    df["accuracy_vs_first"] = df["accuracy"] - df["accuracy"].iloc[0]
    return df


def accumulation_check(ctx: WorkerContext, micro_batch: int = 16, accumulate: int = 2, seed: int = 0) -> dict[str, Any]:
    """Worker: DDP gradients after ``accumulate`` micro-steps (all but the last under no_sync) vs one big batch.

    Every rank also computes, without DDP, the gradient of the whole global batch
    (micro_batch × accumulate × world_size images) on a plain copy of the model; returns the largest
    absolute difference (max over ranks) and the gradient's largest magnitude, for scale."""
    micro_batch = check_int(micro_batch, "micro_batch", "accumulation_check")
    accumulate = check_int(accumulate, "accumulate", "accumulation_check")
    _share_cpu_threads(ctx)
    data = _digits_tensors(ctx.device)
    torch.manual_seed(seed)
    ref = make_digits_cnn(16).to(ctx.device)
    model = make_digits_cnn(16).to(ctx.device)
    model.load_state_dict(ref.state_dict())
    ddp = _ddp(ctx, model)
    per_rank = micro_batch * accumulate
    x = data["x_train"][: per_rank * ctx.world_size]  # (global, 1, 8, 8); rank r owns rows [r*per_rank, ...)
    y = data["y_train"][: per_rank * ctx.world_size]
    mine = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
    for k, (xb, yb) in enumerate(zip(x[mine].split(micro_batch), y[mine].split(micro_batch), strict=True)):
        with contextlib.nullcontext() if k == accumulate - 1 else ddp.no_sync():
            (F.cross_entropy(ddp(xb), yb) / accumulate).backward()
    F.cross_entropy(ref(x), y).backward()  # the big batch, in one process
    diff = max(float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    scale = max(float(q.grad.abs().max()) for q in ref.parameters())
    diff = _all_reduce(ctx, [diff], op="max")[0]
    return {"max_abs_diff": diff, "max_abs_grad": scale, "world_size": ctx.world_size, "accumulate": accumulate,
            "global_batch": per_rank * ctx.world_size}


# --- Throughput -----------------------------------------------------------------------------------


def _throughput_config(ctx: WorkerContext, **kw: Any) -> dict[str, Any]:
    gpu = _is_cuda(ctx)
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
    _check_amp(cfg["amp"], where)
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
    if _is_cuda(ctx):
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
        net = _ddp(ctx, model, bucket_cap_mb=cfg["bucket_cap_mb"],
                   gradient_as_bucket_view=cfg["gradient_as_bucket_view"])
    else:  # the baseline without DDP: one all-reduce of all gradients after the whole backward pass
        net = model
        for p in params:
            dist.broadcast(p.data, 0, group=ctx.group)  # rank 0 of the group is global rank 0
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)

    k = cfg["accumulate"]

    def step() -> None:
        for _ in range(k - 1):  # micro-batches whose gradients only accumulate: no all-reduce under no_sync
            with net.no_sync(), _autocast(ctx, cfg["amp"]):
                F.cross_entropy(net(x), y).backward()
        with _autocast(ctx, cfg["amp"]):
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
    mean_ms, median_ms = _all_reduce(ctx, [timing.mean_ms, timing.median_ms], op="max")
    mean_ms, median_ms = mean_ms / k, median_ms / k  # per micro-batch: variants compare at the same work
    buckets = None
    if cfg["ddp"]:
        with contextlib.suppress(Exception):  # private logging API: its keys vary between torch versions
            log = net._get_ddp_logging_data()  # the layout after the first step's rebuild, where there was one
            sizes = str(log.get("rebuilt_bucket_sizes") or log.get("bucket_sizes", "")).strip()  # "bytes, ..."
            buckets = len(sizes.split(",")) if sizes else None
    global_batch = b * ctx.world_size
    out = {"world_size": ctx.world_size, "backend": ctx.backend,
           "device": torch.cuda.get_device_name(ctx.device) if _is_cuda(ctx) else f"cpu ({cpu_model()})",
           **{k: cfg[k] for k in ("batch_size", "image_size", "width", "amp", "channels_last", "bucket_cap_mb",
                                  "gradient_as_bucket_view", "ddp", "accumulate", "steps",
                                  "warmup_steps")},
           "depth": cfg["depth"] if isinstance(cfg["depth"], int) else tuple(cfg["depth"]),
           "global_batch": global_batch, "step_ms": mean_ms, "step_ms_median": median_ms,
           "images_per_s": global_batch / (mean_ms * 1e-3), "images_per_s_per_worker": b / (mean_ms * 1e-3),
           "n_params": sum(p.numel() for p in params), "params_mib": param_mib(model),
           "grads_mib": sum(p.numel() * 4 for p in params) / MIB,  # DDP reduces fp32 gradients, even under autocast
           "buckets": buckets}
    return out  # the model, optimizer and batch go with this frame: the next variant starts with free memory


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
    _share_cpu_threads(ctx, cpu_threads)
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
    run in one launch (``each_world_size``); ``progress`` steps per world size (``_launch_ticking``)."""
    nprocs_list = list(nprocs_list) if nprocs_list is not None else [1, _default_nprocs()]
    for n in nprocs_list:
        check_int(n, "nprocs_list", "scaling")
    if choose_backend(max(nprocs_list), backend) == "gloo" and kwargs.get("cpu_threads") is None:
        kwargs["cpu_threads"] = max(1, cpu_cores() // max(nprocs_list))
    work = {"fn": throughput, "runs": [(n, kwargs) for n in nprocs_list]}
    rows = _launch_ticking(each_world_size, max(nprocs_list), work, backend=backend, timeout_s=timeout_s,
                           progress=progress, total=len(nprocs_list), desc="DDP scaling: world sizes",
                           prefix="world size ")
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
    _share_cpu_threads(ctx, cpu_threads)
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
    ``progress`` steps per variant timed (``_launch_ticking``)."""
    nprocs = _default_nprocs() if nprocs is None else check_int(nprocs, "nprocs", "overlap_experiment")
    check_int(repeats, "repeats", "overlap_experiment")
    if variants is None:
        variants = [{"bucket_cap_mb": 1}, {"bucket_cap_mb": 25}, {"gradient_as_bucket_view": True}]
    full = [_normalise_variant(v) for v in variants]
    if DEFAULT_BUCKETS not in full:
        full.insert(0, dict(DEFAULT_BUCKETS))
    kw = {"variants": full, "repeats": repeats, **kwargs}
    rows = _launch_ticking(overlap_worker, nprocs, kw, backend=backend, timeout_s=timeout_s, progress=progress,
                           total=repeats * len(full), desc="DDP bucket variants: runs", prefix="repeat ")
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
