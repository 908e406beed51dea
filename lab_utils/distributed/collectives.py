"""Lab 02 experiments: collective bandwidth (algbw, busbw) with NCCL on GPUs or gloo on CPU processes.

Every measurement first runs the collective once and checks the result against the values each rank put in, then times
it with ``lab_utils.timing.benchmark``. A collective takes as long as its slowest rank, so the time reported is the
largest of the ranks' medians; ``bandwidth`` turns it into algbw and busbw (nccl-tests definitions) and finds the link's
peak. Workers are top-level functions started by ``lab_utils.distributed.spawn.launch``; ``capture_nccl_debug`` records
NCCL's own log, which ``nccl_log.parse_nccl_log`` reads. Units are in the names: ``_ms`` milliseconds, ``_gbps`` GB/s
(1e9 B/s), ``_bytes`` bytes."""

from __future__ import annotations

import glob
import math
import os
import re
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
import torch.distributed as dist

from lab_utils.args import check_int, check_ints
from lab_utils.distributed.bandwidth import (
    COLLECTIVES,
    CPU_SIZES,
    GPU_SIZES,
    KIB,
    MIB,
    algbw_gbps,
    busbw_gbps,
    check_collective,
    link_peak_gbps,
)
from lab_utils.distributed.ddp_base import all_reduce_values
from lab_utils.distributed.spawn import WorkerContext, choose_backend, launch, torch_gpu_count
from lab_utils.plotting import format_bytes
from lab_utils.procs import temporary_folder
from lab_utils.timing import benchmark, sync

if TYPE_CHECKING:
    from lab_utils.course.probe import EnvReport

SWEEP_COLUMNS = ["collective", "size_bytes", "size_label", "n_ranks", "backend", "dtype", "status", "reason", "time_ms",
                 "algbw_gbps", "busbw_gbps", "peak_gbps", "pct_of_peak", "correct", "reps"]

# Exception texts that mean "this backend cannot do this op or dtype", as opposed to a failure.
_UNSUPPORTED = re.compile(
    r"not supported|unsupported|not implemented|does not support|invalid scalar type|not curren(t|tl)ly supported",
    re.I)


class CollectiveCheckError(RuntimeError):
    """A collective returned values other than the ones its inputs imply; the message names what and where."""


# --- Buffers, inputs, expected results ------------------------------------------------------------


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A floating-point torch dtype from its name ("float32", "bfloat16", "float8_e4m3fn"...) or itself."""
    dt = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(f"dtype={dtype!r}: use the name of a floating-point torch dtype, e.g. 'float32', 'bfloat16', "
                         "'float16' or 'float8_e4m3fn' (gloo refuses float8: a row marked unsupported)")
    return dt


def buffer_numels(collective: str, size_bytes: int, n: int, itemsize: int) -> tuple[int, int, int]:
    """(input elements, output elements, S in bytes actually used) for one rank.

    S is rounded down to a whole number of elements per rank, so every chunk has the same length.
    all_reduce and broadcast work in place (input = output)."""
    check_collective(collective, "buffer_numels")
    if (per_rank := size_bytes // itemsize // n) < 1:
        raise ValueError(f"size_bytes={size_bytes}: too small for {n} ranks of {itemsize}-byte elements; "
                         f"use at least {n * itemsize} bytes")
    total = per_rank * n
    ins = {"all_gather": per_rank}.get(collective, total)
    outs = {"reduce_scatter": per_rank}.get(collective, total)
    return ins, outs, total * itemsize


def input_chunks(collective: str, rank: int, n: int) -> list[float]:
    """The value of each chunk of ``rank``'s input (one value: the whole buffer holds it).

    Chosen so every rank and every chunk differ, and small integers keep sums exact in bf16."""
    if collective == "reduce_scatter":
        return [float((rank + 1) * (j + 1)) for j in range(n)]  # rank r's piece for rank j
    if collective == "all_to_all":
        return [float(rank * n + j + 1) for j in range(n)]  # chunk j goes to rank j
    return [float(rank + 1)]


def expected_chunks(collective: str, rank: int, n: int) -> list[float]:
    """The value each chunk of ``rank``'s output must hold after the collective (one value: all of it)."""
    if collective == "all_reduce":
        return [n * (n + 1) / 2]  # sum of rank + 1 over the ranks
    if collective == "broadcast":
        return [1.0]  # rank 0's value
    if collective == "all_gather":
        return [float(j + 1) for j in range(n)]  # chunk j is rank j's input
    if collective == "reduce_scatter":
        return [(rank + 1) * n * (n + 1) / 2]  # sum over ranks k of (k + 1)(rank + 1)
    return [float(j * n + rank + 1) for j in range(n)]  # all_to_all: chunk j came from rank j


def make_input(collective: str, rank: int, n: int, numel: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """``rank``'s input tensor filled as ``input_chunks`` says."""
    values = input_chunks(collective, rank, n)
    x = torch.empty(numel, dtype=dtype, device=device)
    for value, chunk in zip(values, x.chunk(len(values)), strict=True):
        chunk.fill_(value)
    return x


def check_result(collective: str, out: torch.Tensor, rank: int, n: int) -> str | None:
    """``None`` when ``out`` holds what ``collective`` must give on ``rank`` of ``n``; else what is wrong.

    Data-moving collectives must match exactly (in the tensor's dtype); reductions within a few rounding
    steps of the dtype (the order of a sum is the backend's choice)."""
    expected = expected_chunks(collective, rank, n)
    if out.numel() % len(expected):
        return f"rank {rank}: output has {out.numel()} elements, not a multiple of {len(expected)} chunks"
    reduces = collective in ("all_reduce", "reduce_scatter")
    eps = torch.finfo(out.dtype).eps
    size = out.numel() // len(expected)
    for j, (value, chunk) in enumerate(zip(expected, out.chunk(len(expected)), strict=True)):
        want = torch.tensor(value, dtype=torch.float64).to(out.dtype).double().item()  # value as the dtype holds it
        tol = 4 * n * eps * abs(want) if reduces else 0.0
        got = chunk.float() if chunk.element_size() == 1 else chunk  # fp8 has no min/max kernels
        lo, hi = (v.item() for v in torch.aminmax(got))
        if abs(lo - want) > tol or abs(hi - want) > tol or math.isnan(lo) or math.isnan(hi):
            bad = ((got.double() - want).abs() > tol) | got.isnan()
            first = int(bad.nonzero()[0, 0]) + j * size
            where = f" chunk {j}" if len(expected) > 1 else ""
            return (f"rank {rank}{where}: values in [{lo:g}, {hi:g}], expected {want:g}; "
                    f"first wrong element {first} = {out.reshape(-1)[first].item():g}")
    return None


def collective_call(collective: str, inp: torch.Tensor, out: torch.Tensor) -> Callable[[], object]:
    """A no-argument function that runs ``collective`` once, blocking (``async_op=False``).

    torch >= 2.13 names the tensor forms ``all_gather_single`` / ``reduce_scatter_single`` and warns on
    the older ``all_gather_into_tensor`` / ``reduce_scatter_tensor``; older torch has only the latter."""
    if collective == "all_reduce":
        return lambda: dist.all_reduce(inp)
    if collective == "broadcast":
        return lambda: dist.broadcast(inp, src=0)
    if collective == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, inp)
    if collective == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, inp)
    if collective == "all_to_all":
        return lambda: dist.all_to_all_single(out, inp)
    raise ValueError(f"collective_call(collective={collective!r}): valid names are {list(COLLECTIVES)}")


# --- Workers (run in each rank's process by spawn.launch) -----------------------------------------


def bench_worker(ctx: WorkerContext, collectives: Sequence[str], sizes_bytes: Sequence[int], reps: int, warmup: int,
                 dtype: str | Sequence[str] = "float32", corrupt_rank: int | None = None) -> list[dict[str, Any]]:
    """Check, then time, each collective at each size (and dtype) on this rank; one row per case.

    Inputs are allocated and filled outside the timed region. The first call is checked; a wrong result
    on any rank raises ``CollectiveCheckError`` on every rank, naming collective, size and ranks. An op or
    dtype the backend refuses gives a row with ``status='unsupported'`` and the backend's words. ``time_ms``
    is the largest median over the ranks; ``rank_time_ms`` this rank's. ``corrupt_rank`` overwrites one
    element of that rank's result before the check, to see the check fire."""
    return [_bench_one(ctx, collective, int(size), name, reps, warmup, corrupt_rank)
            for name in ([dtype] if isinstance(dtype, str) else dtype) for collective in collectives
            for size in sizes_bytes]


def _bench_one(ctx: WorkerContext, collective: str, size: int, dtype: str, reps: int, warmup: int,
               corrupt_rank: int | None) -> dict[str, Any]:
    dt = torch_dtype(dtype)
    n, rank, dev = ctx.world_size, ctx.rank, ctx.device
    n_in, n_out, s_bytes = buffer_numels(collective, size, n, torch.empty((), dtype=dt).element_size())
    label = f"{collective} {format_bytes(s_bytes)} {dtype}"
    row: dict[str, Any] = {"collective": collective, "size_bytes": s_bytes, "n_ranks": n, "backend": ctx.backend,
                           "dtype": dtype, "rank": rank, "status": "ok", "reason": "", "correct": None,
                           "rank_time_ms": math.nan, "time_ms": math.nan, "reps": reps}
    ctx.status(f"{label}: allocating and checking")
    inp = make_input(collective, rank, n, n_in, dt, dev)
    out = inp if collective in ("all_reduce", "broadcast") else torch.empty(n_out, dtype=dt, device=dev)
    # all_reduce and broadcast run in place, so the timed repetitions see other values than the checked call
    # (all_reduce's grow n-fold on each call, to inf in fp16 within a few dozen): the time does not depend on them.
    fn = collective_call(collective, inp, out)
    # 0 ok, 1 unsupported, 2 wrong: agreed over the ranks so that every rank takes the same branch.
    code, problem = 0, ""
    try:
        fn()
        sync(dev)
        if corrupt_rank == rank:
            out.view(-1)[-1] = -7.0
        problem = check_result(collective, out, rank, n) or ""
        code = 2 if problem else 0
    except Exception as exc:
        if not (isinstance(exc, NotImplementedError) or _UNSUPPORTED.search(str(exc))):  # else: the backend refused
            raise
        code, problem = 1, f"{ctx.backend} refused it: {str(exc).strip().splitlines()[0]}"
    if (agreed := int(all_reduce_values(ctx, [code], op="max")[0])) == 2:
        reports: list[str | None] = [None] * n
        dist.all_gather_object(reports, problem if code == 2 else "")
        wrong = "; ".join(r for r in reports if r)
        raise CollectiveCheckError(f"{label} on {n} ranks ({ctx.backend}) gave a wrong result: {wrong}")
    if agreed == 1:
        row.update(status="unsupported", reason=problem or f"{ctx.backend} refused it on another rank")
        return row
    row["correct"] = True
    ctx.status(f"{label}: timing {reps} reps")
    ctx.barrier()  # start the warm-up together, so no rank's first call waits for a slow allocator
    t = benchmark(fn, reps=reps, warmup=warmup, device=dev, name=label)
    row["rank_time_ms"] = t.median_ms
    row["time_ms"] = all_reduce_values(ctx, [t.median_ms], op="max")[0]  # as slow as the slowest rank
    return row


def bare_allreduce_worker(ctx: WorkerContext, size_bytes: int, iters: int, warmup: int) -> dict[str, float]:
    """The simplest all_reduce loop on fp32, for comparison with ``bench_worker``: ms per iteration.

    CUDA: one event before ``iters`` all_reduces, one after, one synchronize. CPU: a barrier, then the host
    clock around the loop. ``time_ms`` is the largest over the ranks."""
    numel = max(size_bytes // 4, 1)
    ctx.status(f"bare all_reduce {format_bytes(numel * 4)}")
    x = torch.full((numel,), float(ctx.rank + 1), dtype=torch.float32, device=ctx.device)
    for _ in range(warmup):
        dist.all_reduce(x)
    ctx.barrier()
    if ctx.device.startswith("cuda"):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dist.all_reduce(x)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / iters
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        ms = (time.perf_counter() - t0) * 1e3 / iters
    return {"rank_time_ms": ms, "time_ms": all_reduce_values(ctx, [ms], op="max")[0], "size_bytes": numel * 4}


def nccl_debug_worker(ctx: WorkerContext, size_bytes: int) -> dict[str, Any]:
    """A few all_reduces (a small one and one of ``size_bytes``), so NCCL logs its set-up and choices."""
    for nbytes in (4 * KIB, size_bytes):
        ctx.status(f"all_reduce {format_bytes(nbytes)} with NCCL_DEBUG=INFO")
        x = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=ctx.device)
        for _ in range(2):
            dist.all_reduce(x)
        sync(ctx.device)
    return {"rank": ctx.rank, "pid": os.getpid(), "host": socket.gethostname()}


# --- Parent side: what the notebook calls ---------------------------------------------------------


def collective_sweep(nprocs: int, sizes_bytes: Sequence[int] | None = None, collectives: Sequence[str] = COLLECTIVES,
                     backend: str = "auto", reps: int | None = None, warmup: int | None = None,
                     timeout_s: float = 900.0, dtype: str | Sequence[str] = "float32", report: EnvReport | None = None,
                     corrupt_rank: int | None = None) -> pd.DataFrame:
    """algbw and busbw of each collective at each size on ``nprocs`` ranks (NCCL on GPUs, else gloo).

    Defaults: NCCL 1 MiB..2 GiB (``GPU_SIZES``), 20 reps after 5 warm-ups; gloo 4 KiB..16 MiB (``CPU_SIZES``), 10 reps
    after 2. ``dtype``: a torch dtype name, or several (one set of rows each). ``peak_gbps`` is the GPU link per
    direction (``bandwidth.link_peak_gbps``; ``report`` from ``course.probe.probe()``, probed when None), NaN on gloo. A
    wrong result raises (through ``spawn.WorkerError``); an op or dtype the backend refuses gives
    ``status='unsupported'`` and a reason. Columns: see ``SWEEP_COLUMNS``; ``.attrs['peak_description']`` says which
    link the peak is."""
    where = "collective_sweep"
    chosen = choose_backend(nprocs, backend)
    gpu = chosen == "nccl"
    collectives = [collectives] if isinstance(collectives, str) else list(collectives)
    if (bad := [c for c in collectives if c not in COLLECTIVES]) or not collectives:
        raise ValueError(f"{where}(collectives={collectives!r}): unknown {bad}; valid names are {list(COLLECTIVES)}")
    sizes = check_ints(sizes_bytes if sizes_bytes is not None else (GPU_SIZES if gpu else CPU_SIZES), "sizes_bytes",
                       where)
    reps = check_int(reps if reps is not None else (20 if gpu else 10), "reps", where)
    warmup = check_int(warmup if warmup is not None else (5 if gpu else 2), "warmup", where, minimum=0)
    dtypes = [str(torch_dtype(d)).removeprefix("torch.") for d in ([dtype] if isinstance(dtype, str) else dtype)]
    if not dtypes:
        raise ValueError(f"{where}(dtype=[]): give a dtype name, e.g. 'float32'")
    for name in dtypes:
        itemsize = torch.empty((), dtype=torch_dtype(name)).element_size()
        for s in sizes:
            if s < nprocs * itemsize:
                raise ValueError(f"{where}(sizes_bytes): {s} bytes is less than one {name} element per rank "
                                 f"({nprocs} × {itemsize} bytes)")
    if gpu:
        peak, peak_desc = link_peak_gbps(report, n_gpus=max(nprocs, 2))
    else:
        peak, peak_desc = None, "no GPU link (gloo over loopback/shared memory)"
    per_rank = launch(bench_worker, nprocs, backend=chosen, timeout_s=timeout_s,
                      kwargs={"collectives": collectives, "sizes_bytes": sizes, "reps": reps, "warmup": warmup,
                              "dtype": dtypes, "corrupt_rank": corrupt_rank})
    df = _merge_rows(per_rank, peak)
    df.attrs["peak_description"] = peak_desc
    return df


def _merge_rows(per_rank: list[list[dict[str, Any]]], peak: float | None) -> pd.DataFrame:
    rows = []
    for same in zip(*per_rank, strict=True):  # the same (collective, size) on every rank
        first = same[0]
        n = first["n_ranks"]
        unsupported = [r for r in same if r["status"] != "ok"]
        time_ms = max(r["rank_time_ms"] for r in same) if not unsupported else math.nan
        row = {k: first[k] for k in ("collective", "size_bytes", "n_ranks", "backend", "dtype", "reps")}
        row.update(size_label=format_bytes(first["size_bytes"]), status="unsupported" if unsupported else "ok",
                   reason=next((r["reason"] for r in unsupported if r["reason"]), ""), time_ms=time_ms,
                   correct=None if unsupported else all(bool(r["correct"]) for r in same),
                   peak_gbps=math.nan if peak is None else float(peak))
        if time_ms > 0:
            row["algbw_gbps"] = algbw_gbps(row["size_bytes"], time_ms)
            row["busbw_gbps"] = busbw_gbps(row["collective"], row["size_bytes"], time_ms, n)
        else:
            row["algbw_gbps"] = row["busbw_gbps"] = math.nan
        row["pct_of_peak"] = 100.0 * row["busbw_gbps"] / peak if peak else math.nan
        rows.append(row)
    df = pd.DataFrame(rows, columns=SWEEP_COLUMNS)
    df["correct"] = df["correct"].astype("boolean")  # <NA> where nothing could be checked
    return df


# --- NCCL's own account: NCCL_DEBUG=INFO ----------------------------------------------------------


NCCL_DEBUG_SUBSYS = "INIT,GRAPH,ENV,TUNING"


def capture_nccl_debug(nprocs: int = 2, size_bytes: int = 256 * MIB, extra_env: dict[str, str] | None = None,
                       backend: str = "auto", subsys: str = NCCL_DEBUG_SUBSYS, timeout_s: float = 300.0) -> str:
    """NCCL's INFO log of a few all_reduces on ``nprocs`` GPUs: every rank's file, concatenated by rank.

    Runs ``nccl_debug_worker`` with NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=``subsys`` and NCCL_DEBUG_FILE set to
    one file per process (``%h`` host, ``%p`` pid) in a temporary folder. ``extra_env`` adds variables
    (e.g. ``{"NCCL_P2P_DISABLE": "1"}`` to see the fall-back transport); NCCL_NVLS_ENABLE is refused:
    it stays as inherited. Read the result with ``nccl_log.parse_nccl_log``."""
    extra = dict(extra_env or {})
    if "NCCL_NVLS_ENABLE" in extra:
        raise ValueError("capture_nccl_debug(extra_env=...): NCCL_NVLS_ENABLE is not changed by the labs; "
                         "it stays as inherited (the launcher defaults it to 0)")
    no_nccl = ("NCCL debug output needs the NCCL backend (one GPU per rank, a CUDA build of torch)")
    try:
        chosen = choose_backend(nprocs, backend)
    except ValueError as exc:
        raise ValueError(f"{no_nccl}: {exc}") from None
    if chosen != "nccl":
        raise ValueError(f"{no_nccl}: here {nprocs} ranks run on gloo ({torch_gpu_count()} GPU(s)). "
                         "gloo writes no such log; nccl_log.parse_nccl_log works on a saved NCCL log instead")
    size_bytes = check_int(size_bytes, "size_bytes", "capture_nccl_debug")
    with temporary_folder("nccl-debug") as tmp:
        env = {**extra, "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": subsys,
               "NCCL_DEBUG_FILE": os.path.join(tmp, "nccl.%h.%p.log")}
        ranks = launch(nccl_debug_worker, nprocs, backend="nccl", timeout_s=timeout_s, env=env,
                       kwargs={"size_bytes": size_bytes})
        parts, seen = [], set()
        for r in ranks:
            files = sorted(glob.glob(os.path.join(tmp, f"nccl.*.{r['pid']}.log")))
            seen.update(files)
            text = "".join(Path(f).read_text(errors="replace") for f in files)
            parts.append(f"# ---- rank {r['rank']} (pid {r['pid']}) ----\n" + (text or "# (no log written)\n"))
        for f in sorted(set(glob.glob(os.path.join(tmp, "*"))) - seen):
            parts.append(f"# ---- {os.path.basename(f)} ----\n" + Path(f).read_text(errors="replace"))
    return "".join(p if p.endswith("\n") else p + "\n" for p in parts)
