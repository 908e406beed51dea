"""Lab 02's arithmetic of collectives: 02.1 each collective's busbw factor (nccl-tests' definitions) and 02.3 the
all-reduce time of a model's gradients. Bandwidths in GB/s (1e9 bytes/s)."""

from __future__ import annotations

import math
from typing import Any

from lab_utils.args import check_int
from lab_utils.distributed.bandwidth import busbw_factor  # the one definition the lab's measurements use
from lab_utils.exercises.framework import (
    CodeExercise,
    Exercise,
    References,
    Wrong,
    amended,
    close_to,
    number,
    run_student,
)

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

