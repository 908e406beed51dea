"""08.3: the canary's decision, on scripted sequences against the reference, then live in ``canary.run_canary``."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping
from typing import Any

from lab_utils.exercises.framework import CodeExercise, References, Wrong, run_student, source_as
from lab_utils.exercises.lab08.common import _prometheus_missing
from lab_utils.exercises.lab08.promql import _bench
from lab_utils.exercises.outcomes import _short
from lab_utils.mlops import canary
from lab_utils.mlops.canary import CanaryState, Decision, Guards, VariantMetrics


def reference_decide(state: Any, metrics: Mapping[str, Any], guards: Any) -> Any:
    """One check of the canary: roll back when a guard trips, hold while evidence is short or the step's healthy
    checks are not all in, promote after ``guards.checks_per_step`` healthy checks in a row."""
    import math
    from dataclasses import replace

    from lab_utils.mlops.canary import Decision  # in the function: its source is the solution shown

    champ, chall = metrics["champion"], metrics["challenger"]

    def nan(x):
        return x is None or math.isnan(x)

    if state.finished:
        return Decision("done", state, f"the canary is {state.status}")

    def rollback(alert, why):
        return Decision("rollback", replace(state, status="rolled_back", healthy=0), why, alert)

    enough = chall.requests >= guards.min_requests and not nan(chall.error_rate)
    if enough:
        limit = guards.max_error_rate  # absolute, and relative to the champion when it has traffic
        if not nan(champ.error_rate):
            limit = min(limit, champ.error_rate + guards.max_error_rate_delta)
        if chall.error_rate > limit:
            return rollback("CanaryErrors", f"error rate {chall.error_rate:.2%} over {limit:.2%}")
        if guards.max_p95_ms is not None and not nan(chall.p95_ms) and chall.p95_ms > guards.max_p95_ms:
            return rollback("CanaryLatency", f"p95 {chall.p95_ms:.1f} ms over the SLO")
        # against the champion: the means over the same window, never below the floor (noise)
        if not nan(chall.mean_ms) and not nan(champ.mean_ms) and champ.mean_ms > 0:
            limit = max(guards.max_latency_ratio * champ.mean_ms, guards.latency_floor_ms)
            if chall.mean_ms > limit:
                return rollback("CanaryLatency", f"mean {chall.mean_ms:.1f} ms over {limit:.1f} ms")
    # accuracy: only on enough labelled answers, and only against a champion that has a measured accuracy
    if chall.feedback >= guards.min_feedback and not nan(chall.accuracy) and not nan(champ.accuracy):
        if chall.accuracy < champ.accuracy - guards.max_accuracy_drop:
            return rollback("CanaryAccuracy", f"accuracy {chall.accuracy:.1%}, champion {champ.accuracy:.1%}")
    if enough and guards.min_feedback > 0 and chall.feedback < guards.min_feedback:  # fast is not right
        idle = state.idle + 1
        if idle >= guards.max_idle_checks:
            return rollback("CanaryNoTraffic", f"{idle} checks without enough labelled answers")
        return Decision("hold", replace(state, idle=idle, healthy=0), "waiting for labelled feedback")
    if not enough:  # too little evidence decides nothing, unless it lasts
        idle = state.idle + 1
        if idle >= guards.max_idle_checks:
            return rollback("CanaryNoTraffic", f"{idle} checks without enough challenger requests")
        return Decision("hold", replace(state, idle=idle, healthy=0), "waiting for challenger requests")
    if nan(chall.mean_ms) or nan(champ.mean_ms):  # no step before the latency comparison
        return Decision("hold", replace(state, idle=0, healthy=0), "waiting for a window at this weight")
    healthy = state.healthy + 1
    if healthy < guards.checks_per_step:
        return Decision("hold", replace(state, healthy=healthy, idle=0), f"healthy check {healthy}")
    nxt = min(state.step + 1, len(state.steps) - 1)
    status = "promoted" if nxt == len(state.steps) - 1 else "running"
    return Decision("promote", replace(state, step=nxt, healthy=0, idle=0, status=status),
                    f"{guards.checks_per_step} healthy checks in a row")


# --- q3: the canary's decision -------------------------------------------------------------------------------------

# q3's live runs: canary.Guards(**LIVE_GUARDS)
LIVE_GUARDS = {"min_requests": 5, "min_feedback": 10, "checks_per_step": 2, "max_idle_checks": 8}


def _healthy(champion: Mapping[str, float] | None = None, **chall: float) -> dict[str, Any]:
    """A healthy champion and challenger, their figures changed by ``champion`` and ``chall``."""
    champ = {"error_rate": 0.001, "p95_ms": 40.0, "mean_ms": 12.0, "accuracy": 0.97, "requests": 4500.0,
             "feedback": 900.0}
    base = {"error_rate": 0.001, "p95_ms": 40.0, "mean_ms": 12.0, "accuracy": 0.96, "requests": 500.0,
            "feedback": 100.0}
    return {"champion": VariantMetrics(**{**champ, **(champion or {})}),
            "challenger": VariantMetrics(**{**base, **chall})}


def _sequences() -> list[tuple[str, Any, list[dict[str, Any]]]]:
    """(what, guards, metrics per check): the reference's decisions on them are the expected ones."""
    g = Guards()
    return [
        ("a good challenger", g, [_healthy() for _ in range(6)]),
        ("a good challenger, checks_per_step=3", Guards(checks_per_step=3), [_healthy() for _ in range(9)]),
        ("a challenger wrong on one digit in ten", g, [_healthy(accuracy=0.87)]),
        ("a few labelled answers, noisy", g,
         [_healthy(accuracy=0.6, feedback=5.0), _healthy(accuracy=0.6, feedback=5.0), _healthy()]),
        ("a slow challenger (p95 over the SLO, within 1.5 x a slow champion)", g,
         [_healthy({"p95_ms": 120.0}, p95_ms=150.0, accuracy=0.97)]),
        ("a slower challenger (2 x the champion's mean latency over the window, p95 under the SLO)", g,
         [_healthy(mean_ms=24.0, p95_ms=80.0)]),
        ("a challenger 1.4 x the champion's mean latency (within max_latency_ratio)", g,
         [_healthy(mean_ms=16.8) for _ in range(4)]),
        ("a challenger whose p95 is twice the champion's, mean latency the same (a summary over each server's "
         "own last 60 s: not comparable)", g, [_healthy(p95_ms=85.0) for _ in range(4)]),
        ("a fast champion: 1.5 x its 2 ms is under guards.latency_floor_ms", g,
         [_healthy({"mean_ms": 2.0}, mean_ms=4.5) for _ in range(4)]),
        ("the window still holds the last step's traffic (mean_ms NaN), then holds this step's alone", g,
         [_healthy(mean_ms=math.nan), _healthy({"mean_ms": math.nan}, mean_ms=math.nan), _healthy(mean_ms=math.nan),
          _healthy(), _healthy(), _healthy(mean_ms=math.nan), _healthy(), _healthy()]),
        ("an error spike", g, [_healthy(), _healthy(error_rate=0.05)]),
        ("errors under 1 % but well above the champion's", g, [_healthy(error_rate=0.008)]),
        ("too few requests", g, [_healthy(requests=3.0, error_rate=0.0) for _ in range(g.max_idle_checks)]),
        ("a streak broken by a check without evidence", g, [_healthy(), _healthy(requests=3.0), _healthy(),
                                                            _healthy()]),
        ("no labelled feedback for the champion (its accuracy NaN)", g,
         [_healthy({"accuracy": math.nan, "feedback": 0.0}, accuracy=0.5)] * 2),
    ]


def _describe(m: Mapping[str, Any]) -> str:
    def one(x: Any) -> str:
        return (f"errors {x.error_rate:.1%}, p95 {x.p95_ms:g} ms, mean {x.mean_ms:g} ms, accuracy {x.accuracy:.0%} "
                f"on {x.feedback:g} labelled, {x.requests:g} requests")

    return f"challenger {one(m['challenger'])}; champion {one(m['champion'])}"


def _why(mine: Any, ref: Any, state: Any, m: Mapping[str, Any], g: Any) -> str:
    """What the student's decision got wrong, from how it differs from the reference's."""
    champ, chall = m["champion"], m["challenger"]
    no_comparison = math.isnan(chall.mean_ms) or math.isnan(champ.mean_ms)
    if mine.action == "promote" and ref.action == "hold":
        if no_comparison and chall.requests >= g.min_requests and chall.feedback >= g.min_feedback:
            return ("it promoted without the latency comparison: a mean_ms is NaN while the window still holds the "
                    "previous step's traffic (run_canary leaves it so); hold with state.healthy back to 0 until both "
                    "means are numbers, so that no step is taken before the latency was compared")
        if chall.requests < g.min_requests:
            return (f"it promoted on {chall.requests:g} challenger requests (< guards.min_requests = "
                    f"{g.min_requests}): too little evidence is a hold, not a healthy check")
        return (f"it promoted after {state.healthy + 1} healthy check(s) at {state.weight} %: wait for "
                f"guards.checks_per_step ({g.checks_per_step}) healthy checks in a row, counted in state.healthy; a "
                "check without evidence breaks the streak (healthy back to 0)")
    if mine.action == "rollback" and ref.action != "rollback":
        if mine.alert == "CanaryNoTraffic":
            return (f"it rolled back for lack of traffic after {state.idle + 1} check(s): hold while evidence is "
                    f"short (count them in state.idle) and roll back only after guards.max_idle_checks "
                    f"({g.max_idle_checks}) in a row")
        if mine.alert == "CanaryAccuracy" and chall.feedback < g.min_feedback:
            return (f"it applied the accuracy guard on {chall.feedback:g} labelled answers: below "
                    f"guards.min_feedback ({g.min_feedback}) the accuracy is noise; skip the guard until then")
        if mine.alert == "CanaryLatency" and (g.max_p95_ms is None or chall.p95_ms <= g.max_p95_ms):
            if not no_comparison and chall.mean_ms <= g.max_latency_ratio * champ.mean_ms:
                return (f"it rolled back on latency with the challenger's mean ({chall.mean_ms:g} ms) within "
                        f"guards.max_latency_ratio ({g.max_latency_ratio:g}) x the champion's ({champ.mean_ms:g} ms) "
                        f"and its p95 ({chall.p95_ms:g} ms) under the SLO: compare the means over the window, not the "
                        "p95s (Triton's summary covers each server's own last 60 s: a challenger reloaded seconds ago "
                        "and a champion serving for minutes are read over different spans)")
            if not no_comparison:
                return (f"it rolled back with the challenger's mean ({chall.mean_ms:g} ms) under "
                        f"guards.latency_floor_ms ({g.latency_floor_ms:g} ms): the bound relative to the champion is "
                        "max(max_latency_ratio x the champion's mean, latency_floor_ms)")
        if mine.alert == "CanaryAccuracy" and math.isnan(champ.accuracy):
            return ("it rolled back on accuracy while the champion's accuracy is NaN (no labelled answers): with "
                    "nothing to compare with, the accuracy guard is not evaluated (`not (a >= nan)` is True)")
        return f"it rolled back ({mine.alert}) though every guard passes"
    if ref.action == "rollback" and mine.action != "rollback":
        if ref.alert == "CanaryLatency":
            if g.max_p95_ms is not None and chall.p95_ms > g.max_p95_ms:
                return (f"the challenger's p95 ({chall.p95_ms:g} ms) is over the SLO guards.max_p95_ms "
                        f"({g.max_p95_ms:g} ms): roll back (CanaryLatency) even when its mean is within "
                        f"{g.max_latency_ratio:g} x the champion's; check both bounds")
            return (f"the challenger's mean latency over the window ({chall.mean_ms:g} ms) is over "
                    f"guards.max_latency_ratio ({g.max_latency_ratio:g}) x the champion's ({champ.mean_ms:g} ms), and "
                    f"over guards.latency_floor_ms: roll back (CanaryLatency) even with its p95 under the SLO")
        if ref.alert == "CanaryErrors":
            if chall.error_rate > g.max_error_rate:
                return (f"the challenger's error rate {chall.error_rate:.1%} is over guards.max_error_rate: roll "
                        "back (CanaryErrors)")
            return (f"the challenger's error rate {chall.error_rate:.1%} is more than guards.max_error_rate_delta "
                    f"({g.max_error_rate_delta:.1%}) above the champion's ({champ.error_rate:.1%}): roll back "
                    "(CanaryErrors) even under the absolute limit")
        if ref.alert == "CanaryAccuracy":
            return (f"the challenger's accuracy ({chall.accuracy:.0%}) is more than guards.max_accuracy_drop below "
                    f"the champion's ({champ.accuracy:.0%}) on {chall.feedback:g} labelled answers: roll back "
                    "(CanaryAccuracy)")
        if ref.alert == "CanaryNoTraffic":
            return (f"after guards.max_idle_checks ({g.max_idle_checks}) checks in a row without enough requests, "
                    "roll back (CanaryNoTraffic): a canary that gets no traffic must not hold forever")
    if mine.action == "hold" and ref.action == "promote":
        return f"it held after {g.checks_per_step} healthy checks in a row: promote to the next step"
    if mine.action == ref.action == "rollback":
        return f"it raised {mine.alert!r} where {ref.alert!r} tripped: name the guard that tripped"
    return (f"expected {ref.action} to {ref.state.weight} % ({ref.state.status}); the steps are state.steps, the "
            "last (100 %) is status 'promoted', a rollback is status 'rolled_back' (weight 0)")


def _run_decide(fn: Any, state: Any, m: Mapping[str, Any], g: Any) -> Any:
    d = run_student(fn, state, m, g, what="decide", call="decide(state, metrics, guards)", timeout_s=10,
                    returns=Decision, returns_text="a canary.Decision(action, state, reason, alert)")
    if not isinstance(d.state, CanaryState):
        raise Wrong(f"its Decision's state is {_short(d.state)}: the new CanaryState (dataclasses.replace(state, "
                    "...))")
    return d


def _grade_scripted(fn: Any) -> int:
    checks = 0
    for what, g, seq in _sequences():
        mine_state = ref_state = canary.CanaryState()
        for i, m in enumerate(seq, start=1):
            ref = canary.decide(ref_state, m, g)
            mine = _run_decide(fn, mine_state, m, g)
            checks += 1
            same = (mine.action == ref.action and mine.state.weight == ref.state.weight
                    and mine.state.status == ref.state.status and (mine.alert or None) == (ref.alert or None))
            if not same:
                yours = f"{mine.action} to {mine.state.weight} % ({mine.state.status}" + \
                    (f", alert {mine.alert}" if mine.alert else "") + ")"
                raise Wrong(f"{what}, check {i} at {mine_state.weight} % ({_describe(m)}): yours says {yours}; "
                            f"{_why(mine, ref, mine_state, m, g)}")
            mine_state, ref_state = mine.state, ref.state
            if ref_state.finished:
                break
    return checks


def _live(fn: Any) -> str:
    guards = canary.Guards(**LIVE_GUARDS)
    decide_fn = functools.partial(_run_decide, fn)  # the student's decide, its Decision checked at every step
    out = []
    with _bench() as bench:
        for what, acc, want in (("a good challenger", 0.97, "promoted"), ("a challenger wrong on 4 answers in 10",
                                                                            0.6, "rolled_back")):
            run = bench.live(acc)
            try:
                t0 = time.perf_counter()
                result = canary.run_canary(bench.prom, run.set_weight, guards=guards, interval_s=0.6, timeout_s=20,
                                           window="2s", model=run.model, feedback_by=run.label, decide_fn=decide_fn)
                secs = time.perf_counter() - t0
            finally:
                bench.drop(run)
            actions = [r["action"] for r in result.rows]
            if result.state.status != want:
                raise Wrong(f"live, {what}: run_canary with your decide ended {result.state.status} (weights "
                            f"{run.weights}, alerts {result.alerts}, actions {actions}) where it should be {want}")
            if want == "promoted" and run.weights != [10, 50, 100]:
                raise Wrong(f"live, {what}: the weights went {run.weights}, not 10 -> 50 -> 100")
            if want == "rolled_back" and result.alerts != ["CanaryAccuracy"]:
                raise Wrong(f"live, {what}: rolled back with alerts {result.alerts}, expected ['CanaryAccuracy']")
            out.append(f"{what} {want.replace('_', ' ')} in {secs:.0f} s")
    return "; ".join(out)


def _grade_decide(fn: Any) -> str:
    checks = _grade_scripted(fn)
    why = _prometheus_missing()
    if why:
        return f"it decides as the reference on {checks} scripted checks. (The live run is skipped: {why})"
    return f"it decides as the reference on {checks} scripted checks, and live on Prometheus: {_live(fn)}."


q3 = CodeExercise(
    name="08.3 the canary's decision", var="decide", grade=_grade_decide,
    references=References("write the canary's decision rules yourself",
                           "lab_utils.exercises.lab08.reference_decide", "lab_utils.mlops.canary.decide"),
    signature="decide(state: CanaryState, metrics: dict[str, VariantMetrics], guards: Guards) -> Decision",
    hints=(
        "Guards in order: errors (above guards.max_error_rate, or above the champion's + max_error_rate_delta), "
        "latency (p95 above guards.max_p95_ms, the SLO; or mean_ms above max(max_latency_ratio x the champion's "
        "mean_ms, latency_floor_ms), where both means are numbers), accuracy (below the "
        "champion's - max_accuracy_drop, only once feedback >= min_feedback and both accuracies are numbers). "
        "A trip: Decision('rollback', replace(state, status='rolled_back'), why, alert).",
        "Fewer than guards.min_requests challenger requests: a hold (state.idle + 1, healthy back to 0); after "
        "guards.max_idle_checks of those in a row: rollback 'CanaryNoTraffic'.",
        "Evidence in but a mean_ms NaN (the window still holds the last step's traffic): hold, healthy and idle "
        "back to 0. A healthy check adds 1 to state.healthy; at guards.checks_per_step: promote, replace(state, "
        "step=step + 1, healthy=0, idle=0), with status 'promoted' when the new step is the last (100 %).",
    ),
    solution_text=source_as(reference_decide, "decide"),
)
