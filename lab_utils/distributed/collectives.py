"""Lab 02 experiments: collective bandwidth (algbw, busbw) with NCCL on GPUs or gloo on CPU processes.

Definitions follow nccl-tests (``shared/REFERENCE.md`` §2): algbw = S / t, busbw = algbw × factor, with
S the bytes of one rank's buffer (all_reduce, broadcast, reduce) or of the whole gathered buffer
(all_gather, reduce_scatter, all_to_all), t the time of one collective, GB = 1e9 bytes. busbw is what
to hold against the link's speed per direction, whatever the number of ranks.

Every measurement first runs the collective once and checks the result against the values each rank put
in, then times it with ``lab_utils.timing.benchmark``. A collective takes as long as its slowest rank, so
the time reported is the largest of the ranks' medians. Workers are top-level functions started by
``lab_utils.distributed.spawn.launch``. Units are in the names: ``_ms`` milliseconds, ``_gbps`` GB/s (1e9 B/s),
``_bytes`` bytes. torch is imported inside the functions: importing this module does no work.
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
import re
import socket
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from lab_utils.args import check_int, require_torch
from lab_utils.course.specs import PCIE_GEN3_GBPS, PCIE_GEN4_GBPS, PCIE_GEN5_GBPS, peaks_for
from lab_utils.distributed import spawn as distributed
from lab_utils.plots import format_bytes
from lab_utils.timing import benchmark

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
# reduce has a busbw factor too (nccl-tests measures it); the sweep leaves it out.
_FACTOR_NAMES = (*COLLECTIVES, "reduce")

KIB, MIB, GIB = 2**10, 2**20, 2**30

# Defaults: GPU sizes reach the ≥ 1 GiB where NVLink busbw levels off (REFERENCE §1); CPU sizes keep a
# gloo sweep on a 2-core laptop to seconds.
GPU_SIZES = (MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, GIB, 2 * GIB)
CPU_SIZES = (4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB)

# [H200 run] all_reduce busbw in GB/s, 2 GPUs over NV18, fp32, blocking torch.distributed loop
# (REFERENCE §1): shown beside local numbers where there is no GPU.
H200_ALLREDUCE_BUSBW_GBPS = {MIB: 21.6, 16 * MIB: 216.0, 256 * MIB: 298.0, GIB: 327.0, 2 * GIB: 338.0}

# NVLink 2, 3 and 4 each carry 25 GB/s per link per direction (H100/H200: 18 links = 450 GB/s);
# NVLink 5 (Blackwell) doubles it.
NVLINK_GBPS_PER_LINK = 25.0

SWEEP_COLUMNS = [
    "collective", "size_bytes", "size_label", "n_ranks", "backend", "dtype", "status", "reason", "time_ms",
    "algbw_gbps", "busbw_gbps", "peak_gbps", "pct_of_peak", "correct", "reps",
]

# Exception texts that mean "this backend cannot do this op or dtype", as opposed to a failure.
_UNSUPPORTED = re.compile(
    r"not supported|unsupported|not implemented|does not support|invalid scalar type|not curren(t|tl)ly supported",
    re.I,
)


class CollectiveCheckError(RuntimeError):
    """A collective returned values other than the ones its inputs imply; the message names what and where."""


def _torch() -> Any:
    return require_torch("lab_utils.distributed.collectives")


# --------------------------------------------------------------------------------------------------
# Bandwidth arithmetic (nccl-tests definitions)


def _check_collective(collective: Any, where: str, valid: Sequence[str] = COLLECTIVES) -> str:
    if collective not in valid:
        raise ValueError(f"{where}(collective={collective!r}): unknown collective; valid names are {list(valid)}")
    return collective


_check_int = check_int


def busbw_factor(collective: str, n: int) -> float:
    """busbw / algbw on ``n`` ranks: all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n;
    broadcast and reduce 1."""
    _check_collective(collective, "busbw_factor", _FACTOR_NAMES)
    n = _check_int(n, "n", "busbw_factor")
    if collective == "all_reduce":
        return 2 * (n - 1) / n  # a reduce-scatter, then an all-gather
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n  # each rank sends (or receives) all but its own 1/n
    return 1.0


def algbw_gbps(size_bytes: float, time_ms: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 B/s): ``size_bytes`` (S, see the module doc) over ``time_ms``."""
    if not size_bytes >= 0:
        raise ValueError(f"algbw_gbps(size_bytes={size_bytes!r}): must be >= 0 bytes")
    if not time_ms > 0:
        raise ValueError(f"algbw_gbps(time_ms={time_ms!r}): must be > 0 milliseconds")
    return float(size_bytes) / (float(time_ms) * 1e-3) / 1e9


def busbw_gbps(collective: str, size_bytes: float, time_ms: float, n: int) -> float:
    """Bus bandwidth in GB/s: algbw × ``busbw_factor(collective, n)``; comparable with a link's speed."""
    return algbw_gbps(size_bytes, time_ms) * busbw_factor(collective, n)


# --------------------------------------------------------------------------------------------------
# Buffers, inputs, expected results


def torch_dtype(dtype: Any) -> Any:
    """A floating-point torch dtype from its name ("float32", "bfloat16", "float8_e4m3fn"...) or itself."""
    torch = _torch()
    dt = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(
            f"dtype={dtype!r}: use the name of a floating-point torch dtype, e.g. 'float32', 'bfloat16', "
            "'float16' or 'float8_e4m3fn' (gloo refuses float8: a row marked unsupported)"
        )
    return dt


def buffer_numels(collective: str, size_bytes: int, n: int, itemsize: int) -> tuple[int, int, int]:
    """(input elements, output elements, S in bytes actually used) for one rank.

    S is rounded down to a whole number of elements per rank, so every chunk has the same length.
    all_reduce and broadcast work in place (input = output).
    """
    _check_collective(collective, "buffer_numels")
    per_rank = size_bytes // itemsize // n
    if per_rank < 1:
        raise ValueError(
            f"size_bytes={size_bytes}: too small for {n} ranks of {itemsize}-byte elements; "
            f"use at least {n * itemsize} bytes"
        )
    total = per_rank * n
    ins = {"all_gather": per_rank}.get(collective, total)
    outs = {"reduce_scatter": per_rank}.get(collective, total)
    return ins, outs, total * itemsize


def input_chunks(collective: str, rank: int, n: int) -> list[float]:
    """The value of each chunk of ``rank``'s input (one value: the whole buffer holds it).

    Chosen so every rank and every chunk differ, and small integers keep sums exact in bf16.
    """
    _check_collective(collective, "input_chunks")
    if collective == "reduce_scatter":
        return [float((rank + 1) * (j + 1)) for j in range(n)]  # rank r's piece for rank j
    if collective == "all_to_all":
        return [float(rank * n + j + 1) for j in range(n)]  # chunk j goes to rank j
    return [float(rank + 1)]


def expected_chunks(collective: str, rank: int, n: int) -> list[float]:
    """The value each chunk of ``rank``'s output must hold after the collective (one value: all of it)."""
    _check_collective(collective, "expected_chunks")
    if collective == "all_reduce":
        return [n * (n + 1) / 2]  # sum of rank + 1 over the ranks
    if collective == "broadcast":
        return [1.0]  # rank 0's value
    if collective == "all_gather":
        return [float(j + 1) for j in range(n)]  # chunk j is rank j's input
    if collective == "reduce_scatter":
        return [(rank + 1) * n * (n + 1) / 2]  # sum over ranks k of (k + 1)(rank + 1)
    return [float(j * n + rank + 1) for j in range(n)]  # all_to_all: chunk j came from rank j


def make_input(collective: str, rank: int, n: int, numel: int, dtype: Any, device: str) -> Any:
    """``rank``'s input tensor filled as ``input_chunks`` says."""
    torch = _torch()
    values = input_chunks(collective, rank, n)
    x = torch.empty(numel, dtype=dtype, device=device)
    for value, chunk in zip(values, x.chunk(len(values)), strict=True):
        chunk.fill_(value)
    return x


def check_result(collective: str, out: Any, rank: int, n: int) -> str | None:
    """``None`` when ``out`` holds what ``collective`` must give on ``rank`` of ``n``; else what is wrong.

    Data-moving collectives must match exactly (in the tensor's dtype); reductions within a few rounding
    steps of the dtype (the order of a sum is the backend's choice).
    """
    torch = _torch()
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
            return (
                f"rank {rank}{where}: values in [{lo:g}, {hi:g}], expected {want:g}; "
                f"first wrong element {first} = {out.reshape(-1)[first].item():g}"
            )
    return None


def collective_call(collective: str, inp: Any, out: Any) -> Callable[[], Any]:
    """A no-argument function that runs ``collective`` once, blocking (``async_op=False``).

    torch >= 2.13 names the tensor forms ``all_gather_single`` / ``reduce_scatter_single`` and warns on
    the older ``all_gather_into_tensor`` / ``reduce_scatter_tensor``; older torch has only the latter.
    """
    import torch.distributed as dist

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


def _is_unsupported(exc: BaseException) -> bool:
    return isinstance(exc, NotImplementedError) or bool(_UNSUPPORTED.search(str(exc)))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        _torch().cuda.synchronize(device)


def _max_over_ranks(value: float, device: str) -> float:
    torch = _torch()
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


# --------------------------------------------------------------------------------------------------
# Workers (run in each rank's process by distributed.launch)


def bench_worker(ctx: Any, collectives: Sequence[str], sizes_bytes: Sequence[int], reps: int, warmup: int,
                 dtype: str | Sequence[str] = "float32", corrupt_rank: int | None = None) -> list[dict[str, Any]]:
    """Check, then time, each collective at each size (and dtype) on this rank; one row per case.

    Inputs are allocated and filled outside the timed region. The first call is checked; a wrong result
    on any rank raises ``CollectiveCheckError`` on every rank, naming collective, size and ranks. An op or
    dtype the backend refuses gives a row with ``status='unsupported'`` and the backend's words. ``time_ms``
    is the largest median over the ranks; ``rank_time_ms`` this rank's. ``corrupt_rank`` overwrites one
    element of that rank's result before the check, to see the check fire.
    """
    rows = []
    for name in [dtype] if isinstance(dtype, str) else dtype:
        for collective in collectives:
            for size in sizes_bytes:
                rows.append(_bench_one(ctx, collective, int(size), name, reps, warmup, corrupt_rank))
    return rows


def _bench_one(ctx: Any, collective: str, size: int, dtype: str, reps: int, warmup: int,
               corrupt_rank: int | None) -> dict[str, Any]:
    torch = _torch()
    import torch.distributed as dist

    dt = torch_dtype(dtype)
    n, rank, dev = ctx.world_size, ctx.rank, ctx.device
    n_in, n_out, s_bytes = buffer_numels(collective, size, n, torch.empty((), dtype=dt).element_size())
    label = f"{collective} {format_bytes(s_bytes)} {dtype}"
    row: dict[str, Any] = {
        "collective": collective, "size_bytes": s_bytes, "n_ranks": n, "backend": ctx.backend, "dtype": dtype,
        "rank": rank, "status": "ok", "reason": "", "correct": None, "rank_time_ms": math.nan,
        "time_ms": math.nan, "reps": reps,
    }
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
        _sync(dev)
        if corrupt_rank == rank:
            out.view(-1)[-1] = -7.0
        problem = check_result(collective, out, rank, n) or ""
        code = 2 if problem else 0
    except Exception as exc:
        if not _is_unsupported(exc):
            raise
        code, problem = 1, f"{ctx.backend} refused it: {str(exc).strip().splitlines()[0]}"
    agreed = int(_max_over_ranks(code, dev))
    if agreed == 2:
        reports: list[Any] = [None] * n
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
    row["time_ms"] = _max_over_ranks(t.median_ms, dev)  # as slow as the slowest rank
    return row


def bare_allreduce_worker(ctx: Any, size_bytes: int, iters: int, warmup: int) -> dict[str, float]:
    """The simplest all_reduce loop on fp32, for comparison with ``bench_worker``: ms per iteration.

    CUDA: one event before ``iters`` all_reduces, one after, one synchronize. CPU: a barrier, then the host
    clock around the loop. ``time_ms`` is the largest over the ranks.
    """
    torch = _torch()
    import torch.distributed as dist

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
    return {"rank_time_ms": ms, "time_ms": _max_over_ranks(ms, ctx.device), "size_bytes": numel * 4}


def nccl_debug_worker(ctx: Any, size_bytes: int) -> dict[str, Any]:
    """A few all_reduces (a small one and one of ``size_bytes``), so NCCL logs its set-up and choices."""
    torch = _torch()
    import torch.distributed as dist

    for nbytes in (4 * KIB, size_bytes):
        ctx.status(f"all_reduce {format_bytes(nbytes)} with NCCL_DEBUG=INFO")
        x = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=ctx.device)
        for _ in range(2):
            dist.all_reduce(x)
        _sync(ctx.device)
    return {"rank": ctx.rank, "pid": os.getpid(), "host": socket.gethostname()}


# --------------------------------------------------------------------------------------------------
# Link peak from the topology


def _pcie_gbps(gen: int | None, width: int | None) -> float | None:
    per_x16 = {3: PCIE_GEN3_GBPS, 4: PCIE_GEN4_GBPS, 5: PCIE_GEN5_GBPS}.get(gen or 0)
    if per_x16 is None:
        return None
    return per_x16 * (width or 16) / 16


def link_peak_gbps(report: Any = None, n_gpus: int = 2) -> tuple[float | None, str]:
    """(peak GB/s per direction of the slowest link between GPU0..GPU{n_gpus-1}, or None; a description).

    Reads ``report.topology`` (``env.probe()``; probed here when ``report`` is None) and ``report.gpus``:
    ``NV#`` is # NVLinks at 25 GB/s each per direction, capped at the GPU's datasheet NVLink figure; PIX,
    PXB, PHB, NODE and SYS go over PCIe, at the GPU's PCIe link rate. Indices are NVML's, which equal
    CUDA's unless CUDA_VISIBLE_DEVICES reorders them.
    """
    n_gpus = _check_int(n_gpus, "n_gpus", "link_peak_gbps", minimum=2)
    if report is None:
        from lab_utils.course import probe as env

        report = env.probe()
    gpus = list(getattr(report, "gpus", None) or [])
    topo = getattr(report, "topology", None) or {}
    if not gpus and not topo:
        return None, "no GPU link (gloo over loopback/shared memory)"
    labels = [str(x) for x in topo.get("labels", [])]
    matrix = topo.get("matrix") or []
    idx = [i for i, lab in enumerate(labels) if lab.startswith("GPU")][:n_gpus]
    if len(idx) < 2 or len(matrix) <= max(idx):
        return None, f"{len(gpus) or len(idx)} GPU(s) in the topology: no GPU-to-GPU link to measure"
    by_index = {getattr(g, "index", i): g for i, g in enumerate(gpus)}
    worst: tuple[float, str] | None = None
    unknown = []
    for a_pos, a in enumerate(idx):
        for b in idx[a_pos + 1 :]:
            cell = str(matrix[a][b]).strip()
            pair = f"{cell} between {labels[a]} and {labels[b]}"
            gpu = by_index.get(int(labels[a][3:]))
            peaks = peaks_for(gpu.name) if gpu is not None and getattr(gpu, "name", None) else None
            m = re.fullmatch(r"NV(\d+)", cell)
            if m:
                links = int(m.group(1))
                gbps = links * NVLINK_GBPS_PER_LINK
                gen = re.search(r"NVLink (\d)", peaks.notes) if peaks else None
                what = f"NVLink {gen.group(1)}" if gen else "NVLink"
                if peaks and peaks.nvlink_gbps_per_dir:
                    gbps = min(gbps, peaks.nvlink_gbps_per_dir)
                    desc = f"{pair}: {what}, {gbps:g} GB/s per direction ({links} links, {peaks.model} datasheet)"
                else:
                    desc = (f"{pair}: {what}, {gbps:g} GB/s per direction ({links} links × "
                            f"{NVLINK_GBPS_PER_LINK:g} GB/s, assumed: NVLink 2-4; NVLink 5 doubles it)")
            elif cell in ("PIX", "PXB", "PHB", "NODE", "SYS"):
                gen, width = getattr(gpu, "pcie_gen_max", None), getattr(gpu, "pcie_width_max", None)
                gbps = _pcie_gbps(gen, width)
                if gbps is not None:
                    desc = f"{pair}: PCIe gen{gen} x{width or 16}: {gbps:g} GB/s per direction"
                elif peaks is not None:
                    gbps = peaks.pcie_gbps_per_dir
                    desc = f"{pair}: PCIe, {gbps:g} GB/s per direction ({peaks.model} datasheet)"
                else:
                    unknown.append(pair)
                    continue
                if cell in ("NODE", "SYS"):
                    desc += "; the path crosses host bridges or CPU sockets, and NCCL may stage through host memory"
            else:
                unknown.append(pair)
                continue
            if worst is None or gbps < worst[0]:
                worst = (gbps, desc)
    if worst is None:
        return None, f"link speed unknown ({'; '.join(unknown) or 'no GPU pair in the topology'})"
    return worst


# --------------------------------------------------------------------------------------------------
# Parent side: what the notebook calls


def _check_sizes(sizes: Any, where: str) -> list[int]:
    if isinstance(sizes, (int, np.integer)):
        sizes = [sizes]
    sizes = list(sizes)
    if not sizes:
        raise ValueError(f"{where}(sizes_bytes=[]): give at least one size in bytes")
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1:
            raise ValueError(f"{where}(sizes_bytes={sizes!r}): each size must be a positive integer (bytes), got {s!r}")
    return [int(s) for s in sizes]


def collective_sweep(
    nprocs: int,
    sizes_bytes: Sequence[int] | None = None,
    collectives: Sequence[str] = COLLECTIVES,
    backend: str = "auto",
    reps: int | None = None,
    warmup: int | None = None,
    timeout_s: float = 900.0,
    dtype: str | Sequence[str] = "float32",
    report: Any = None,
    corrupt_rank: int | None = None,
) -> pd.DataFrame:
    """algbw and busbw of each collective at each size on ``nprocs`` ranks (NCCL on GPUs, else gloo).

    Defaults: NCCL 1 MiB..2 GiB (``GPU_SIZES``), 20 reps after 5 warm-ups; gloo 4 KiB..16 MiB
    (``CPU_SIZES``), 10 reps after 2. ``dtype``: a torch dtype name, or several (one set of rows each).
    ``peak_gbps`` is the GPU link per direction (``link_peak_gbps``; ``report`` from ``env.probe()``, probed
    when None), NaN on gloo. A wrong result raises (through ``distributed.WorkerError``); an op or dtype
    the backend refuses gives ``status='unsupported'`` and a reason.
    Columns: see ``SWEEP_COLUMNS``; ``.attrs['peak_description']`` says which link the peak is.
    """
    where = "collective_sweep"
    chosen = distributed.choose_backend(nprocs, backend)
    gpu = chosen == "nccl"
    collectives = [collectives] if isinstance(collectives, str) else list(collectives)
    bad = [c for c in collectives if c not in COLLECTIVES]
    if bad or not collectives:
        raise ValueError(f"{where}(collectives={collectives!r}): unknown {bad}; valid names are {list(COLLECTIVES)}")
    if sizes_bytes is None:
        sizes_bytes = GPU_SIZES if gpu else CPU_SIZES
    sizes = _check_sizes(sizes_bytes, where)
    reps = _check_int(reps if reps is not None else (20 if gpu else 10), "reps", where)
    warmup = _check_int(warmup if warmup is not None else (5 if gpu else 2), "warmup", where, minimum=0)
    dtypes = [str(torch_dtype(d)).removeprefix("torch.") for d in ([dtype] if isinstance(dtype, str) else dtype)]
    if not dtypes:
        raise ValueError(f"{where}(dtype=[]): give a dtype name, e.g. 'float32'")
    for name in dtypes:
        itemsize = _torch().empty((), dtype=torch_dtype(name)).element_size()
        for s in sizes:
            if s < nprocs * itemsize:
                raise ValueError(f"{where}(sizes_bytes): {s} bytes is less than one {name} element per rank "
                                 f"({nprocs} × {itemsize} bytes)")
    if gpu:
        peak, peak_desc = link_peak_gbps(report, n_gpus=max(nprocs, 2))
    else:
        peak, peak_desc = None, "no GPU link (gloo over loopback/shared memory)"
    per_rank = distributed.launch(
        bench_worker, nprocs, backend=chosen, timeout_s=timeout_s,
        kwargs={"collectives": list(collectives), "sizes_bytes": sizes, "reps": reps, "warmup": warmup,
                "dtype": dtypes, "corrupt_rank": corrupt_rank},
    )
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
        row.update(
            size_label=format_bytes(first["size_bytes"]),
            status="unsupported" if unsupported else "ok",
            reason=next((r["reason"] for r in unsupported if r["reason"]), ""),
            time_ms=time_ms,
            correct=None if unsupported else all(bool(r["correct"]) for r in same),
            peak_gbps=math.nan if peak is None else float(peak),
        )
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


def bare_allreduce(
    nprocs: int,
    size_bytes: int | None = None,
    iters: int | None = None,
    backend: str = "auto",
    warmup: int = 5,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """The simplest fp32 all_reduce loop (``bare_allreduce_worker``): time_ms, algbw_gbps, busbw_gbps.

    Defaults: NCCL 1 GiB × 20 iterations, gloo 4 MiB × 10. Compare with ``collective_sweep``'s all_reduce
    row at the same size: the helper's per-repetition events should cost next to nothing at ≥ 1 GiB.
    """
    where = "bare_allreduce"
    chosen = distributed.choose_backend(nprocs, backend)
    gpu = chosen == "nccl"
    size_bytes = _check_int(size_bytes if size_bytes is not None else (GIB if gpu else 4 * MIB), "size_bytes", where)
    iters = _check_int(iters if iters is not None else (20 if gpu else 10), "iters", where)
    warmup = _check_int(warmup, "warmup", where, minimum=0)
    res = distributed.launch(bare_allreduce_worker, nprocs, backend=chosen, timeout_s=timeout_s,
                             kwargs={"size_bytes": size_bytes, "iters": iters, "warmup": warmup})
    time_ms = max(r["rank_time_ms"] for r in res)
    nbytes = res[0]["size_bytes"]
    return {
        "size_bytes": nbytes, "n_ranks": nprocs, "backend": chosen, "iters": iters, "time_ms": time_ms,
        "algbw_gbps": algbw_gbps(nbytes, time_ms), "busbw_gbps": busbw_gbps("all_reduce", nbytes, time_ms, nprocs),
    }


# --------------------------------------------------------------------------------------------------
# NCCL's own account: NCCL_DEBUG=INFO


NCCL_DEBUG_SUBSYS = "INIT,GRAPH,ENV,TUNING"


def capture_nccl_debug(
    nprocs: int = 2,
    size_bytes: int = 256 * MIB,
    extra_env: dict[str, str] | None = None,
    backend: str = "auto",
    subsys: str = NCCL_DEBUG_SUBSYS,
    timeout_s: float = 300.0,
) -> str:
    """NCCL's INFO log of a few all_reduces on ``nprocs`` GPUs: every rank's file, concatenated by rank.

    Runs ``nccl_debug_worker`` with NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=``subsys`` and NCCL_DEBUG_FILE set to
    one file per process (``%h`` host, ``%p`` pid) in a temporary folder. ``extra_env`` adds variables
    (e.g. ``{"NCCL_P2P_DISABLE": "1"}`` to see the fall-back transport); NCCL_NVLS_ENABLE is refused:
    it stays as inherited. Read the result with ``parse_nccl_log``.
    """
    extra = dict(extra_env or {})
    if "NCCL_NVLS_ENABLE" in extra:
        raise ValueError("capture_nccl_debug(extra_env=...): NCCL_NVLS_ENABLE is not changed by the labs; "
                         "it stays as inherited (the launcher defaults it to 0)")
    no_nccl = ("NCCL debug output needs the NCCL backend (one GPU per rank, a CUDA build of torch)")
    try:
        chosen = distributed.choose_backend(nprocs, backend)
    except ValueError as exc:
        raise ValueError(f"{no_nccl}: {exc}") from None
    if chosen != "nccl":
        raise ValueError(f"{no_nccl}: here {nprocs} ranks run on gloo ({distributed.torch_gpu_count()} GPU(s)). "
                         "gloo writes no such log; parse_nccl_log works on a saved NCCL log instead")
    size_bytes = _check_int(size_bytes, "size_bytes", "capture_nccl_debug")
    with tempfile.TemporaryDirectory(prefix="nccl-debug-") as tmp:
        env = {**extra, "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": subsys,
               "NCCL_DEBUG_FILE": os.path.join(tmp, "nccl.%h.%p.log")}
        ranks = distributed.launch(nccl_debug_worker, nprocs, backend="nccl", timeout_s=timeout_s, env=env,
                                   kwargs={"size_bytes": size_bytes})
        parts, seen = [], set()
        for r in ranks:
            files = sorted(glob.glob(os.path.join(tmp, f"nccl.*.{r['pid']}.log")))
            seen.update(files)
            text = "".join(_read(f) for f in files)
            parts.append(f"# ---- rank {r['rank']} (pid {r['pid']}) ----\n" + (text or "# (no log written)\n"))
        for f in sorted(set(glob.glob(os.path.join(tmp, "*"))) - seen):
            parts.append(f"# ---- {os.path.basename(f)} ----\n" + _read(f))
    return "".join(p if p.endswith("\n") else p + "\n" for p in parts)


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


# NCCL's algorithm and protocol numbers (nccl.h / device.h), for logs that print numbers.
_ALGOS = ["TREE", "RING", "COLLNET_DIRECT", "COLLNET_CHAIN", "NVLS", "NVLS_TREE", "PAT"]
_PROTOS = ["LL", "LL128", "SIMPLE"]
# Search patterns of NCCL's topology graphs (graph/topo.h).
_PATTERNS = {1: "balanced tree", 2: "split tree", 3: "tree", 4: "ring", 5: "NVLS", 6: "CollNet direct"}
_PATH_TYPES = {"LOC": "same device", "NVL": "NVLink", "NVB": "NVLink through an intermediate GPU", "C2C": "C2C",
               "PIX": "one PCIe switch", "PXB": "several PCIe switches", "PXN": "NVLink then PCIe (PXN)",
               "PHB": "PCIe through the CPU's host bridge", "SYS": "across CPU sockets", "NET": "the network"}

# Formats seen in NCCL 2.2x INFO logs (2.28.9 on 2 × H200 over NVLink, and older issue reports).
_RE = {
    "version": re.compile(r"NCCL version (\d+\.\d+\.\d+\S*)"),
    "init": re.compile(r"\brank (\d+) nranks (\d+)\b", re.I),
    "nnodes": re.compile(r"\bnRanks (\d+) nNodes (\d+) localRanks (\d+)"),
    # P2P prints "Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM", SHM "Channel 00 : 0[0] -> 1[1] via SHM/direct/direct",
    # the network "Channel 00/0 : 2[0] -> 0[0] [receive] via NET/IB/3/GDRDMA".
    "transport": re.compile(
        r"Channel (\d+)(?:/\d+)? : (\d+)\[(\w+)\] -> (\d+)\[(\w+)\]\s*(?:\[(send|receive)\]\s*)?via (\S+)"
    ),
    "ring": re.compile(r"Channel (\d+)/(\d+) :((?:\s+\d+)+)\s*$"),
    "tree": re.compile(r"Trees\s+(\[\d+\].*)$"),
    "coll_channels": re.compile(
        r"(\d+) coll channels, (\d+) collnet channels, (\d+) nvls channels, (\d+) p2p channels"
    ),
    "env": re.compile(r"(NCCL_\w+) set by environment to (.*?)\.?\s*$"),
    "net": re.compile(r"(?:Using network|Assigned NET plugin) (\w+)"),
    "net_ok": re.compile(r"Initialized NET plugin (\w+)|NET/(\w+) : Using \[\d"),
    "net_failed": re.compile(r"Failed to initialize NET plugin (\w+)|NET/(\w+) : No device found"),
    "choice": re.compile(
        r"(\w+): (\d+) Bytes -> Algo (\w+) proto (\w+)(?:.*?channel\{Lo\.\.Hi\}=\{(\d+)\.\.(\d+)\})?", re.I
    ),
    "connected": re.compile(r"Connected all (rings|trees)"),
    "cuda_driver": re.compile(r"cudaDriverVersion (\d+)"),
    "nvls": re.compile(r"NVLS multicast support is (not )?available"),
    "system_bw": re.compile(r"System : maxBw ([\d.]+) totalBw ([\d.]+)"),
    "graph": re.compile(r"Pattern (\d+), crossNic \d+, nChannels (\d+), bw ([\d.]+)/([\d.]+), type (\w+)/(\w+)"),
    "init_time": re.compile(r"Init timings.*?total ([\d.]+)"),
    "table_algos": re.compile(r"NCCL INFO\s+Algorithm\s+\|(.*)$"),
    "table_protos": re.compile(r"NCCL INFO\s+Protocol\s+\|(.*)$"),
    "table_row": re.compile(r"NCCL INFO\s+(Broadcast|Reduce|AllGather|ReduceScatter|AllReduce)\s+\|(.*)$"),
}


def _name(value: str, table: list[str]) -> str:
    return table[int(value)] if value.isdigit() and int(value) < len(table) else value.upper()


def parse_nccl_log(text: str) -> dict[str, Any]:
    """What an NCCL_DEBUG=INFO log says, with a few sentences explaining it.

    Keys: version, n_ranks, n_nodes, cuda_driver, transports (Counter of channel connections by transport,
    e.g. 'P2P/CUMEM', 'SHM/direct/direct', 'NET/IB/0/GDRDMA'), transport_kinds ('P2P', 'SHM', 'NET'),
    n_channels, rings and trees (one entry per distinct line), coll_channels, p2p_channels, graphs (NCCL's
    topology search: pattern, n_channels, bw_gbps per channel, path type), system_bw_gbps (NCCL's own
    estimate of the GPU-to-GPU path), tuning (NCCL's model: collective, algorithm, protocol, latency_us,
    bw_gbps; non-zero entries), choices (per call: collective, bytes, algorithm, protocol, channels),
    network, net_plugins, net_unavailable, env (NCCL_* variables it read), nvls_available, connected,
    init_time_s, n_lines, explanations. Unknown lines are ignored; nothing here raises on odd input.
    """
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    if not isinstance(text, str):
        raise ValueError(f"parse_nccl_log(text=...): expected the log as a string, got {type(text).__name__}")
    out: dict[str, Any] = {
        "version": None, "n_ranks": None, "n_nodes": None, "cuda_driver": None, "transports": Counter(),
        "transport_kinds": Counter(), "n_channels": None, "rings": [], "trees": [], "coll_channels": None,
        "p2p_channels": None, "graphs": [], "system_bw_gbps": None, "tuning": [], "choices": [], "network": None,
        "net_plugins": [], "net_unavailable": [], "env": {}, "nvls_available": None, "connected": [],
        "init_time_s": None, "n_lines": 0, "explanations": [],
    }
    state: dict[str, Any] = {"ring_channels": set(), "link_channels": set(), "nranks": [], "algos": [],
                             "protos": [], "tuning_seen": set()}
    for raw in text.splitlines():
        line = raw.rstrip()
        if "NCCL" not in line and "Channel" not in line:
            continue
        out["n_lines"] += 1
        with contextlib.suppress(Exception):  # one odd line must not lose the rest of the log
            _parse_line(line, out, state)
    if state["nranks"]:
        out["n_ranks"] = max(state["nranks"])
    if out["n_channels"] is None and (state["ring_channels"] or state["link_channels"]):
        out["n_channels"] = len(state["ring_channels"] or state["link_channels"])
    out["explanations"] = _explain(out)
    return out


def _add_once(items: list[Any], item: Any) -> None:
    if item not in items:
        items.append(item)


def _parse_line(line: str, out: dict[str, Any], state: dict[str, Any]) -> None:
    m = _RE["transport"].search(line)
    if m:
        via = m.group(7)
        out["transports"][via] += 1
        out["transport_kinds"][via.split("/")[0]] += 1
        state["link_channels"].add(int(m.group(1)))
        return
    m = _RE["ring"].search(line)
    if m:
        ch, total = int(m.group(1)), int(m.group(2))
        state["ring_channels"].add(ch)
        out["n_channels"] = max(out["n_channels"] or 0, total)
        _add_once(out["rings"], f"channel {ch:02d}: " + " -> ".join(m.group(3).split()))
        return
    m = _RE["tree"].search(line)
    if m:
        _add_once(out["trees"], m.group(1).strip())
        return
    if _parse_table(line, out, state):
        return
    m = _RE["version"].search(line)
    if m and out["version"] is None:
        out["version"] = m.group(1)
    m = _RE["nnodes"].search(line)
    if m:
        state["nranks"].append(int(m.group(1)))
        out["n_nodes"] = max(out["n_nodes"] or 0, int(m.group(2)))
    else:
        m = _RE["init"].search(line)
        if m:
            state["nranks"].append(int(m.group(2)))
    m = _RE["cuda_driver"].search(line)
    if m:
        out["cuda_driver"] = int(m.group(1))
    m = _RE["coll_channels"].search(line)
    if m:
        out["coll_channels"], out["p2p_channels"] = int(m.group(1)), int(m.group(4))
    m = _RE["env"].search(line)
    if m:
        out["env"][m.group(1)] = m.group(2).strip()
    m = _RE["net"].search(line)
    if m:
        out["network"] = m.group(1)
    m = _RE["net_ok"].search(line)
    if m:
        _add_once(out["net_plugins"], m.group(1) or m.group(2))
    m = _RE["net_failed"].search(line)
    if m:
        _add_once(out["net_unavailable"], m.group(1) or m.group(2))
    m = _RE["choice"].search(line)
    if m:
        out["choices"].append({
            "collective": m.group(1), "bytes": int(m.group(2)), "algorithm": _name(m.group(3), _ALGOS),
            "protocol": _name(m.group(4), _PROTOS),
            "channels": int(m.group(6)) - int(m.group(5)) + 1 if m.group(5) is not None else None,
        })
    m = _RE["connected"].search(line)
    if m:
        _add_once(out["connected"], m.group(1))
    m = _RE["nvls"].search(line)
    if m:
        out["nvls_available"] = m.group(1) is None
    m = _RE["system_bw"].search(line)
    if m:
        out["system_bw_gbps"] = float(m.group(1))
    m = _RE["graph"].search(line)
    if m:
        pattern = int(m.group(1))
        _add_once(out["graphs"], {
            "pattern": _PATTERNS.get(pattern, f"pattern {pattern}"), "n_channels": int(m.group(2)),
            "bw_gbps": float(m.group(3)), "type": m.group(5),
        })
    m = _RE["init_time"].search(line)
    if m:
        out["init_time_s"] = max(out["init_time_s"] or 0.0, float(m.group(1)))


def _parse_table(line: str, out: dict[str, Any], state: dict[str, Any]) -> bool:
    """NCCL's tuning table (TUNING): per collective, 'latency_us/ bw_gbps' for each algorithm and protocol."""
    m = _RE["table_algos"].search(line)
    if m:
        state["algos"] = [a.strip() for a in m.group(1).split("|") if a.strip()]
        return True
    m = _RE["table_protos"].search(line)
    if m:
        state["protos"] = [p.strip() for p in m.group(1).split("|") if p.strip()]
        return True
    m = _RE["table_row"].search(line)
    if not m or not state["algos"]:
        return bool(m)
    cells = [c.strip() for c in m.group(2).split("|") if c.strip()]
    per_algo = 3  # LL, LL128, Simple
    for i, cell in enumerate(cells):
        if i // per_algo >= len(state["algos"]) or "/" not in cell:
            break
        latency, bw = (float(v) for v in cell.split("/"))
        algo = state["algos"][i // per_algo]
        proto = state["protos"][i] if i < len(state["protos"]) else _PROTOS[i % per_algo]
        key = (m.group(1), algo, proto)
        if bw > 0 and key not in state["tuning_seen"]:
            state["tuning_seen"].add(key)
            out["tuning"].append({"collective": key[0], "algorithm": algo, "protocol": proto,
                                  "latency_us": latency, "bw_gbps": bw})
    return True


def _explain(p: dict[str, Any]) -> list[str]:
    says = []
    if p["version"]:
        who = f" on {p['n_ranks']} ranks" if p["n_ranks"] else ""
        nodes = f", {p['n_nodes']} node(s)" if p["n_nodes"] else ""
        took = f"; setting up the communicator took {p['init_time_s']:g} s" if p["init_time_s"] else ""
        says.append(f"NCCL {p['version']}{who}{nodes}{took}.")
    kinds, vias = p["transport_kinds"], p["transports"]
    if kinds.get("P2P"):
        how = ", ".join(sorted(v for v in vias if v.startswith("P2P")))
        says.append(
            f"{kinds['P2P']} channel connections go GPU to GPU directly (P2P: {how}), over NVLink or PCIe peer "
            "access. CUMEM: buffers shared through CUDA's virtual memory API; IPC: legacy CUDA IPC handles; "
            "/read: the receiver reads from the sender's memory."
        )
    if kinds.get("SHM"):
        says.append(
            f"{kinds['SHM']} channel connections go through host shared memory: the GPUs do not use peer access "
            "(none between them, across CPU sockets, or NCCL_P2P_DISABLE=1), so data crosses PCIe twice."
        )
    if kinds.get("NET"):
        says.append(
            f"{kinds['NET']} channel connections go through the network "
            f"({', '.join(sorted(v for v in vias if v.startswith('NET')))}): expected between nodes; inside one "
            "node it means P2P and SHM were not usable."
        )
    if p["n_channels"]:
        says.append(
            f"{p['n_channels']} channels: NCCL splits each collective over them, each run by its own CUDA block "
            "on its own path; more channels use more links and SMs in parallel."
        )
    if p["rings"]:
        says.append(f"Ring order, e.g. {p['rings'][0]}: each rank sends to the next and receives from the one "
                    "before; all_reduce goes round twice (reduce-scatter, then all-gather).")
    if p["trees"]:
        says.append("'Trees' lines give each rank's parent and children per channel, for the tree algorithm "
                    "(latency-bound sizes).")
    for g in p["graphs"][:2]:
        says.append(f"Topology search, {g['pattern']}: {g['n_channels']} channels at {g['bw_gbps']:g} GB/s each "
                    f"over {_PATH_TYPES.get(g['type'], g['type'])} ({g['type']}).")
    if p["system_bw_gbps"]:
        nvl = any(g["type"] == "NVL" for g in p["graphs"])
        says.append(f"NCCL's model of the fastest GPU path: {p['system_bw_gbps']:g} GB/s"
                    + (" (NCCL rates a Hopper NVLink below the datasheet's 25 GB/s per link: 370.8 for 18 links, "
                       "against 450)." if nvl else "."))
    best = [t for t in p["tuning"] if t["collective"] == "AllReduce"]
    if best:
        top = max(best, key=lambda t: t["bw_gbps"])
        says.append(f"NCCL's tuning model for AllReduce: best {top['algorithm']}/{top['protocol']} at "
                    f"{top['bw_gbps']:g} GB/s (algorithm bandwidth) with {top['latency_us']:g} µs latency; it "
                    "picks per call the pair with the least predicted time.")
    algos = Counter(f"{c['algorithm']}/{c['protocol']}" for c in p["choices"])
    if algos:
        says.append("Algorithm/protocol chosen per call: " + ", ".join(f"{k} ×{v}" for k, v in algos.items())
                    + " (LL/LL128 for small messages: low latency; SIMPLE for large: full bandwidth).")
    if p["network"]:
        says.append(f"Network plugin: {p['network']} (used between nodes only; "
                    + ("no InfiniBand found, so TCP sockets" if p["network"].lower() == "socket"
                       else "RDMA over InfiniBand/RoCE") + ").")
    if p["env"]:
        says.append("Read from the environment: " + ", ".join(f"{k}={v}" for k, v in p["env"].items()) + ".")
    if p["env"].get("NCCL_NVLS_ENABLE") == "0" or p["nvls_available"] is False:
        says.append("NVLink SHARP (NVLS, multicast in the NVSwitch) is off, so busbw stays below the link's "
                    "line rate; with it, all_reduce busbw can exceed it.")
    if not says:
        says.append("No NCCL INFO lines recognised: was the log written with NCCL_DEBUG=INFO?")
    return says
