"""What lab 02's DDP workers share: amp modes, DDP around a model, numbers all-reduced across ranks, CPU threads
per rank, and one launch over several world sizes with rank 0's progress shown (``each_world_size``,
``launch_ticking``). Worker functions for ``lab_utils.distributed.spawn.launch``.

Design notes: docs/internals.md#lab_utilsdistributedddppy"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lab_utils.args import check_int
from lab_utils.distributed.spawn import WorkerContext, launch
from lab_utils.procs import env_int
from lab_utils.timing import Ticks, cpu_cores

AMP_MODES = (None, "bf16", "fp16")


def check_amp(amp: Any, where: str) -> str | None:
    if amp not in AMP_MODES:
        raise ValueError(f"{where}(amp={amp!r}): use None (fp32), 'bf16' (autocast) or 'fp16' (autocast + GradScaler)")
    return amp


def is_cuda(ctx: WorkerContext) -> bool:
    return str(ctx.device).startswith("cuda")


def share_cpu_threads(ctx: WorkerContext, threads: int | None = None) -> None:
    """CPU ranks on one machine share its cores: each gets ``threads`` or an equal share of them.

    Without this every rank starts one thread per core and the ranks fight for them (slower than one rank).
    OMP_NUM_THREADS, when set (torchrun sets it to 1 for several ranks per node), is left to rule."""
    if is_cuda(ctx):
        return
    if threads is not None:
        torch.set_num_threads(check_int(threads, "cpu_threads", "throughput"))
    elif "OMP_NUM_THREADS" not in os.environ:
        local = env_int("LOCAL_WORLD_SIZE", ctx.world_size, minimum=1)
        torch.set_num_threads(max(1, cpu_cores() // max(1, local)))


def amp_autocast(ctx: WorkerContext, amp: str | None) -> contextlib.AbstractContextManager[Any]:
    if amp is None:
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device_type="cuda" if is_cuda(ctx) else "cpu", dtype=dtype)


def grad_scaler(ctx: WorkerContext, amp: str | None) -> torch.amp.GradScaler:
    """torch.amp.GradScaler for fp16 (disabled otherwise); a torch without a CPU scaler is reported, not faked."""
    dev = "cuda" if is_cuda(ctx) else "cpu"
    try:
        return torch.amp.GradScaler(dev, enabled=amp == "fp16")
    except (AttributeError, TypeError, RuntimeError) as exc:
        raise RuntimeError(f"amp='fp16' needs torch.amp.GradScaler({dev!r}), which torch {torch.__version__} does not "
                           f"offer ({exc}); use amp='bf16' (no scaler needed) or a GPU") from exc


def wrap_ddp(ctx: WorkerContext, model: torch.nn.Module, **kw: Any) -> DistributedDataParallel:
    kw.setdefault("process_group", ctx.group)  # None: the default group
    if is_cuda(ctx):  # one GPU per process: DDP must be told which one
        index = torch.device(ctx.device).index
        return DistributedDataParallel(model, device_ids=[index], output_device=index, **kw)
    return DistributedDataParallel(model, **kw)


def all_reduce_values(ctx: WorkerContext, values: Sequence[float | torch.Tensor], op: str = "sum") -> list[float]:
    """All-reduce a few numbers (SUM or MAX) in float64 on the rank's device (NCCL needs GPU tensors)."""
    t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=ctx.device) for v in values])
    if dist.is_initialized() and ctx.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=ctx.group)
    return [float(v) for v in t.tolist()]


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


def launch_ticking(worker: Callable[..., Any], nprocs: int, kw: dict[str, Any], *, backend: str, timeout_s: float,
                   progress: Callable[..., Any] | None, total: int | None, desc: str, prefix: str) -> Any:
    """Rank 0's result of ``worker`` on ``nprocs`` ranks; ``progress`` (``lab_utils.widgets.progress``, None: no
    display) steps once per status of rank 0 that starts with ``prefix``: ``epoch k/n`` (train_digits), ``world size
    n of N`` (each_world_size), ``repeat r/R`` (overlap). ``launch`` reports the statuses in this thread."""
    ticks = Ticks(progress, total, desc)

    def tick(rank: int, text: str) -> None:
        if rank == 0 and text.startswith(prefix):
            ticks.step()

    try:
        return launch(worker, nprocs, backend=backend, timeout_s=timeout_s, kwargs=kw, on_status=tick)[0]
    finally:
        ticks.close()
