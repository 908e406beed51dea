"""Lab 02 exercises: NCCL collectives and multi-GPU DDP training; the rank exercises run in real ranks
(``grading_ranks``). Sizes in bytes, bandwidths in GB/s (1e9 bytes/s).

Design notes: docs/internals.md#lab_utilsexerciseslab02py
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from lab_utils.args import check_int
from lab_utils.distributed import ranks as ranks_mod
from lab_utils.distributed.bandwidth import KIB, MIB, busbw_factor  # the one definition the lab's measurements use
from lab_utils.distributed.ddp import evaluate
from lab_utils.distributed.plan import lab_plan
from lab_utils.distributed.spawn import WorkerContext, WorkerError, WorkerTimeout, launch, torch_gpu_count
from lab_utils.exercises.framework import (
    CodeExercise,
    Exercise,
    References,
    StudentLine,
    Wrong,
    amended,
    choice,
    close_to,
    fraction,
    match_slip,
    number,
    patched,
    per_call_wrong,
    run_student,
    source_as,
    student_frame,
)
from lab_utils.exercises.outcomes import _short
from lab_utils.models import DigitsCNN, digits_arrays
from lab_utils.procs import temporary_folder

__all__ = [
    "q1", "q2", "q3", "q4", "q5", "q6", "q7",
    "COLLECTIVES", "reference_busbw_factor",
    "grading_ranks", "BENCH_ITERS", "BENCH_WARMUP", "bench_sizes", "reference_allreduce_bench",
    "GRAD_PARAMS", "GRAD_BYTES_PER_PARAM", "GRAD_RANKS", "GRAD_BUSBW_GBPS",
    "NCCL_SCENARIO", "NCCL_CHOICES",
    "BUGGY_LOOP", "BUG_CHOICES",
    "DDP_CHECK", "reference_train_ddp", "make_digits_model", "reference_ddp_run",
    "metric_shards", "reference_global_accuracy",
]


# --- running the student's function in ranks -----------------------------------------------------------


def grading_ranks(backend: str | None = None, nprocs: int | None = None) -> tuple[str, int]:
    """(backend, ranks) the rank exercises run on: the lab's own (``distributed.plan.lab_plan``), NCCL on every
    GPU where there are two or more, else 2 gloo processes on the CPU (one GPU included); a ``backend`` or
    ``nprocs`` given is kept."""
    if backend is None or nprocs is None:
        plan = lab_plan(torch_gpu_count())
        backend, nprocs = backend or plan.backend, nprocs or plan.nprocs
    return backend, nprocs


def _no_distributed() -> str | None:
    return None if dist.is_available() else "this torch build has no torch.distributed: no ranks can run here"


def _exception_line(text: str, limit: int = 220) -> str:
    """The last line of a formatted traceback ("ValueError: ..."), shortened."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    last = lines[-1].strip() if lines else "an error"
    return last if len(last) <= limit else last[: limit - 3] + "..."


def _worker_frames(stack: str) -> list[Any]:
    """The frames of the thread that runs the launcher's ``_worker``, innermost first (none if not found)."""
    for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", stack):
        frames = ranks_mod.stack_frames(block)
        if frames and any(f.function == "_worker" for f in frames):
            return frames
    return []


def _rank_failure(call: str, err: WorkerError | WorkerTimeout, shipped: ranks_mod.Shipped,
                  timeout_s: float) -> Wrong:
    """The student's code failed in a rank: what it raised (or where each rank was stuck), at the student's line."""
    if isinstance(err, WorkerError):
        text = err.remote_traceback
        if "Traceback (most recent call last)" not in text:  # the process died: no Python traceback
            return Wrong(f"{call}: rank {err.rank}'s {text}")
        at = student_frame(text)
        return Wrong(f"{call} raised on rank {err.rank}: {_exception_line(text)}" + (f" (at {at})" if at else ""))
    if _in_teardown(err):
        return Wrong(f"{call}: every rank finished its work, then rank {', '.join(map(str, sorted(err.stacks)))} "
                     "hung inside torch's dist.destroy_process_group() (a gloo teardown that waits for a peer "
                     "already gone; seen twice in a row here). Your code is not the cause: run the check again.")
    where = []
    for rank, stack in sorted(err.stacks.items()):
        mine = [f for f in ranks_mod.stack_frames(stack) if f.filename in shipped.files]
        # where the rank's main thread was: the innermost frame of the thread that runs the launcher's ``_worker``
        # (``torch/distributed/distributed_c10d.py:2184 in destroy_process_group``)
        at = next((f"{'/'.join(Path(f.filename).parts[-3:])}:{f.lineno} in {f.function}"
                   for f in _worker_frames(stack)[:1]), "")
        if mine:
            f = mine[0]
            line = StudentLine(f.filename, f.lineno, f.function, ranks_mod.code_at(f.filename, f.lineno))
            inner = f" (inside {at})" if at and not at.endswith(f" in {f.function}") else ""
            where.append(f"rank {rank} at {line}{inner}")
        else:
            where.append(f"rank {rank} outside your function (returned, or waiting for the others)"
                         + (f", at {at}" if at else ""))
    stuck = f" ({'; '.join(where)})" if where else ""
    late = str(err).split(";")[0] if err.straggler else f"did not finish within {timeout_s:g} s"
    return Wrong(f"{call}: {late}{stuck}: ranks waiting for each other? Every rank must "
                 "make the same collective calls in the same order: a collective (or a barrier) that only some "
                 "ranks reach, e.g. inside `if rank == 0:`, waits for ever.")


def _in_teardown(err: WorkerError | WorkerTimeout) -> bool:
    """Whether every rank still running was inside torch's destroy_process_group: the work was done."""
    return isinstance(err, WorkerTimeout) and bool(err.stacks) and all(
        any(f.function == "destroy_process_group" for f in _worker_frames(t)[:2]) for t in err.stacks.values())


def _launch(worker: Callable[..., Any], nprocs: int, backend: str, timeout_s: float, kwargs: dict[str, Any],
            **options: Any) -> list[Any]:
    """``launch``, once more when a rank did not follow its peers that had returned (``straggler_s``) or hung in
    torch's destroy_process_group: rare, gloo's teardown (the group's destruction, explicit or when DDP lets it
    go) can wait for a peer already gone. The second failure is raised."""
    try:
        return launch(worker, nprocs, backend=backend, timeout_s=timeout_s, kwargs=kwargs, **options)
    except WorkerTimeout as err:
        if not (err.straggler or _in_teardown(err)):
            raise
    return launch(worker, nprocs, backend=backend, timeout_s=timeout_s, kwargs=kwargs, **options)


def _run_in_ranks(worker: Callable[..., Any], shipped: ranks_mod.Shipped, call: str, nprocs: int, backend: str,
                  timeout_s: float, kwargs: dict[str, Any], **options: Any) -> list[Any]:
    """The worker's results on the ranks (``options`` as ``launch``'s), or the student's failure as ``Wrong``."""
    try:
        return _launch(worker, nprocs, backend, timeout_s, {"student": shipped, **kwargs}, **options)
    except (WorkerError, WorkerTimeout) as err:
        raise _rank_failure(call, err, shipped, timeout_s) from None


@contextlib.contextmanager
def _shipped(fn: Any, var: str) -> Iterator[ranks_mod.Shipped]:
    try:
        with ranks_mod.shipping(fn) as shipped:
            yield shipped
    except ranks_mod.ShipError as err:
        raise Wrong(f"`{var}` cannot be sent to the ranks: {err}") from None


def _plain(value: Any) -> Any:
    """The student's result as plain Python for the trip back from a rank (anything else becomes its repr)."""
    if value is None or isinstance(value, (int, float, str)):  # bool too
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if hasattr(value, "to_dict") and hasattr(value, "columns"):  # a DataFrame
        value = value.to_dict("records")
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    with contextlib.suppress(Exception):
        return float(value)  # numpy scalars
    return {"__repr__": f"{type(value).__name__}: {repr(value)[:80]}"}


def _show(value: Any) -> str:
    return f"a {value['__repr__']}" if isinstance(value, dict) and "__repr__" in value else _short(value, 100)


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", MIB), ("KiB", KIB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


# --- q1: busbw factor per collective ------------------------------------------------------------------

# The collectives as torch.distributed names them; nccl-tests' binaries carry the same names
# (all_reduce_perf, ..., alltoall_perf).
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce")

_ALIASES = {"allreduce": "all_reduce", "reducescatter": "reduce_scatter", "allgather": "all_gather",
            "alltoall": "all_to_all"}


def reference_busbw_factor(collective: str, n: int) -> float:
    """busbw / algbw for ``collective`` on ``n`` ranks, as nccl-tests defines it.

    all_reduce 2(n-1)/n (a reduce-scatter then an all-gather); reduce_scatter, all_gather and
    all_to_all (n-1)/n (one phase); broadcast and reduce 1. Names as in torch.distributed;
    "allreduce", "all-reduce" and the like are accepted too.
    """
    key = str(collective).strip().lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(COLLECTIVES)}")
    return busbw_factor(key, check_int(n, "n", "reference_busbw_factor", what="the number of ranks"))


# Why each collective has its factor. Each is checked at n = 2, 3, 4 and 8: at n = 2 alone, 2(n-1)/n, 1 and
# log2(n) agree, so a wrong formula would pass there.
_FACTOR_WHY = {
    "all_reduce": "all_reduce moves the data twice: a reduce-scatter, then an all-gather, each sending (n-1)/n of "
                  "the buffer per rank, so 2(n-1)/n",
    "all_gather": "all_gather is one phase: each rank receives the (n-1)/n of the gathered buffer it does not hold",
    "reduce_scatter": "reduce_scatter is one phase: each rank sends out the (n-1)/n of the buffer it does not keep",
    "all_to_all": "all_to_all is one phase: each rank keeps 1/n of its buffer and exchanges the other (n-1)/n",
    "broadcast": "broadcast is pipelined along a chain: every link carries the whole buffer once, so busbw = algbw "
                 "(factor 1) for any n",
    "reduce": "reduce is a broadcast in reverse: every link carries the whole buffer once, factor 1 for any n",
}
# The ranks each collective is checked on, the most telling first (a function wrong everywhere hears about it).
_FACTOR_RANKS = {"all_reduce": (8, 2, 3, 4), "all_gather": (8, 2, 3, 4), "reduce_scatter": (8, 2, 3, 4),
                 "all_to_all": (4, 2, 3, 8), "broadcast": (8, 2, 3, 4), "reduce": (4, 2, 3, 8)}
_FACTOR_NOTES = {
    ("all_reduce", 2): "2(n-1)/n with n = 2 is 1: on two ranks busbw equals algbw",
    ("all_reduce", 1): "with one rank nothing crosses a link: 2(n-1)/n = 0",
    ("all_gather", 1): "with one rank there is nothing to gather: (n-1)/n = 0",
}

# (collective, n, why), the whole table the check runs.
_FACTOR_CASES: list[tuple[str, int, str]] = [
    (c, n, _FACTOR_NOTES.get((c, n), _FACTOR_WHY[c])) for c, ranks in _FACTOR_RANKS.items() for n in ranks
] + [(c, n, why) for (c, n), why in _FACTOR_NOTES.items() if n == 1]


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _grade_busbw_factor(fn: Any) -> None:
    for collective, n, why in _FACTOR_CASES:  # a value that is not a function: CodeExercise refuses it first
        call = f"busbw_factor({collective!r}, {n})"
        expected = reference_busbw_factor(collective, n)
        with amended(lambda m: f"{m}. The collectives are {', '.join(COLLECTIVES)}."):
            result = run_student(fn, collective, n, call=call, timeout_s=10)
        if result is None or isinstance(result, str):
            raise Wrong(f"{call} returned {result!r}; return the factor as a number")
        got = number(result, f"{call}'s result")
        if _same(got, expected):
            continue
        head = f"{call} returned {got:g}, expected {expected:g}"
        one_phase, two_phase = (n - 1) / n, 2 * (n - 1) / n
        if collective == "all_reduce" and n > 1 and _same(got, one_phase):
            raise Wrong(f"{head}: that is (n-1)/n, one phase. {why}.")
        if collective in ("reduce_scatter", "all_gather", "all_to_all") and n > 1 and _same(got, two_phase):
            raise Wrong(f"{head}: only all_reduce has the 2 (two phases). {why}.")
        if n > 1 and got in (n - 1, 2 * (n - 1)):
            raise Wrong(f"{head}: the /n is missing; the factor is a fraction of the buffer. {why}.")
        if n > 2 and _same(got, math.log2(n)):
            raise Wrong(f"{head}: that is log2(n), the depth of a tree, not a share of the buffer per link. {why}.")
        if collective in ("broadcast", "reduce") and n > 2 and _same(got, two_phase):
            raise Wrong(f"{head}: 2(n-1)/n is all_reduce's factor (it equals 1 only at n = 2). {why}.")
        if got.is_integer() and got == math.floor(expected) and not expected.is_integer():
            raise Wrong(f"{head}: a whole number where a fraction is due looks like integer division "
                        f"((n - 1) // n is 0 in Python; use /). {why}.")
        raise Wrong(f"{head}: {why}.")


q1 = CodeExercise(
    name="02.1 busbw factor per collective", var="busbw_factor", grade=_grade_busbw_factor,
    references=References("write each collective's factor yourself",
                           reference_busbw_factor, "lab_utils.distributed.bandwidth.busbw_factor"),
    signature="busbw_factor(collective, n) -> float",
    hints=[
        "busbw = algbw × factor: the factor turns 'bytes of the buffer per second' into 'bytes over the "
        "busiest link per second', so busbw can be held against the link speed for any n.",
        "In a ring of n ranks, a one-phase collective (reduce_scatter, all_gather, all_to_all) sends "
        "(n-1)/n of the buffer through each link; all_reduce is two such phases; broadcast and reduce "
        "pass the whole buffer along a chain once.",
        "all_reduce -> 2*(n-1)/n; reduce_scatter, all_gather, all_to_all -> (n-1)/n; broadcast, reduce -> "
        "1.0. Use /, not //.",
    ],
    solution_text=(
        "def busbw_factor(collective: str, n: int) -> float:\n"
        '    """busbw / algbw for a collective on n ranks (nccl-tests definitions)."""\n'
        '    if collective == "all_reduce":\n'
        "        return 2 * (n - 1) / n       # reduce-scatter, then all-gather\n"
        '    if collective in ("reduce_scatter", "all_gather", "all_to_all"):\n'
        "        return (n - 1) / n           # one phase\n"
        '    if collective in ("broadcast", "reduce"):\n'
        "        return 1.0                   # the whole buffer crosses each link once\n"
        '    raise ValueError(f"unknown collective {collective!r}")'
    ),
)

# --- q2: the all-reduce benchmark worker -----------------------------------------------------------------------

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
            rows = _plain(fn(ctx, list(sizes), iters, warmup))
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
        raise Wrong(f"{call} returned {_show(value)}{hint}; expected a list of dicts, one per size, with keys "
                    f"{', '.join(_ROW_KEYS)}")
    if len(value) != len(sizes):
        raise Wrong(f"{call} returned {len(value)} rows for {len(sizes)} sizes; one row per size in sizes_bytes")
    rows = []
    for i, row in enumerate(value):
        if not isinstance(row, dict) or "__repr__" in row:
            raise Wrong(f"{call}: row {i} is {_show(row)}, not a dict with keys {', '.join(_ROW_KEYS)}")
        missing = [k for k in _ROW_KEYS if k not in row]
        if missing:
            raise Wrong(f"{call}: row {i} has no {', '.join(missing)} (keys needed: {', '.join(_ROW_KEYS)}; "
                        f"it has {', '.join(row) or 'none'})")
        clean = {}
        for k in _ROW_KEYS:
            v = row[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise Wrong(f"{call}: row {i}'s {k} is {_show(v)}; expected a finite number")
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
        label = _fmt_bytes(size)
        n = made.get(size, 0)
        if n == 0:
            if made.get(4 * size):
                raise Wrong(f"{call}: the {label} case all-reduced a buffer of {_fmt_bytes(4 * size)}: "
                            "torch.ones(size) makes `size` fp32 elements of 4 bytes each; use size // 4 elements")
            if made.get(size // 4):
                raise Wrong(f"{call}: the {label} case all-reduced only {_fmt_bytes(size // 4)}: size is in bytes and "
                            "an fp32 element is 4 bytes, so the buffer needs size // 4 elements, not size // 16")
            if made.get(8 * size) or made.get(size // 8):
                raise Wrong(f"{call}: the {label} case all-reduced {_fmt_bytes(made.most_common(1)[0][0])}: "
                            "bits and bytes mixed up; size is in bytes")
            seen = ", ".join(_fmt_bytes(b) for b in sorted(made))
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
        raise per_call_wrong(f"{call}: at {_fmt_bytes(size)}", mine, ref_ms, iters, warmup,
                             tries=f" ({rounds} tries)" if rounds > 1 else "", gpu_fix=gpu_fix,
                             one_call="one all_reduce")
    return out


def _judge_formulas(rows: list[dict[str, float]], n: int, call: str, where: str) -> None:
    factor = 2 * (n - 1) / n
    for row in rows:
        size, ms = row["size_bytes"], row["time_ms"]
        label = _fmt_bytes(int(size))
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
    call = (f"allreduce_bench(ctx, sizes_bytes=[{', '.join(_fmt_bytes(s) for s in sizes)}], iters={BENCH_ITERS}, "
            f"warmup={BENCH_WARMUP}) on {nprocs} {backend} ranks")
    with _shipped(fn, "allreduce_bench") as shipped:
        res = _run_in_ranks(_bench_worker, shipped, call, nprocs, backend, BENCH_TIMEOUT_S,
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
            res3 = _run_in_ranks(_bench_worker, shipped, call3, _FORMULA_RANKS, "gloo", BENCH_TIMEOUT_S,
                                 {"sizes": small, "iters": BENCH_ITERS, "warmup": BENCH_WARMUP, "rounds": 1,
                                  "timing": False})
            for rank, r in enumerate(res3):
                _judge_formulas(_rows_of(r["rows"][0], small, call3), _FORMULA_RANKS, call3,
                                "" if rank == 0 else f" (rank {rank})")
            extra = f"; algbw and busbw also checked on {_FORMULA_RANKS} gloo ranks"
    shown = ", ".join(f"{_fmt_bytes(s)} {mine:.3g} ms (reference {ref:.3g} ms)"
                      for s, (mine, ref) in zip(sizes, times, strict=True))
    return f"On {nprocs} {backend} ranks: {shown}; warm-up, units and busbw = algbw × 2(n-1)/n all right{extra}."


q2 = CodeExercise(
    name="02.2 the all-reduce benchmark worker", var="allreduce_bench", grade=_grade_allreduce_bench,
    references=References("time the all_reduce calls and compute the bandwidths yourself",
                           reference_allreduce_bench, "lab_utils.distributed.collectives.bare_allreduce_worker"),
    signature="allreduce_bench(ctx, sizes_bytes, iters, warmup) -> list[dict]", applicable=_no_distributed,
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

# --- q3: all-reduce time for a model's gradients ------------------------------------------------------

GRAD_PARAMS = 350_000_000  # parameters, all with gradients
GRAD_BYTES_PER_PARAM = 2  # bf16 gradients
GRAD_RANKS = 8
GRAD_BUSBW_GBPS = 340.0  # GB/s (1 GB = 1e9 bytes): 338 GB/s measured on 2 H200s linked by NVLink 4

_GRAD_BYTES = GRAD_PARAMS * GRAD_BYTES_PER_PARAM
_GRAD_FACTOR = reference_busbw_factor("all_reduce", GRAD_RANKS)  # 1.75
_GRAD_MS = _GRAD_BYTES * _GRAD_FACTOR / (GRAD_BUSBW_GBPS * 1e9) * 1e3  # 3.603 ms

_GIB = 2**30 / 1e9
# GiB for GB or GB for GiB, one way or the other
_GIB_SLIP = ("GB/s means 1e9 bytes/s here (nccl-tests' convention), not GiB/s (2^30): don't mix GiB and GB in one "
             "formula.")
q3 = Exercise(
    name="02.3 all-reduce time for the gradients", var="allreduce_ms",
    grade=close_to(
        _GRAD_MS, rel=0.02, reveal=False,
        why=f"t = S × 2(n-1)/n / busbw, with S the gradient bytes on one rank, n = {GRAD_RANKS}, busbw in "
            "bytes/s; answer in milliseconds.",
        slips={
            1 / _GRAD_FACTOR: f"the all_reduce factor is missing: busbw = algbw × 2(n-1)/n, so the time is S × "
                            f"{_GRAD_FACTOR:g} / busbw, not S / busbw.",
            0.5: "that factor is (n-1)/n, one phase; all_reduce is two (reduce-scatter, then all-gather): "
                 "2(n-1)/n.",
            2 / _GRAD_FACTOR: f"that is 2·S / busbw: either the gradients counted as fp32 (4 bytes) and no "
                            f"all_reduce factor, or the factor 2 without (n-1)/n. Use S = params × "
                            f"{GRAD_BYTES_PER_PARAM} bytes (bf16) and 2(n-1)/n = {_GRAD_FACTOR:g}.",
            2.0: f"twice the time: the gradients are bf16, {GRAD_BYTES_PER_PARAM} bytes each, not fp32 (4).",
            1e-3: "that looks like seconds; answer in milliseconds (× 1000).",
            1e3: "that looks like microseconds; answer in milliseconds (÷ 1000).",
            GRAD_RANKS: "the /n is missing from 2(n-1)/n: the factor is a fraction of the buffer per link.",
            1 / _GRAD_FACTOR**2: "you divided by the factor: busbw = algbw × factor, so algbw = busbw / factor "
                               "and t = S / algbw = S × factor / busbw.",
            1 / _GIB: _GIB_SLIP,
            _GIB: _GIB_SLIP,
        },
    ),
    hints=[
        "algbw = S / t and busbw = algbw × factor, so t = S × factor / busbw, with S the bytes of the "
        "gradient buffer on one rank.",
        f"S = GRAD_PARAMS × GRAD_BYTES_PER_PARAM bytes (bf16 is 2); the all_reduce factor for n = {GRAD_RANKS} is "
        f"2·{GRAD_RANKS - 1}/{GRAD_RANKS}; GB/s means 1e9 bytes/s.",
        "S times the factor, over busbw in bytes/s (GRAD_BUSBW_GBPS GB/s), is seconds; the answer is in ms.",
    ],
    solution_text=(
        "S = GRAD_PARAMS * GRAD_BYTES_PER_PARAM                   # 7.0e8 bytes of bf16 gradients\n"
        "factor = 2 * (GRAD_RANKS - 1) / GRAD_RANKS               # 1.75: reduce-scatter + all-gather\n"
        "allreduce_ms = S * factor / (GRAD_BUSBW_GBPS * 1e9) * 1e3   # ~3.60 ms per step, if not overlapped"
    ),
)

# --- q4: the NCCL variable for a scenario -------------------------------------------------------------

# NCCL's own choice skips docker* and lo interfaces, then takes the first other one it finds; here that
# is the management network, which the two nodes cannot reach each other over.
NCCL_SCENARIO = (
    "Two nodes, one GPU process per GPU, no InfiniBand. Each node has the interfaces lo, docker0, eth0 (a "
    "1 GbE management network; a firewall between the nodes blocks it) and eth1 (the 100 GbE data network "
    "the nodes reach each other over). init_process_group('nccl') hangs; NCCL_DEBUG=INFO shows "
    "'NET/Socket : Using [0]eth0:...'. Which variable makes NCCL use eth1?"
)

NCCL_CHOICES = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_ALGO", "NCCL_PROTO", "NCCL_DEBUG",
              "NCCL_P2P_DISABLE")

_NCCL_WHY_NOT = {
    "NCCL_IB_HCA": "NCCL_IB_HCA picks which InfiniBand/RoCE adapters and ports NCCL uses (e.g. mlx5_0:1). "
                   "These nodes have none; the hang is about the socket interface NCCL bootstraps over.",
    "NCCL_ALGO": "NCCL_ALGO chooses the collective algorithm (Ring, Tree, NVLS, ...). The hang is at init, "
                 "before any collective runs, while the ranks try to reach each other.",
    "NCCL_PROTO": "NCCL_PROTO chooses the wire protocol of collectives (LL, LL128, Simple). The hang is at "
                  "init, before any collective runs, while the ranks try to reach each other.",
    "NCCL_DEBUG": "NCCL_DEBUG=INFO is how you found the problem: it logs what NCCL picked. It changes "
                  "nothing; another variable tells NCCL which interface to use.",
    "NCCL_P2P_DISABLE": "NCCL_P2P_DISABLE turns off direct GPU-to-GPU transfers (NVLink, PCIe) inside a "
                        "node. It has no say over the network interface between nodes.",
}

_NCCL_ANSWER = re.compile(r"""^(?:export\s+)?(NCCL_[A-Z0-9_]+)\s*(?:=\s*(['"]?)([^'"\s]*)\2)?$""", re.IGNORECASE)


def _grade_nccl_var(value: Any) -> None:
    if not isinstance(value, str):
        raise Wrong(f"answer with one of {list(NCCL_CHOICES)}, as a string (a value may follow: 'NAME=value')")
    match = _NCCL_ANSWER.match(value.strip())
    if not match or match[1].upper() not in NCCL_CHOICES:
        raise Wrong(f"answer with one of {list(NCCL_CHOICES)}, optionally with a value: 'NAME=value'")
    name = match[1].upper()
    if name != "NCCL_SOCKET_IFNAME":
        raise Wrong(_NCCL_WHY_NOT[name])
    setting = match[3] or ""
    if setting in ("", "=eth1"):
        return
    picked = _socket_ifname_matches(setting)
    if picked == ["eth1"]:
        return
    exclude = setting.startswith("^")
    if "eth1" not in picked:
        if exclude:
            raise Wrong(f"NCCL_SOCKET_IFNAME is right, but '{setting}' excludes eth1 ('^' means all but these), "
                        "the network the nodes reach each other over. Name it: NCCL_SOCKET_IFNAME=eth1.")
        if setting.lstrip("=") in ("eth0", "docker0", "lo"):
            raise Wrong(f"NCCL_SOCKET_IFNAME is right, but {setting.lstrip('=')} is not the network the nodes "
                        "reach each other over: that is eth1.")
        raise Wrong(f"NCCL_SOCKET_IFNAME is right, but no interface '{setting}' is in the scenario; the data "
                    "network is eth1.")
    others = ", ".join(i for i in picked if i != "eth1")
    if exclude:
        raise Wrong(f"NCCL_SOCKET_IFNAME is right, but '{setting}' still allows {others}: '^' excludes only the "
                    "prefixes listed, and a list you give replaces NCCL's default one, so docker0 and lo are no "
                    f"longer skipped unless you list them. NCCL takes the first allowed interface ({picked[0]}). "
                    "Exclude every other interface, or name the one to use: NCCL_SOCKET_IFNAME=eth1.")
    if "eth1".startswith(setting.split(",")[0]) and "," not in setting:
        raise Wrong(f"NCCL_SOCKET_IFNAME is right, but '{setting}' is a prefix: it matches eth0 too, which "
                    "NCCL finds first. Name the interface: eth1 (or '=eth1', an exact match).")
    raise Wrong(f"NCCL_SOCKET_IFNAME is right, but '{setting}' also allows {others}, which NCCL may pick. Name "
                "only the interface to use: eth1.")


# The scenario's interfaces in the order the system lists them (NCCL takes the first one its list allows).
_INTERFACES = ("lo", "docker0", "eth0", "eth1")


def _socket_ifname_matches(setting: str) -> list[str]:
    """The scenario's interfaces that NCCL_SOCKET_IFNAME=``setting`` allows, in order: comma-separated prefixes,
    '=' for an exact name, a leading '^' for "all but these" (NCCL's own rules)."""
    exclude = setting.startswith("^")
    text = setting[1:] if exclude else setting
    exact = text.startswith("=")
    names = [n.strip() for n in (text[1:] if exact else text).split(",") if n.strip()]
    return [i for i in _INTERFACES if any(i == n if exact else i.startswith(n) for n in names) != exclude]


q4 = Exercise(
    name="02.4 NCCL variable for a hang at init", var="nccl_env_var", grade=_grade_nccl_var,
    hints=[
        "The hang is at init, before any collective: the ranks cannot reach each other. Algorithms and "
        "protocols do not run yet.",
        "NCCL_DEBUG=INFO shows which network interface NCCL chose for its sockets; the variable you need "
        "overrides that choice.",
        "NCCL_SOCKET_IFNAME takes interface names or prefixes ('^' excludes, '=' means an exact name).",
    ],
    solution_text=(
        'nccl_env_var = "NCCL_SOCKET_IFNAME=eth1"\n'
        "# Set on every node before init (export NCCL_SOCKET_IFNAME=eth1, or in the launcher's env).\n"
        "# The gloo backend's twin is GLOO_SOCKET_IFNAME."
    ),
)
# --- q5: the one bug in a DDP loop --------------------------------------------------------------------

BUGGY_LOOP = '''\
import os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

def train(model, dataset, epochs):
    dist.init_process_group("nccl")              # torchrun sets RANK, WORLD_SIZE, LOCAL_RANK
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    model = DDP(model.cuda(rank), device_ids=[rank])
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=64, sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = torch.nn.CrossEntropyLoss()
    for epoch in range(epochs):
        model.train()
        total = torch.zeros(2, device=rank)      # [sum of losses, samples] on this rank
        for x, y in loader:
            x, y = x.cuda(rank), y.cuda(rank)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()                      # DDP all-reduces the gradients here
            opt.step()
            total[0] += loss.detach() * len(y)
            total[1] += len(y)
        dist.all_reduce(total)                   # sums over ranks
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: mean loss {(total[0] / total[1]).item():.4f}")
    dist.destroy_process_group()
'''

BUG_CHOICES = ("set_epoch", "no_sync", "all_reduce the metric", "barrier", "zero_grad")

# Whole answers that name a choice by its call (a choice, never a word found inside a sentence: "set_epoch is
# fine" must not count as set_epoch).
_BUG_SYNONYMS = {
    "set_epoch": ["sampler.set_epoch(epoch)", "sampler.set_epoch", "set_epoch(epoch)", "set_epoch()"],
    "no_sync": ["model.no_sync()", "no_sync()"],
    "all_reduce the metric": ["all_reduce", "allreduce", "dist.all_reduce(total)", "all_reduce(total)"],
    "barrier": ["dist.barrier()", "barrier()"],
    "zero_grad": ["opt.zero_grad()", "zero_grad()", "opt.zero_grad(set_to_none=True)"],
}

_BUG_WHY_NOT = {
    "no_sync": "model.no_sync() skips the gradient all-reduce, for the micro-batches of gradient "
               "accumulation. This loop steps after every batch, so every backward must synchronize; with "
               "no_sync the replicas would drift apart.",
    "all_reduce the metric": "the metric is already reduced: dist.all_reduce(total) sums the losses and "
                             "the sample counts over the ranks before rank 0 prints their ratio.",
    "barrier": "no barrier is needed: the gradient all-reduce inside every backward() already keeps the "
               "ranks in step. A barrier is for, e.g., rank 0 writing a file the others then read.",
    "zero_grad": "opt.zero_grad(set_to_none=True) is there, at the top of every step.",
}


def _grade_missing_fix(value: Any) -> None:
    picked = choice(value, BUG_CHOICES, _BUG_SYNONYMS)
    if picked is None:
        several = isinstance(value, str) and sum(c.split()[0] in value for c in BUG_CHOICES) > 1
        why = "name one fix, not several: the loop has exactly one bug. " if several else ""
        raise Wrong(f"{why}Answer with exactly one of {list(BUG_CHOICES)}: the choice itself, not a sentence")
    if picked != "set_epoch":
        raise Wrong(_BUG_WHY_NOT[picked])


q5 = Exercise(
    name="02.5 the bug in a DDP loop", var="missing_fix", grade=_grade_missing_fix,
    hints=[
        "Each of BUG_CHOICES is a real DDP pitfall, but this loop has exactly one. Read it for what should "
        "change from one epoch to the next.",
        "DistributedSampler shuffles with a generator seeded by seed + epoch, and its epoch is whatever it "
        "was last told (0 unless told otherwise).",
        "Without a call at the start of each epoch, every epoch replays the epoch-0 permutation: each rank "
        "sees the same shard in the same order every epoch. Which choice tells the sampler the epoch? Answer with "
        "that element of BUG_CHOICES, as it is written there.",
    ],
    solution_text=(
        'missing_fix = "set_epoch"   # one of BUG_CHOICES\n'
        "# In train(), first thing in each epoch:\n"
        "#     for epoch in range(epochs):\n"
        "#         sampler.set_epoch(epoch)   # a new shuffle each epoch, the same one on every rank\n"
        "# Without it, DistributedSampler reuses the epoch-0 order, so each rank sees the same shard,\n"
        "# in the same order, every epoch."
    ),
)

# --- q6: DDP training, setup and step ----------------------------------------------------------------------------

# What the check trains: the digits CNN at width 16 (FP16 convolutions are slow on CPUs), a global batch of 64,
# two epochs (the least that shows whether the order changes), SGD with momentum 0.9.
DDP_CHECK = {"epochs": 2, "global_batch": 64, "lr": 0.05, "width": 16, "seed": 0}
CLIP_NORM = 5.0  # max_norm for clip_grad_norm_: loose enough to leave two epochs' learning alone (1.0 costs 6 points)
DDP_TIMEOUT_S = 180.0  # counted once every rank is ready: the check trains in 10-40 s on a loaded 2-core machine
# once one rank has returned, how long the others may take to follow: they trained in step, so only the end (the
# checkpoint after the barrier, the teardown) is left, seconds even on a loaded machine
DDP_STRAGGLER_S = 30.0
ACCURACY_POINTS = 1.0  # how far below the reference's test accuracy the student's may be, in percentage points
_COVERAGE = 0.9  # an epoch's shards together must cover this share of the training set (drop_last may drop some)


def make_digits_model(width: int = DDP_CHECK["width"], seed: int = DDP_CHECK["seed"]) -> DigitsCNN:
    """The digits CNN with the same initial weights everywhere (seeded without touching the global generator)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DigitsCNN(width)


def reference_train_ddp(train_set: Dataset, make_model: Callable[[], torch.nn.Module], epochs: int,
                        batch_size: int, lr: float, checkpoint_path: str) -> None:
    """One rank of a DDP job, started as torchrun starts it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
    MASTER_PORT set): FP16 autocast with a GradScaler, gradients clipped to norm 5 after unscaling, SGD with
    momentum 0.9; rank 0 writes the model's state dict to ``checkpoint_path``. ``batch_size`` is per rank."""
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    model = make_model().to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)  # this rank's 1/world_size of the samples
    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type)  # FP16 gradients underflow to zero without loss scaling
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            with torch.autocast(device.type, dtype=torch.float16):
                loss = F.cross_entropy(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()  # DDP all-reduces the (scaled) gradients during backward
            scaler.unscale_(opt)  # the true gradients, before they are clipped
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=5.0)
            scaler.step(opt)  # skipped when the gradients overflowed
            scaler.update()
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), checkpoint_path)  # one writer: the ranks hold the same weights
    dist.barrier()  # nobody leaves before the checkpoint is complete
    dist.destroy_process_group()


class _RecordingDigits(Dataset):
    """The digits training set; remembers the index of every sample it hands out, in order (rank side)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y  # (n, 1, 8, 8) float32, (n,) int64
        self.fetched: list[int] = []

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def _note(self, indices: list[int]) -> None:
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError("the check's dataset records which samples each rank reads, which it cannot do in "
                               "DataLoader worker processes: use num_workers=0 (the default; the digits are in "
                               "memory already)")
        self.fetched.extend(indices)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._note([int(i)])
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self._note([int(i) for i in indices])
        return [(self.x[i], self.y[i]) for i in indices]


class _TrainingProbe:
    """Watches torch.save, clip_grad_norm_ and the GradScaler while the student's function runs (rank side)."""

    def __init__(self) -> None:
        self.saves: list[str] = []
        self.clips = self.clips_scaled = self.scales = self.scales_disabled = self.unscales = 0
        self.norms: list[float] = []
        self.max_norms: set[float] = set()
        self._pending = False  # scale() was called and unscale_() not yet

    @contextlib.contextmanager
    def patched(self) -> Iterator[_TrainingProbe]:
        import torch.nn.utils.clip_grad as clip_mod
        import torch.serialization as ser
        from torch.amp.grad_scaler import GradScaler

        save, clip = torch.save, clip_mod.clip_grad_norm_
        scale, unscale = GradScaler.scale, GradScaler.unscale_

        def p_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            self.saves.append(os.fspath(f) if isinstance(f, (str, os.PathLike)) else repr(f))
            return save(obj, f, *args, **kwargs)

        def p_clip(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> torch.Tensor:
            self.clips += 1
            self.clips_scaled += self._pending
            self.max_norms.add(float(max_norm))
            total = clip(parameters, max_norm, *args, **kwargs)
            if len(self.norms) < 8:
                self.norms.append(float(total))
            return total

        def p_scale(scaler: GradScaler, outputs: Any) -> Any:
            if scaler.is_enabled():
                self.scales += 1
                self._pending = True
            else:
                self.scales_disabled += 1
            return scale(scaler, outputs)

        def p_unscale(scaler: GradScaler, optimizer: Any) -> Any:
            self.unscales += 1
            self._pending = False
            return unscale(scaler, optimizer)

        with patched((torch, "save", p_save), (ser, "save", p_save), (torch.nn.utils, "clip_grad_norm_", p_clip),
                     (clip_mod, "clip_grad_norm_", p_clip), (GradScaler, "scale", p_scale),
                     (GradScaler, "unscale_", p_unscale)):
            yield self


def _ddp_worker(ctx: WorkerContext, student: ranks_mod.Shipped, cfg: dict[str, Any], folder: str) -> dict[str, Any]:
    """Rank side of q6: run one train_ddp function in this rank and return what it did (the student's, or the
    reference's in a launch of its own: two trainings in one rank, one group after the other, hung a gloo rank in
    destroy_process_group while its peer waited in the next group's set-up)."""
    if not ctx.device.startswith("cuda"):
        torch.set_num_threads(1)  # the ranks share the cores; a small CNN gains nothing from more threads
    ctx.status("train_ddp")
    data = digits_arrays()
    train_set = _RecordingDigits(torch.from_numpy(data["x_train"]), torch.from_numpy(data["y_train"]))
    models: list[DigitsCNN] = []
    forwards: list[tuple[bool, str]] = []

    def note_forward(module: torch.nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled() and len(forwards) < 1000:
            kind = next(module.parameters()).device.type
            dtype = str(torch.get_autocast_dtype(kind)).removeprefix("torch.")
            forwards.append((torch.is_autocast_enabled(kind), dtype))

    def make_model() -> DigitsCNN:
        model = make_digits_model(cfg["width"], cfg["seed"])
        model.register_forward_pre_hook(note_forward)
        models.append(model)
        return model

    probe = _TrainingProbe()
    with probe.patched():
        fn = student.load()
        fn(train_set, make_model, cfg["epochs"], cfg["batch_size"], cfg["lr"], os.path.join(folder, "student.pt"))
    left = dist.is_initialized()
    if left:
        dist.destroy_process_group()
    # numpy, not tensors: a tensor crosses the process boundary as shared memory that dies with this rank
    state = {k: v.detach().float().cpu().numpy().copy() for k, v in models[-1].state_dict().items()} if models else None
    watched = {k: v for k, v in vars(probe).items() if not k.startswith("_")}  # saves, clips, norms, scales, ...
    obs = {"rank": ctx.rank, "fetched": train_set.fetched, "n_train": len(train_set), "models": len(models),
           "forwards": len(forwards), "autocast": sorted(set(forwards)), **watched,
           "max_norms": sorted(probe.max_norms), "left_group": left, "state": state}
    models.clear()
    del train_set, fn
    gc.collect()  # DDP's hooks hold the group in reference cycles: gone before the next group starts
    return obs


def _tensors(state: dict[str, Any] | None) -> dict[str, torch.Tensor] | None:
    return None if state is None else {k: torch.as_tensor(v) for k, v in state.items()}


_REFERENCE_RUNS: dict[tuple[Any, ...], dict[str, Any]] = {}


def _evaluate(state: dict[str, torch.Tensor], width: int) -> float:
    model = DigitsCNN(width)
    model.load_state_dict(state)
    return evaluate(model, "cpu")


def _checkpoint_state(path: str, width: int) -> dict[str, torch.Tensor] | str:
    """The model state dict in a checkpoint file (a plain state dict, or one under 'model'/'state_dict'; a
    DDP 'module.' prefix is accepted), or what is wrong with the file."""
    if not os.path.isfile(path):
        return "no file at checkpoint_path"
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        return f"torch.load could not read it ({type(err).__name__}: {_exception_line(str(err), 120)})"
    if isinstance(obj, dict):  # the state dict under the first of these keys that holds one
        obj = next((obj[k] for k in ("model", "model_state_dict", "state_dict") if isinstance(obj.get(k), dict)), obj)
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        return f"it holds {type(obj).__name__}, not a model state dict (save model.state_dict())"
    state = {k.removeprefix("module."): v for k, v in obj.items()}
    try:
        DigitsCNN(width).load_state_dict(state)
    except RuntimeError as err:
        return f"its keys do not fit the model ({_exception_line(str(err), 160)})"
    return state


def _judge_ddp(obs: list[dict[str, Any]], ref_acc: float, ckpt: str, cfg: dict[str, Any], call: str,
               backend: str) -> str:
    obs = [{**o, "state": _tensors(o["state"])} for o in obs]
    n, epochs = len(obs), cfg["epochs"]
    total = obs[0]["n_train"]
    if any(o["models"] == 0 for o in obs):
        raise Wrong(f"{call} never called make_model(): build the model with it, so every rank starts from the "
                    "weights the check knows")
    if any(o["forwards"] == 0 for o in obs):
        raise Wrong(f"{call}: the model make_model() returned never ran a training forward pass")
    # Data: disjoint shards, covering the set, in a new order every epoch.
    shards = []
    for o in obs:
        got = o["fetched"]
        if not got:
            raise Wrong(f"{call}: rank {o['rank']} read no sample from train_set: iterate over a DataLoader of it")
        if len(got) % epochs:
            raise Wrong(f"{call}: rank {o['rank']} read {len(got)} samples in {epochs} epochs, not the same number "
                        "each epoch: one pass over its shard per epoch")
        per = len(got) // epochs
        shards.append([got[e * per:(e + 1) * per] for e in range(epochs)])
    first = [set(s[0]) for s in shards]
    for r in range(1, n):
        common = first[0] & first[r]
        if common:
            if len(first[r]) > 0.9 * total and len(first[0]) > 0.9 * total:
                raise Wrong(f"{call}: rank {r} trained on the same {len(first[r])} samples as rank 0 in epoch 1: no "
                            "DistributedSampler. Each rank must read its own 1/world_size of the data: "
                            "DataLoader(train_set, batch_size=..., sampler=DistributedSampler(train_set))")
            raise Wrong(f"{call}: ranks 0 and {r} both read {len(common)} of the same samples in epoch 1: the "
                        "shards overlap. DistributedSampler(train_set) takes the rank and the world size from the "
                        "process group; pass it to the DataLoader as sampler=")
    covered = len(set().union(*first))
    if covered < _COVERAGE * total:
        raise Wrong(f"{call}: in epoch 1 the {n} ranks together read {covered} of the {total} training samples: "
                    "the shards should cover the data set (DistributedSampler gives each rank 1/world_size)")
    if epochs > 1 and all(s[0] == s[1] for s in shards):
        raise Wrong(f"{call}: every rank read its samples in the same order in epoch 1 and epoch 2: "
                    "sampler.set_epoch(epoch) is missing (DistributedSampler shuffles with seed + epoch, and its "
                    "epoch stays 0 unless told), or shuffle=False")
    # One model: the same parameters on every rank.
    for o in obs[1:]:
        diff = max(float((o["state"][k] - obs[0]["state"][k]).abs().max()) for k in obs[0]["state"])
        if diff > 1e-5:
            raise Wrong(f"{call}: after training, rank {o['rank']}'s parameters differ from rank 0's (by up to "
                        f"{diff:.3g}): each rank trained its own model on its own shard. Wrap the model in "
                        "DistributedDataParallel, which averages the gradients over the ranks in backward, and train "
                        "through the wrapper")
    # Precision: FP16 autocast, a GradScaler, unscaled before clipping.
    modes = obs[0]["autocast"]
    if not any(enabled for enabled, _ in modes):
        raise Wrong(f"{call}: the forward pass did not run under autocast: wrap the forward and the loss in "
                    "torch.autocast(device.type, dtype=torch.float16)")
    if not any(enabled and dtype == "float16" for enabled, dtype in modes):
        got = ", ".join(dt for on, dt in modes if on)
        raise Wrong(f"{call}: autocast ran in {got}; this exercise asks for float16 with a GradScaler (bfloat16 "
                    "needs no scaler, which is why it is the usual choice on GPUs that have it)")
    o0 = obs[0]
    if o0["scales"] == 0:
        extra = (" (it was created disabled: torch.cuda.amp.GradScaler() turns itself off without CUDA; use "
                 "torch.amp.GradScaler(device.type))") if o0["scales_disabled"] else ""
        raise Wrong(f"{call}: no GradScaler scaled the loss{extra}. In FP16, small gradients underflow to zero: "
                    "scaler.scale(loss).backward(), then scaler.step(opt) and scaler.update()")
    acc = _evaluate(o0["state"], cfg["width"])
    versus = f"test accuracy {100 * acc:.1f} % against the reference's {100 * ref_acc:.1f} %"
    if o0["clips"] == 0:
        raise Wrong(f"{call}: the gradients were never clipped: torch.nn.utils.clip_grad_norm_(model.parameters(), "
                    f"max_norm={CLIP_NORM:g}) each step, after scaler.unscale_(opt)")
    if o0["clips_scaled"]:
        norms = ", ".join(f"{v:.3g}" for v in o0["norms"][:3])
        raise Wrong(f"{call}: the gradients were clipped while still multiplied by the loss scale (norms {norms}, "
                    f"...): {versus}. The loss is scaled but never unscaled before clipping, so max_norm cut the "
                    "true gradients to about 1/65536 of it. Call scaler.unscale_(opt) before clip_grad_norm_")
    if o0["max_norms"] != [CLIP_NORM]:
        got = ", ".join(f"{v:g}" for v in o0["max_norms"])
        raise Wrong(f"{call}: clip_grad_norm_ was given max_norm={got}; this exercise clips at {CLIP_NORM:g} "
                    f"({versus})")
    if acc < ref_acc - ACCURACY_POINTS / 100:
        raise Wrong(f"{call}: {versus} after {epochs} epochs, more than {ACCURACY_POINTS:g} point below. Use the "
                    "given lr with SGD(momentum=0.9), batch_size per rank, and one optimizer step per batch")
    # One checkpoint, by rank 0, holding the trained weights.
    writers = [o["rank"] for o in obs if o["saves"]]
    if not writers:
        raise Wrong(f"{call}: no checkpoint was written: rank 0 saves model.state_dict() to checkpoint_path")
    if writers != [0]:
        if 0 in writers:
            who = "every rank" if len(writers) == n else "ranks " + ", ".join(map(str, writers))
            raise Wrong(f"{call}: {who} wrote the checkpoint: each rank saving. "
                        "The ranks hold the same weights, so only rank 0 should write (`if dist.get_rank() == 0:`); "
                        "several processes writing one file at once can leave it corrupt, and on a shared file "
                        "system each writes the whole model again")
        raise Wrong(f"{call}: rank {writers[0]} wrote the checkpoint, not rank 0: `if dist.get_rank() == 0:`")
    state = _checkpoint_state(ckpt, cfg["width"])
    if isinstance(state, str):
        raise Wrong(f"{call}: rank 0 saved, but the checkpoint at checkpoint_path is not usable: {state}")
    if any(not torch.equal(state[k].float(), o0["state"][k]) for k in o0["state"]):
        raise Wrong(f"{call}: the checkpoint holds other weights than the trained model: save after the last epoch")
    if any(o["left_group"] for o in obs):
        raise Wrong(f"{call}: the process group was still up when train_ddp returned: end with "
                    "dist.destroy_process_group() (after a dist.barrier(), so no rank leaves before rank 0's "
                    "checkpoint is complete); a group left to interpreter shutdown can abort the process")
    per = len(shards[0][0])
    return (f"On {n} {backend} ranks, {epochs} epochs: disjoint shards of {per} samples, a new order each epoch, "
            f"identical parameters on every rank, FP16 with the GradScaler unscaled before clipping, {versus}, "
            "one checkpoint written by rank 0.")


def _ddp_config(backend: str | None, nprocs: int | None) -> tuple[str, int, dict[str, Any]]:
    """(backend, ranks) as ``grading_ranks``, and the check's settings on that many ranks."""
    backend, nprocs = grading_ranks(backend, nprocs)
    cfg = dict(DDP_CHECK)
    cfg["batch_size"] = max(1, cfg.pop("global_batch") // nprocs)  # per rank (64 // 3 = 21 on 3 GPUs)
    return backend, nprocs, cfg


def _grade_train_ddp(fn: Any, backend: str | None = None, nprocs: int | None = None) -> str:
    backend, nprocs, cfg = _ddp_config(backend, nprocs)
    ref_acc = reference_ddp_run(nprocs, backend)["accuracy"]  # once per process: later checks reuse it
    call = (f"train_ddp(train_set, make_model, epochs={cfg['epochs']}, batch_size={cfg['batch_size']}, "
            f"lr={cfg['lr']}, checkpoint_path) on {nprocs} {backend} ranks")
    with _shipped(fn, "train_ddp") as shipped, temporary_folder("ddp-check") as folder:
        res = _run_in_ranks(_ddp_worker, shipped, call, nprocs, backend, DDP_TIMEOUT_S,
                            {"cfg": cfg, "folder": folder}, group=False, straggler_s=DDP_STRAGGLER_S)
        return _judge_ddp(res, ref_acc, os.path.join(folder, "student.pt"), cfg, call, backend)


def reference_ddp_run(nprocs: int | None = None, backend: str | None = None) -> dict[str, Any]:
    """The reference ``train_ddp`` on the check's ranks and settings: its rank-0 weights and test accuracy.

    Runs it once (the check's own run is reused when the check ran first), so a lab with the exercise left blank
    still gets the number. Returns accuracy (fraction), state (the trained state dict), world_size, backend and
    the configuration.
    """
    backend, nprocs, cfg = _ddp_config(backend, nprocs)
    key = (backend, nprocs, tuple(sorted(cfg.items())), torch.__version__)
    if key not in _REFERENCE_RUNS:
        with ranks_mod.shipping(reference_train_ddp) as shipped, temporary_folder("ddp-ref") as folder:
            res = _launch(_ddp_worker, nprocs, backend, DDP_TIMEOUT_S, {"student": shipped, "cfg": cfg,
                          "folder": folder}, group=False, straggler_s=DDP_STRAGGLER_S)
        state = _tensors(res[0]["state"])
        _REFERENCE_RUNS[key] = {"accuracy": _evaluate(state, cfg["width"]), "state": state}
    return {**_REFERENCE_RUNS[key], "world_size": nprocs, "backend": backend, **cfg}  # accuracy, state


q6 = CodeExercise(
    name="02.6 DDP training: setup and step", var="train_ddp", grade=_grade_train_ddp,
    references=References("write the DDP setup and training step yourself",
                           reference_train_ddp, reference_ddp_run, "lab_utils.distributed.ddp.train_digits"),
    signature="train_ddp(train_set, make_model, epochs, batch_size, lr, checkpoint_path) -> None",
    applicable=_no_distributed,
    hints=[
        "Setup: dist.init_process_group('nccl' if torch.cuda.is_available() else 'gloo'); the device from "
        "LOCAL_RANK (torch.cuda.set_device) or the CPU; the model from make_model, moved there and wrapped in "
        "DistributedDataParallel; a DataLoader with sampler=DistributedSampler(train_set); SGD(lr, momentum=0.9); "
        "torch.amp.GradScaler(device.type).",
        "Each epoch: the sampler's set_epoch first (else every epoch shuffles alike). Each batch: forward and loss "
        "under torch.autocast(device.type, dtype=torch.float16); zero_grad; backward on the scaler's scaled loss; "
        "unscale_ the optimizer BEFORE clip_grad_norm_(..., max_norm=5.0); then the scaler's step and update.",
        "After training only rank 0 saves the state_dict of the wrapped model's weights to checkpoint_path; then "
        "dist.barrier() and destroy_process_group on every rank.",
    ],
    solution_text=source_as(reference_train_ddp,
                            "train_ddp(train_set, make_model, epochs, batch_size, lr, checkpoint_path)"),
)

# --- q7: a metric summed over ranks -----------------------------------------------------------------------------

METRIC_TIMEOUT_S = 180.0


def metric_shards(nprocs: int, seed: int | None = None) -> list[dict[str, Any]]:
    """Rank r's evaluation shard on ``nprocs`` ranks: rank, correct, seen, accuracy (= correct / seen).

    Drawn at random for every check (``seed`` makes them reproducible): shards of different sizes, as shards of
    files are in a real evaluation, with whole counts, so no fixed accuracy can pass.
    """
    rng = random.Random(seed)
    while True:
        rows = []
        for r in range(nprocs):
            seen = rng.randrange(100, 801, 10)
            correct = round(rng.uniform(0.55, 0.97) * seen)
            rows.append({"rank": r, "correct": correct, "seen": seen, "accuracy": correct / seen})
        total = sum(s["correct"] for s in rows) / sum(s["seen"] for s in rows)
        mean = sum(s["accuracy"] for s in rows) / nprocs
        if nprocs < 2 or abs(mean - total) > 0.005:  # the plain mean, the usual mistake, must not pass
            return rows


def reference_global_accuracy(ctx: WorkerContext, correct: int, seen: int) -> float:
    """Accuracy over every rank's samples: the counts summed with one all_reduce, then divided (on every rank)."""
    counts = torch.tensor([correct, seen], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(counts)  # sums over the ranks, result on every rank
    return (counts[0] / counts[1]).item()  # correct / seen over all shards


def _metric_worker(ctx: WorkerContext, student: ranks_mod.Shipped, shards: list[dict[str, Any]]) -> Any:
    fn = student.load()
    mine = shards[ctx.rank]
    return _plain(fn(ctx, mine["correct"], mine["seen"]))


def _judge_metric(values: list[Any], shards: list[dict[str, Any]], call: str) -> str:
    n = len(shards)
    correct, seen = sum(s["correct"] for s in shards), sum(s["seen"] for s in shards)
    total = correct / seen
    accs = [s["accuracy"] for s in shards]
    mean = sum(accs) / n
    for r, v in enumerate(values):
        if v is None:
            raise Wrong(f"{call} returned None on rank {r} (does it end with `return ...`?); expected the accuracy "
                        "as a float on every rank")
        if isinstance(v, str) and v.strip().endswith("%"):  # "85.3%" means 0.853: the same answer
            with contextlib.suppress(Wrong):
                v = fraction(v)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise Wrong(f"{call} returned {_show(v)} on rank {r}; expected the accuracy as a float")
        if math.isclose(v, total, rel_tol=1e-6):
            continue
        own = shards[r]["accuracy"]
        head = f"{call}: rank {r} returned {v:.6g}, not the accuracy over all {n} ranks' samples"
        if math.isclose(v, own, rel_tol=1e-6):
            if any(math.isclose(w, total, rel_tol=1e-6) for w in values if isinstance(w, (int, float))):
                raise Wrong(f"{head}: it is rank {r}'s own accuracy, while another rank has the total. dist.reduce "
                            "leaves the sum on one rank only; dist.all_reduce puts it on every rank")
            raise Wrong(f"{head}: it is rank {r}'s own accuracy ({shards[r]['correct']}/{shards[r]['seen']}): "
                        "nothing was combined over the ranks. dist.all_reduce the counts")
        if math.isclose(v, mean, rel_tol=1e-6):
            raise Wrong(f"{head}: it is the plain mean of the per-rank accuracies. The shards differ in size "
                        f"({', '.join(str(s['seen']) for s in shards)} samples), so each accuracy must count by its "
                        "samples: all_reduce the counts (correct, seen) with SUM, then divide")
        if math.isclose(v, sum(accs), rel_tol=1e-6):
            raise Wrong(f"{head}: it is the sum of the accuracies (an all_reduce, SUM by default, of each rank's "
                        "accuracy). Reduce the counts (correct, seen), then divide")
        if math.isclose(v, 100 * total, rel_tol=1e-6):
            raise Wrong(f"{head}: that is a percentage; return a fraction between 0 and 1")
        if math.isclose(v, correct, rel_tol=1e-6):
            raise Wrong(f"{head}: that is the number of correct predictions; divide it by the samples seen")
        if v == 0 or v == math.floor(total):
            raise Wrong(f"{head}: integer division? correct // seen is 0; divide with / (or in a float tensor)")
        raise Wrong(f"{head}: sum the correct counts and the sample counts over the ranks (one all_reduce of "
                    "a tensor [correct, seen]), then divide")
    return f"Every one of {n} ranks got {total:.5f} = {correct}/{seen}, not the mean of the accuracies ({mean:.5f})."


def _grade_global_accuracy(fn: Any, backend: str | None = None, nprocs: int | None = None) -> str:
    backend, nprocs = grading_ranks(backend, nprocs)
    shards = metric_shards(nprocs)
    call = f"global_accuracy(ctx, correct, seen) on {nprocs} {backend} ranks"
    with _shipped(fn, "global_accuracy") as shipped:
        values = _run_in_ranks(_metric_worker, shipped, call, nprocs, backend, METRIC_TIMEOUT_S, {"shards": shards})
    return _judge_metric(values, shards, call)


q7 = CodeExercise(
    name="02.7 a metric over all ranks", var="global_accuracy", grade=_grade_global_accuracy,
    references=References("all_reduce the counts and divide yourself", reference_global_accuracy),
    signature="global_accuracy(ctx, correct, seen) -> float", applicable=_no_distributed,
    hints=[
        "The accuracy over all samples is all correct predictions over all samples seen, on every rank. The "
        "shards differ in size, so the mean of the ranks' accuracies is not it.",
        "Put both counts in one tensor on ctx.device (float64 is exact for counts), dist.all_reduce it (SUM is "
        "the default), and divide. all_reduce, not reduce: every rank needs the answer.",
        "After the all_reduce the tensor holds the sums over the ranks: its first element over its second, as a "
        "Python float (.item()), is the answer on every rank.",
    ],
    solution_text=source_as(reference_global_accuracy, "global_accuracy(ctx, correct, seen)")
    + "# The mean of the per-rank accuracies weights a rank of 150 samples like one of 500.",
)
