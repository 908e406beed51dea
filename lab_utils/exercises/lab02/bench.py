"""Lab 02's 02.2: the all-reduce benchmark worker, run in real ranks beside the reference, taking turns on the same
sizes (bytes); times in ms, bandwidths in GB/s (1e9 bytes/s), as nccl-tests reports them."""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lab_utils.distributed import ranks as ranks_mod
from lab_utils.distributed.bandwidth import KIB, MIB
from lab_utils.distributed.spawn import WorkerContext
from lab_utils.exercises.framework import (
    CodeExercise,
    References,
    Wrong,
    match_slip,
    patched,
    per_call_wrong,
    source_as,
)
from lab_utils.exercises.lab02.in_ranks import (
    fmt_bytes,
    grading_ranks,
    no_distributed,
    plain,
    run_in_ranks,
    shipped_answer,
    show,
)

BENCH_ITERS, BENCH_WARMUP = 5, 10  # warm-up calls timed too would triple the time: far outside the band
BENCH_ROUNDS = 6  # reference then student, up to 6 times: one round inside the band is enough (CPU timing is noisy)
BENCH_BAND = (0.35, 2.0)  # student time / reference time; the slips it catches are 1e-3, 3x, iters x or a GPU no-sync
BENCH_TIMEOUT_S = 240.0
_FORMULA_RANKS = 3  # the all_reduce factor 2(n-1)/n is 1 on 2 ranks: the formulas are checked on 3


def bench_sizes(backend: str) -> tuple[int, ...]:
    """The sizes (bytes) the check times: NCCL 16 MiB and 256 MiB; gloo 256 KiB and 4 MiB."""
    return (16 * MIB, 256 * MIB) if backend == "nccl" else (256 * KIB, 4 * MIB)


def reference_allreduce_bench(ctx: WorkerContext, sizes_bytes: Sequence[int], iters: int,
                              warmup: int, *, dtype: torch.dtype = torch.float32) -> list[dict[str, float]]:
    """One rank's all_reduce benchmark: per size, ms per call, algbw and busbw in GB/s (nccl-tests definitions).

    fp32 buffer of ``size`` bytes (``dtype``: the check times the student's element type too); ``warmup``
    untimed calls (the first calls set up NCCL's connections and buffers); then ``iters`` calls timed with CUDA
    events on a GPU, or with the host clock after a barrier on gloo (its all_reduce on CPU tensors returns when
    done). 1 GB = 1e9 bytes.
    """
    n = ctx.world_size
    rows = []
    for size in sizes_bytes:
        x = torch.ones(size // dtype.itemsize, dtype=dtype, device=ctx.device)  # size bytes: 4 per fp32 element
        for _ in range(warmup):
            dist.all_reduce(x)
        if ctx.device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(iters):
                dist.all_reduce(x)  # queued on the GPU: returns before the data has moved
            end.record()
            torch.cuda.synchronize()  # wait for the work itself
            ms = start.elapsed_time(end) / iters
        else:
            dist.barrier()  # start together: the first call would absorb the other ranks' lateness
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(x)
            ms = (time.perf_counter() - t0) * 1e3 / iters
        algbw = size / (ms * 1e-3) / 1e9
        rows.append({"size_bytes": size, "time_ms": ms, "algbw_gbps": algbw,
                     "busbw_gbps": algbw * 2 * (n - 1) / n})
    return rows


_ROW_KEYS = ("size_bytes", "time_ms", "algbw_gbps", "busbw_gbps")


class _CountAllReduce:
    """Counts ``dist.all_reduce`` calls and the bytes of each while active (rank side)."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.dtypes: Counter[torch.dtype] = Counter()  # the element types the student reduced
        self.on = False

    @contextlib.contextmanager
    def patched(self) -> Iterator[_CountAllReduce]:
        import torch.distributed.distributed_c10d as c10d

        original = c10d.all_reduce

        def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.on:
                self.calls.append(int(tensor.numel() * tensor.element_size()))
                self.dtypes[tensor.dtype] += 1
            return original(tensor, *args, **kwargs)

        with patched((dist, "all_reduce", all_reduce), (c10d, "all_reduce", all_reduce)):
            yield self


def _bench_worker(ctx: WorkerContext, student: ranks_mod.Shipped, sizes: list[int], iters: int, warmup: int,
                  rounds: int, timing: bool) -> dict[str, Any]:
    """Rank side of q2: the reference, then the student's function, up to ``rounds`` times; each one's times,
    the student's rows and the bytes of each all_reduce call the student made. Stops once every size has a round
    inside the band: the ranks decide together, from the slowest rank's times, with the judge's own rule
    (``_band_picks``), so a run stopped early is one ``_judge_timing`` passes."""
    out: dict[str, Any] = {"ref_ms": [], "rows": [], "calls": []}
    slowest_rounds: list[list[tuple[float, float]]] = []  # per round, (student ms, reference ms) per size
    counter = _CountAllReduce()
    with counter.patched():
        fn = student.load()
        for k in range(rounds):
            if timing:
                ctx.status(f"reference all_reduce bench, round {k + 1}")
                # after the first round, the reference reduces the student's element type: on gloo a bf16 sum
                # runs in software, 2.5x an fp32 one of the same bytes on a busy CPU, which is no slip
                dtype = counter.dtypes.most_common(1)[0][0] if counter.dtypes else torch.float32
                out["ref_ms"].append([r["time_ms"] for r in reference_allreduce_bench(ctx, sizes, iters, warmup,
                                                                                      dtype=dtype)])
            ctx.status(f"allreduce_bench, round {k + 1}")
            counter.calls, counter.on = [], True
            rows = plain(fn(ctx, list(sizes), iters, warmup))
            counter.on = False
            out["rows"].append(rows)
            out["calls"].append(counter.calls)
            if not timing:
                break
            try:
                mine = [r["time_ms"] for r in _rows_of(rows, sizes, "")]
            except Wrong:
                mine = None
            agreed = torch.tensor([1.0 if mine is None else 0.0, *(mine or [0.0] * len(sizes)), *out["ref_ms"][-1]],
                                  dtype=torch.float64, device=ctx.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # every rank sees the slowest rank's times
            bad, *slowest = agreed.tolist()
            slowest_rounds.append(list(zip(slowest[:len(sizes)], slowest[len(sizes):], strict=True)))
            # malformed rows (the launcher says what is wrong), or every size has a round the judge will pass
            if bad or None not in _band_picks(slowest_rounds):
                break
    return out


def _rows_of(value: Any, sizes: Sequence[int], call: str) -> list[dict[str, float]]:
    if isinstance(value, dict) and "__repr__" not in value and set(_ROW_KEYS) & set(value):
        raise Wrong(f"{call} returned one dict; return a list with one dict per size in sizes_bytes")
    if not isinstance(value, list):
        hint = " (does it end with `return rows`?)" if value is None else ""
        raise Wrong(f"{call} returned {show(value)}{hint}; expected a list of dicts, one per size, with keys "
                    f"{', '.join(_ROW_KEYS)}")
    if len(value) != len(sizes):
        raise Wrong(f"{call} returned {len(value)} rows for {len(sizes)} sizes; one row per size in sizes_bytes")
    rows = []
    for i, row in enumerate(value):
        if not isinstance(row, dict) or "__repr__" in row:
            raise Wrong(f"{call}: row {i} is {show(row)}, not a dict with keys {', '.join(_ROW_KEYS)}")
        missing = [k for k in _ROW_KEYS if k not in row]
        if missing:
            raise Wrong(f"{call}: row {i} has no {', '.join(missing)} (keys needed: {', '.join(_ROW_KEYS)}; "
                        f"it has {', '.join(row) or 'none'})")
        clean = {}
        for k in _ROW_KEYS:
            v = row[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise Wrong(f"{call}: row {i}'s {k} is {show(v)}; expected a finite number")
            clean[k] = float(v)
        if int(clean["size_bytes"]) != sizes[i]:
            raise Wrong(f"{call}: row {i}'s size_bytes is {clean['size_bytes']:g}, expected {sizes[i]} (the sizes "
                        "in the order given)")
        rows.append(clean)
    return rows


def _judge_calls(calls: list[int], sizes: Sequence[int], iters: int, warmup: int, call: str) -> None:
    made = Counter(calls)
    if not calls:
        raise Wrong(f"{call} never called dist.all_reduce: there is nothing to time")
    for size in sizes:
        label = fmt_bytes(size)
        n = made.get(size, 0)
        if n == 0:
            if made.get(4 * size):
                raise Wrong(f"{call}: the {label} case all-reduced a buffer of {fmt_bytes(4 * size)}: "
                            "torch.ones(size) makes `size` fp32 elements of 4 bytes each; use size // 4 elements")
            if made.get(size // 4):
                raise Wrong(f"{call}: the {label} case all-reduced only {fmt_bytes(size // 4)}: size is in bytes and "
                            "an fp32 element is 4 bytes, so the buffer needs size // 4 elements, not size // 16")
            if made.get(8 * size) or made.get(size // 8):
                raise Wrong(f"{call}: the {label} case all-reduced {fmt_bytes(made.most_common(1)[0][0])}: "
                            "bits and bytes mixed up; size is in bytes")
            seen = ", ".join(fmt_bytes(b) for b in sorted(made))
            raise Wrong(f"{call}: no all_reduce of a {label} buffer (the buffers were {seen}): make a buffer of "
                        "`size` bytes for each size, e.g. torch.ones(size // 4) in fp32")
        if n < iters:
            raise Wrong(f"{call}: only {n} all_reduce calls on the {label} buffer for iters={iters}: time `iters` "
                        "calls and divide by iters")
        if n == iters:
            raise Wrong(f"{call}: {n} all_reduce calls on the {label} buffer for iters={iters}: no warm-up. The first "
                        "calls set up the communicator's connections and buffers (hundreds of ms with NCCL); run "
                        f"`warmup` untimed calls first (here {warmup}), then start the clock")


def _ratio(times: tuple[float, float]) -> float:
    """Student ms / reference ms."""
    return times[0] / times[1] if times[1] > 0 else math.inf


def _band_picks(slowest_rounds: Sequence[Sequence[tuple[float, float]]]) -> list[int | None]:
    """Per size, the round the judge reads (``slowest_rounds[round][size]`` is (student ms, reference ms)): of the
    rounds inside BENCH_BAND, the closest to the reference; None where no round is inside. The one rule of both
    sides: the ranks stop once no size has None, and the judge passes then. (Closest alone is not it: the band is
    lopsided, so a round at 2.1x is closer than one at 0.4x, and a run stopped on a 0.4x round was failed on 2.1x.)"""
    picks = []
    for i in range(len(slowest_rounds[0])):
        inside = [k for k, times in enumerate(slowest_rounds) if BENCH_BAND[0] <= _ratio(times[i]) <= BENCH_BAND[1]]
        picks.append(min(inside, key=lambda k: abs(math.log(_ratio(slowest_rounds[k][i]))), default=None))
    return picks


def _judge_timing(per_rank: list[dict[str, Any]], sizes: Sequence[int], iters: int, warmup: int, gpu: bool,
                  call: str) -> list[tuple[float, float]]:
    """(student ms, reference ms) per size from the round ``_band_picks`` reads (each round's reference ran just
    before the student's function); Wrong when no round of a size falls in the band."""
    rounds = len(per_rank[0]["rows"])
    # A collective is as slow as its slowest rank: the largest time over the ranks, for both (as the ranks agree).
    slowest_rounds = [[(max(r["rows"][k][i]["time_ms"] for r in per_rank), max(r["ref_ms"][k][i] for r in per_rank))
                       for i in range(len(sizes))] for k in range(rounds)]
    out = []
    for i, (size, best) in enumerate(zip(sizes, _band_picks(slowest_rounds), strict=True)):
        if best is not None:
            out.append(slowest_rounds[best][i])
            continue
        ratios = [_ratio(times[i]) for times in slowest_rounds]
        ratio = sorted(ratios)[rounds // 2]
        mine, ref_ms = slowest_rounds[ratios.index(ratio)][i]
        gpu_fix = ("dist.all_reduce only queues the work on the GPU. Call torch.cuda.synchronize() before reading the "
                   "clock, or time with CUDA events and synchronize before elapsed_time.") if gpu else ""
        raise per_call_wrong(f"{call}: at {fmt_bytes(size)}", mine, ref_ms, iters, warmup,
                             tries=f" ({rounds} tries)" if rounds > 1 else "", gpu_fix=gpu_fix,
                             one_call="one all_reduce")
    return out


def _judge_formulas(rows: list[dict[str, float]], n: int, call: str, where: str) -> None:
    factor = 2 * (n - 1) / n
    for row in rows:
        size, ms = row["size_bytes"], row["time_ms"]
        label = fmt_bytes(int(size))
        if ms <= 0:
            raise Wrong(f"{call}: time_ms {ms:g} at {label}: a time must be > 0")
        expected = size / (ms * 1e-3) / 1e9
        ratio = row["algbw_gbps"] / expected
        if not math.isclose(ratio, 1.0, rel_tol=1e-3):
            slips = {
                8.0: "that is bits per second: algbw counts bytes (size_bytes / seconds / 1e9)",
                1 / 8: "the bytes were divided by 8: size_bytes is already in bytes",
                1e9 / 2**30: "that is GiB/s (2^30 bytes): nccl-tests' GB/s are 1e9 bytes per second",
                2**30 / 1e9: "the conversion to GB went the wrong way: GB/s = bytes / seconds / 1e9",
                1e3: "the time went in as seconds where it was milliseconds (or the other way): "
                     "algbw = size_bytes / (time_ms * 1e-3) / 1e9",
                1e-3: "the time went in as milliseconds where it was seconds: "
                      "algbw = size_bytes / (time_ms * 1e-3) / 1e9",
                0.25: "that divides the number of fp32 elements, not bytes, by the time: S is in bytes",
                factor if n > 2 else -1.0: f"that is busbw (× 2(n-1)/n = {factor:.4g}) in the algbw column: algbw "
                                           "is S / t alone",
            }
            slip = match_slip(ratio, slips, 1e-3)
            raise Wrong(f"{call}{where}: at {label}, algbw_gbps = {row['algbw_gbps']:.4g}, but size_bytes / time_ms "
                        f"gives {expected:.4g} GB/s ({ratio:.4g}x): "
                        f"{slip or 'algbw = size_bytes / (time_ms * 1e-3) / 1e9'}.")
        got = row["busbw_gbps"] / row["algbw_gbps"]
        if not math.isclose(got, factor, rel_tol=1e-3):
            head = (f"{call}{where}: on {n} ranks busbw_gbps / algbw_gbps should be 2(n-1)/n = {factor:.4g}; "
                    f"yours is {got:.4g}")
            slips = {
                1.0: "algbw reported as busbw. busbw = algbw × 2(n-1)/n: an all_reduce moves each byte twice "
                     "(reduce-scatter, then all-gather) through (n-1)/n of the ring; on 2 ranks the factor happens "
                     "to be 1, which is why this check runs on 3",
                (n - 1) / n: "that is (n-1)/n, one phase; all_reduce is two (reduce-scatter, then all-gather): "
                             "2(n-1)/n",
                2.0: "the /n is missing from 2(n-1)/n: 2(n-1)/n, not 2",
                2 * (n - 1): "the /n is missing: 2(n-1)/n, not 2(n-1)",
                1 / factor: "you divided by the factor: busbw = algbw × 2(n-1)/n",
                factor * 1e9 / 2**30: "busbw is in GiB/s while algbw is in GB/s: use 1e9 for both",
                0.0: "busbw is 0: integer division? 2 * (n - 1) // n is 1 for every n > 1; use /",
            }
            slip = match_slip(got, slips, 1e-3)
            world = "ctx.world_size (or dist.get_world_size()), not a fixed 2"
            raise Wrong(f"{head}: {slip or 'busbw = algbw × 2(n-1)/n with n = ' + world}.")


def _grade_allreduce_bench(fn: Any, backend: str | None = None, nprocs: int | None = None) -> str:
    if backend is None or nprocs is None:
        backend, nprocs = grading_ranks(backend, nprocs)
        if backend == "gloo" and nprocs == 2:
            nprocs = _FORMULA_RANKS  # on a CPU, one run on 3 ranks checks the time and the formulas at once
    sizes = list(bench_sizes(backend))
    call = (f"allreduce_bench(ctx, sizes_bytes=[{', '.join(fmt_bytes(s) for s in sizes)}], iters={BENCH_ITERS}, "
            f"warmup={BENCH_WARMUP}) on {nprocs} {backend} ranks")
    with shipped_answer(fn, "allreduce_bench") as shipped:
        res = run_in_ranks(_bench_worker, shipped, call, nprocs, backend, BENCH_TIMEOUT_S,
                           {"sizes": sizes, "iters": BENCH_ITERS, "warmup": BENCH_WARMUP, "rounds": BENCH_ROUNDS,
                            "timing": True})
        per_rank = [{**r, "rows": [_rows_of(rows, sizes, call) for rows in r["rows"]]} for r in res]
        _judge_calls(res[0]["calls"][0], sizes, BENCH_ITERS, BENCH_WARMUP, call)
        times = _judge_timing(per_rank, sizes, BENCH_ITERS, BENCH_WARMUP, backend == "nccl", call)
        for rank, r in enumerate(per_rank):
            _judge_formulas(r["rows"][0], nprocs, call, "" if rank == 0 else f" (rank {rank})")
        extra = ""
        if nprocs == 2:  # factor 1: the formulas once more on 3 gloo ranks
            small = [256 * KIB]
            call3 = (f"allreduce_bench(ctx, sizes_bytes=[256 KiB], iters={BENCH_ITERS}, warmup={BENCH_WARMUP}) on "
                     f"{_FORMULA_RANKS} gloo CPU ranks (on 2 ranks busbw = algbw, so the factor is checked on 3; "
                     "ctx.device is 'cpu' there)")
            res3 = run_in_ranks(_bench_worker, shipped, call3, _FORMULA_RANKS, "gloo", BENCH_TIMEOUT_S,
                                {"sizes": small, "iters": BENCH_ITERS, "warmup": BENCH_WARMUP, "rounds": 1,
                                 "timing": False})
            for rank, r in enumerate(res3):
                _judge_formulas(_rows_of(r["rows"][0], small, call3), _FORMULA_RANKS, call3,
                                "" if rank == 0 else f" (rank {rank})")
            extra = f"; algbw and busbw also checked on {_FORMULA_RANKS} gloo ranks"
    shown = ", ".join(f"{fmt_bytes(s)} {mine:.3g} ms (reference {ref:.3g} ms)"
                      for s, (mine, ref) in zip(sizes, times, strict=True))
    return f"On {nprocs} {backend} ranks: {shown}; warm-up, units and busbw = algbw × 2(n-1)/n all right{extra}."


q2 = CodeExercise(
    name="02.2 the all-reduce benchmark worker", var="allreduce_bench", grade=_grade_allreduce_bench,
    references=References("time the all_reduce calls and compute the bandwidths yourself",
                           reference_allreduce_bench, "lab_utils.distributed.collectives.bare_allreduce_worker"),
    signature="allreduce_bench(ctx, sizes_bytes, iters, warmup) -> list[dict]", applicable=no_distributed,
    hints=[
        "Per size: a buffer of `size` bytes on ctx.device (fp32: size // 4 elements); `warmup` untimed "
        "dist.all_reduce calls; then time `iters` calls. Return one dict per size: size_bytes, time_ms (per "
        "call), algbw_gbps, busbw_gbps.",
        "On a GPU dist.all_reduce returns once the work is queued: record CUDA events around the loop and "
        "torch.cuda.synchronize() before elapsed_time. On gloo (ctx.device == 'cpu') the call returns when it is "
        "done: dist.barrier(), then time.perf_counter() around the loop.",
        "algbw is the buffer's bytes over the time of one call, in GB/s (ms to s, GB = 1e9 bytes); busbw is algbw "
        "times the all-reduce factor 2(n - 1)/n, n = ctx.world_size. On 2 ranks the factor is 1, so the check runs "
        "on 3.",
    ],
    solution_text="import time\nimport torch\nimport torch.distributed as dist\n\n" + source_as(
        reference_allreduce_bench, "allreduce_bench(ctx, sizes_bytes, iters, warmup, *, dtype=torch.float32)"),
)

