"""Questions asked of the load engine: closed against open loop, the SLO, the capacity by bisection.

Stable API (lab 07 builds on it): ``compare_loops``, ``meets_slo``, ``find_capacity``, ``drain``. Each run is one of
``lab_utils.serving.load``'s, judged by its one stability rule.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pandas as pd

from lab_utils.args import check_int, check_positive
from lab_utils.procs import Background
from lab_utils.serving.load import ERROR_BACKOFF_S, LoadResult, run_closed_loop, run_open_loop
from lab_utils.serving.targets import as_target
from lab_utils.timing import Ticks

# --- closed against open -------------------------------------------------------------------------------------


@dataclass
class LoopComparison:
    """The same server measured closed-loop, then open-loop at ``rate_rps`` (a fraction of the closed loop's
    throughput): ``understatement`` = open p95 / closed p95, how far the closed loop hides the queue."""

    closed: LoadResult
    open: LoadResult
    rate_rps: float
    understatement: float

    def table(self) -> pd.DataFrame:
        cols = ["mode", "concurrency", "rate_rps", "offered_rps", "achieved_rps", "p50_ms", "p95_ms", "p99_ms",
                "errors", "stable"]
        return pd.DataFrame([{c: r.to_row()[c] for c in cols} for r in (self.closed, self.open)])

    def __str__(self) -> str:
        return (f"closed loop (c={self.closed.concurrency}): {self.closed.achieved_rps:.1f} req/s, p95 "
                f"{self.closed.p95_ms:.1f} ms; open loop at {self.rate_rps:.1f} req/s: p95 {self.open.p95_ms:.1f} ms "
                f"({self.understatement:.1f}x the closed loop's)")


def compare_loops(target: Any, *, concurrency: int = 1, rate_rps: float | None = None, rate_fraction: float = 0.9,
                  duration_s: float = 5.0, warmup_s: float = 1.0, window_s: float = 1.0, seed: int | None = 0,
                  timeout_s: float = 10.0, progress: Callable[..., Any] | None = None) -> LoopComparison:
    """Closed loop at ``concurrency``, then open loop at ``rate_rps`` (default: ``rate_fraction`` of the closed
    loop's throughput: the same load, arriving as users do) against the same target. ``progress``: a hook such as
    ``lab_utils.widgets.progress``, advanced once per loop run (None: no display)."""
    if not (isinstance(rate_fraction, (int, float)) and 0 < rate_fraction <= 2):
        raise ValueError(f"compare_loops(rate_fraction={rate_fraction!r}): a fraction of the closed loop's "
                         "throughput, e.g. 0.9")
    kw = {"duration_s": duration_s, "warmup_s": warmup_s, "window_s": window_s, "timeout_s": timeout_s}
    ticks = Ticks(progress, 2, "closed then open loop")
    closed = run_closed_loop(target, concurrency, **kw)  # type: ignore[arg-type]
    rate = rate_rps if rate_rps is not None else rate_fraction * closed.achieved_rps
    if not rate or not math.isfinite(rate):
        raise RuntimeError(f"the closed loop got no answer ({closed.errors} errors: {closed.error_messages}): "
                           "is the server up?")
    ticks.step()
    opened = run_open_loop(target, rate, seed=seed, **kw)  # type: ignore[arg-type]
    ticks.step()
    ticks.close()
    ratio = opened.p95_ms / closed.p95_ms if closed.p95_ms else float("nan")
    return LoopComparison(closed, opened, float(rate), float(ratio))


# --- the SLO and capacity ------------------------------------------------------------------------------------


def meets_slo(result: LoadResult, slo_ms: float, percentile: int = 95) -> tuple[bool, str]:
    """Whether a run holds the SLO: something answered, no request failed (timeouts included), the run is stable
    (``load.is_stable``: the server kept up, no queue building), and the ``percentile`` latency <= ``slo_ms``.
    Returns (passed, why in words)."""
    q = result.percentile(percentile)
    at = f"at {result.rate_rps:g} req/s" if result.rate_rps is not None else ""
    if result.requests == 0:
        return False, f"nothing answered {at} ({result.errors} errors)"
    if result.errors:
        top = next(iter(result.error_messages), "")
        return False, f"{result.errors} requests failed {at} (e.g. {top})"
    if not result.stable:
        first, last = (result.windows[0].p50_ms, result.windows[-1].p50_ms) if result.windows else (math.nan,) * 2
        return False, (f"not stable {at}: answered {result.achieved_rps:.1f} of {result.offered_rps:.1f} req/s "
                       f"offered, median {first:.1f} ms in the first window and {last:.1f} ms in the last")
    if not q <= slo_ms:
        return False, f"p{percentile} {q:.1f} ms > SLO {slo_ms:g} ms {at}"
    return True, f"p{percentile} {q:.1f} ms <= SLO {slo_ms:g} ms {at}, no errors, stable"


@dataclass
class CapacityResult:
    """The highest rate found to meet the SLO (``capacity_rps``; 0 when even ``lo_rps`` fails), every rate tried
    (``steps``), and whether the answer lies inside the range searched (``bounded``: ``hi_rps`` failed)."""

    capacity_rps: float
    slo_ms: float
    percentile: int
    bounded: bool
    steps: list[dict[str, Any]]
    best: LoadResult | None = None

    def table(self) -> pd.DataFrame:
        return pd.DataFrame(self.steps)

    def __str__(self) -> str:
        if not self.capacity_rps:
            return f"no rate tried meets p{self.percentile} <= {self.slo_ms:g} ms: {self.steps[0]['why']}"
        more = "" if self.bounded else " (the highest rate tried: raise hi_rps to find the limit)"
        return (f"capacity {self.capacity_rps:.1f} req/s at p{self.percentile} <= {self.slo_ms:g} ms after "
                f"{len(self.steps)} runs{more}")


def find_capacity(target: Any, slo_ms: float = 100.0, *, lo_rps: float, hi_rps: float, duration_s: float = 5.0,
                  warmup_s: float = 1.0, window_s: float = 1.0, percentile: int = 95, tolerance: float = 0.05,
                  max_steps: int = 10, seed: int | None = 0, timeout_s: float | None = None, stability: float = 0.10,
                  on_step: Callable[[dict[str, Any]], None] | None = None,
                  progress: Callable[..., Any] | None = None, processes: int | None = 1) -> CapacityResult:
    """The highest open-loop rate whose ``percentile`` latency stays under ``slo_ms`` (``meets_slo``), by bisection.

    ``lo_rps`` is tried first (fails: capacity 0), then ``hi_rps`` (passes: capacity ``hi_rps``, unbounded); then the
    middle of the range, halving it until it is narrower than ``tolerance`` × its top, or ``max_steps`` runs.
    ``timeout_s`` defaults to 20 × the SLO (at least 2 s): a request that late has failed the SLO anyway. After a
    failed rate the server's queue is drained (one request at a time until one answers within the SLO) before the
    next run, so a backlog does not count against the next rate. ``progress``: a hook such as
    ``lab_utils.widgets.progress`` (``progress(iterable, total=, desc=)``), advanced once per rate tried (None:
    no display). ``processes``: client processes per probe, as for ``run_open_loop`` (None: by the rate).
    """
    where = "find_capacity"
    slo = check_positive(slo_ms, "slo_ms", where)
    lo = check_positive(lo_rps, "lo_rps", where)
    hi = check_positive(hi_rps, "hi_rps", where)
    if hi <= lo:
        raise ValueError(f"find_capacity(lo_rps={lo_rps!r}, hi_rps={hi_rps!r}): hi_rps must be above lo_rps")
    if percentile not in (50, 90, 95, 99):
        raise ValueError(f"find_capacity(percentile={percentile!r}): use 50, 90, 95 or 99")
    tol = check_positive(tolerance, "tolerance", where)
    steps_max = check_int(max_steps, "max_steps", where, minimum=2)
    timeout = timeout_s if timeout_s is not None else max(2.0, 20 * slo / 1e3)
    target = as_target(target)
    steps: list[dict[str, Any]] = []
    results: dict[float, LoadResult] = {}
    ticks = Ticks(progress, steps_max, "capacity search")  # advanced once per rate tried

    def probe(rate: float) -> bool:
        r = run_open_loop(target, rate, duration_s, warmup_s=warmup_s, window_s=window_s,
                          seed=None if seed is None else seed + len(steps), timeout_s=timeout, stability=stability,
                          processes=processes)
        ok, why = meets_slo(r, slo, percentile)
        step = {"step": len(steps) + 1, "rate_rps": rate, "passed": ok, "achieved_rps": r.achieved_rps,
                "p50_ms": r.p50_ms, "p95_ms": r.p95_ms, "p99_ms": r.p99_ms, "errors": r.errors, "stable": r.stable,
                "why": why}
        steps.append(step)
        results[rate] = r
        if on_step is not None:
            on_step(step)
        if not ok:
            drain(target, slo, limit_s=timeout + 5)
        ticks.step()
        return ok

    try:  # lo_rps, then hi_rps, then the middle of the range, at most max_steps runs in all
        if not probe(lo):
            return CapacityResult(0.0, slo, percentile, True, steps, None)
        if probe(hi):
            return CapacityResult(hi, slo, percentile, False, steps, results[hi])
        while len(steps) < steps_max and hi - lo > tol * hi:
            mid = (lo + hi) / 2
            if probe(mid):
                lo = mid
            else:
                hi = mid
    finally:  # the hook's bar or line ends with the search, however it ends
        ticks.close()
    return CapacityResult(lo, slo, percentile, True, steps, results[lo])


def drain(target: Any, slo_ms: float, limit_s: float = 10.0) -> bool:
    """Send one request at a time until one answers within ``slo_ms`` (the server's queue is empty again), at most
    ``limit_s`` seconds; whether one did."""
    target = as_target(target)

    async def main() -> bool:
        await target.open()
        try:
            end = time.perf_counter() + limit_s
            while time.perf_counter() < end:
                t = time.perf_counter()
                try:
                    await asyncio.wait_for(target.send(), max(0.01, end - t))
                except Exception:  # a failing server: pause, as the closed loop does
                    await asyncio.sleep(ERROR_BACKOFF_S)
                    continue
                if (time.perf_counter() - t) * 1e3 <= slo_ms:
                    return True
            return False
        finally:
            await target.close()

    sender = Background(lambda: asyncio.run(main()), name="nvlab-load-drain")
    sender.thread.join(limit_s + 10)
    return bool(sender.result)


__all__ = ["compare_loops", "meets_slo", "find_capacity", "drain", "LoopComparison", "CapacityResult"]
