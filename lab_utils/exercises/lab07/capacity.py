"""Lab 07's capacity questions: q4 the capacity search, ``find_capacity(probe, lo_rps, hi_rps, slo_ms, tolerance) ->
float`` (on simulated services, then against the running one), q6 the capacity plan, ``servers_needed(peak_rps,
capacity_rps, headroom, spares) -> int``. Rates are in requests/s, latencies in ms."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from typing import Any

from lab_utils.course.session import quick_mode
from lab_utils.exercises.framework import (
    CodeExercise,
    NotApplicable,
    References,
    Wrong,
    integer,
    number,
    run_student,
    source_as,
)
from lab_utils.exercises.lab07.service import bound_service
from lab_utils.serving import load
from lab_utils.serving.load import LoadResult

SLO_MS = 100.0
Q4_LO_RPS, Q4_HI_RPS, Q4_TOLERANCE = 25.0, 2500.0, 0.3  # the real search's range (req/s) and tolerance
# quick mode's top (CI, 2 cores): a probe far over capacity costs seconds of client CPU and says nothing more
Q4_QUICK_HI_RPS = 800.0


# --- q4: the capacity search --------------------------------------------------------------------------------


def reference_find_capacity(probe: Callable[[float], Any], lo_rps: float, hi_rps: float, slo_ms: float = SLO_MS,
                            tolerance: float = 0.1) -> float:
    """Bisection on the rate: the highest rate whose probe has no error, is stable and has p95 <= the SLO."""
    def ok(rate: float) -> bool:
        r = probe(rate)
        return r.errors == 0 and r.stable and r.p95_ms <= slo_ms

    if not ok(lo_rps):
        return 0.0
    if ok(hi_rps):
        return hi_rps
    while hi_rps - lo_rps > tolerance * hi_rps:
        mid = (lo_rps + hi_rps) / 2
        if ok(mid):
            lo_rps = mid
        else:
            hi_rps = mid
    return lo_rps


class SimulatedService:
    """A service whose latency at a rate is known: p95 reaches the SLO at ``p95_edge_rps``; runs are unstable
    (the queue grows, slowly enough that p95 still looks fine) above ``stable_edge_rps``; fast failures (429s:
    quick, so latency looks low) above ``error_edge_rps``. The capacity is the lowest of the three edges."""

    def __init__(self, seed: int, lo: float, hi: float, trap: str):
        rng = random.Random(seed)
        self.capacity = rng.uniform(lo + 0.3 * (hi - lo), lo + 0.6 * (hi - lo))
        self.p95_edge = self.capacity if trap in ("p95", "none") else self.capacity * 1.4
        self.p50_edge = self.p95_edge * 1.3  # p50 stays under the SLO longer: p50 for p95 overshoots
        self.stable_edge = self.capacity if trap == "stable" else self.capacity * 1.6
        self.error_edge = self.capacity if trap == "errors" else self.capacity * 1.7
        self.calls: list[float] = []

    def probe(self, rate_rps: float) -> Any:
        self.calls.append(float(rate_rps))

        def lat(edge: float) -> float:  # SLO_MS exactly at the edge, growing fast after it
            return SLO_MS * (rate_rps / edge) ** 4

        errors = 0 if rate_rps <= self.error_edge else int(rate_rps * 0.05)
        p95, p50 = lat(self.p95_edge), lat(self.p50_edge)
        return LoadResult(
            mode="open", target="simulated", rate_rps=rate_rps, concurrency=None, offered_rps=rate_rps,
            achieved_rps=rate_rps if rate_rps <= self.stable_edge else 0.8 * rate_rps, throughput_infer_s=rate_rps,
            p50_ms=p50, p90_ms=(p50 + p95) / 2, p95_ms=p95, p99_ms=2 * p95, mean_ms=p50, requests=int(rate_rps * 5),
            errors=errors, timeouts=0, error_messages={"HTTP 429: over the rate limit": errors} if errors else {},
            windows=[], stable=rate_rps <= self.stable_edge, seconds=5.0)


def _grade_capacity(fn: Any) -> str:
    lo, hi, tol = 20.0, 1000.0, 0.05
    for trap in ("none", "p95", "stable", "errors"):
        sim = SimulatedService(random.randrange(10**6), lo, hi, trap)
        got = run_student(fn, sim.probe, lo, hi, SLO_MS, tol, what="find_capacity",
                          call=f"find_capacity(probe, {lo:g}, {hi:g}, {SLO_MS:g}, {tol:g})", timeout_s=30)
        got = number(got, "the capacity (requests per second)")
        calls = len(sim.calls)
        if not sim.calls:
            raise Wrong("it never called probe(rate): the capacity is measured, one open-loop run per rate tried")
        if calls > 15:
            raise Wrong(f"it ran {calls} probes for a range of {lo:g}..{hi:g} req/s at tolerance {tol:g}: bisection "
                        "needs about 7; each probe is a real load test of several seconds")
        c = sim.capacity
        if got > c * (1 + 1e-9):
            r = sim.probe(got)
            sim.calls.pop()
            if r.errors:
                why = (f"that run had errors ({r.errors} fast 429s, which keep the latency low): a rate with failed "
                       "requests does not meet the SLO")
            elif not r.stable:
                why = ("that run was not stable (the server fell behind, a queue built up): a rate the server cannot "
                       "sustain is not within capacity even when its p95 still looks fine")
            elif r.p50_ms <= SLO_MS:
                why = (f"its p95 is {r.p95_ms:.0f} ms, over the SLO; its p50 ({r.p50_ms:.0f} ms) is under it: the SLO "
                       "is on p95")
            else:
                why = f"its p95 is {r.p95_ms:.0f} ms, over the {SLO_MS:g} ms SLO"
            raise Wrong(f"it answered {got:.1f} req/s where the capacity is {c:.1f}: {why}")
        if got < c - 2 * tol * hi:
            raise Wrong(f"it answered {got:.1f} req/s where the capacity is {c:.1f}: too low. Keep halving the "
                        f"range [passing rate, failing rate] until it is narrower than tolerance x the upper rate, "
                        "and return the highest rate that passed")
    try:
        svc = bound_service()
    except NotApplicable as why:
        return f"it found the capacity of four simulated services ({why} The real search is skipped.)"

    target = svc.target("http")
    probes: list[dict[str, Any]] = []
    # (duration, warm-up) of each probe, s. The verdict (the answer is what its own probes say) does not depend on
    # the length: quick mode (CI) runs the shortest probe with three half-second windows.
    probe_s, hi = ((1.5, 0.5), Q4_QUICK_HI_RPS) if quick_mode() else ((3.0, 1.0), Q4_HI_RPS)

    def probe(rate: float) -> Any:
        if len(probes) >= 12:
            raise Wrong("more than 12 probes against the real service: stop when the range is narrower than the "
                        "tolerance")
        r = load.run_open_loop(target, float(rate), probe_s[0], warmup_s=probe_s[1], window_s=probe_s[1],
                               timeout_s=2.0)
        ok = r.errors == 0 and r.stable and r.p95_ms <= SLO_MS
        probes.append({"rate": float(rate), "ok": ok, "p95_ms": r.p95_ms})
        return r

    t0 = time.perf_counter()
    got = float(run_student(fn, probe, Q4_LO_RPS, hi, SLO_MS, Q4_TOLERANCE, what="find_capacity",
                            call=f"find_capacity(probe, {Q4_LO_RPS:g}, {hi:g}, {SLO_MS:g}, {Q4_TOLERANCE:g})",
                            timeout_s=120))
    passed = [p["rate"] for p in probes if p["ok"]]
    failed = [p["rate"] for p in probes if not p["ok"]]
    best = max([r for r in passed if not failed or r < min(failed)], default=0.0)
    if not math.isclose(got, best, rel_tol=1e-6, abs_tol=1e-6):
        raise Wrong(f"against the running service it returned {got:.1f} req/s, but its own probes say "
                    f"{best:.1f} (the highest rate that passed below the lowest that failed): {probes}")
    note = (f" Against the running service through {svc.via}: {got:.0f} req/s after {len(probes)} probes "
            f"({time.perf_counter() - t0:.0f} s).")
    return "it found the capacity of four simulated services (traps: p50, unstable runs, fast errors)." + note


q4 = CodeExercise(
    name="07.4 the capacity search",
    var="find_capacity",
    references=References("write the bisection over the rate yourself",
                          "lab_utils.exercises.lab07.reference_find_capacity"),
    grade=_grade_capacity,
    signature="find_capacity(probe, lo_rps, hi_rps, slo_ms, tolerance) -> float",
    hints=(
        "A rate passes when its run has no error (r.errors == 0), is stable (r.stable) and r.p95_ms <= slo_ms.",
        "Try lo_rps (fails: return 0) and hi_rps (passes: return hi_rps); then while hi - lo > tolerance * hi: "
        "probe the middle; it becomes the new lo if it passed, the new hi if not. Return lo.",
    ),
    solution_text=source_as(reference_find_capacity, "find_capacity"),
)


# --- q6: the capacity plan ----------------------------------------------------------------------------------

def reference_servers_needed(peak_rps: float, capacity_rps: float, headroom: float, spares: int = 1) -> int:
    """Servers for ``peak_rps`` when each may run at ``(1 - headroom)`` of its capacity, plus ``spares``."""
    return math.ceil(peak_rps / (capacity_rps * (1 - headroom))) + spares


_Q6_FIXED = [(1000.0, 180.0, 0.3, 1), (100.0, 350.0, 0.3, 1), (5000.0, 1200.0, 0.25, 2), (720.0, 240.0, 0.0, 0)]


def _grade_plan(fn: Any) -> str:
    rng = random.Random(random.randrange(10**6))
    cases = list(_Q6_FIXED) + [(round(rng.uniform(200, 20000)), round(rng.uniform(50, 2000)),
                                rng.choice([0.2, 0.3, 0.4]), rng.choice([1, 2])) for _ in range(20)]
    got_all = []
    for peak, cap, head, spares in cases:
        call = f"servers_needed({peak:g}, {cap:g}, {head:g}, {spares})"
        got = run_student(fn, peak, cap, head, spares, call=call, timeout_s=10)
        got_all.append(integer(got, f"{call} (a number of servers: math.ceil)"))
    slips = {  # a common mistake's answers on every case -> what it got wrong
        "the headroom is missing: each server may run at only (1 - headroom) x its capacity, so that a burst or a "
        "slow minute stays inside the SLO": lambda p, c, h, s: math.ceil(p / c) + s,
        "peak x (1 + headroom) is not peak / (1 - headroom): a server loaded to 70 % of capacity has 30 % headroom":
            lambda p, c, h, s: math.ceil(p * (1 + h) / c) + s,
        "the spare is missing: with just enough servers, one failing (or being updated) breaks the SLO; add "
        "`spares` on top": lambda p, c, h, s: math.ceil(p / (c * (1 - h))),
        "rounded down: 2.1 servers' worth of load needs 3 servers (math.ceil)":
            lambda p, c, h, s: round(p / (c * (1 - h))) + s,
    }
    want_all = [reference_servers_needed(*case) for case in cases]
    if got_all == want_all:
        return "right on the fixed cases and 20 drawn at random."
    i = next(k for k, (g, w) in enumerate(zip(got_all, want_all, strict=True)) if g != w)
    p, c, h, sp = cases[i]
    call = f"servers_needed({p:g}, {c:g}, {h:g}, {sp}) = {got_all[i]}, expected {want_all[i]}"
    for why, slip in slips.items():
        if got_all == [slip(*case) for case in cases]:
            raise Wrong(f"{call}: {why}")
    raise Wrong(f"{call}: servers = ceil(peak / (capacity x (1 - headroom))) + spares")


q6 = CodeExercise(
    name="07.6 the capacity plan",
    var="servers_needed",
    references=References("work out the number of servers yourself",
                          "lab_utils.exercises.lab07.reference_servers_needed"),
    grade=_grade_plan,
    signature="servers_needed(peak_rps, capacity_rps, headroom, spares) -> int",
    hints=(
        "Each server may be loaded to (1 - headroom) x capacity_rps.",
        "The servers that carry the peak: the peak over what one server may carry, rounded up (math.ceil, never "
        "down); then `spares` on top.",
    ),
    solution_text=source_as(reference_servers_needed, "servers_needed"),
)
