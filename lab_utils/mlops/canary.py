"""A canary controller (the reference implementation of lab 08's exercise): the challenger takes 10 % of the traffic,
then 50 %, then 100 %, each step held while its guards pass; a tripped guard rolls it back to 0 %.

``decide(state, metrics, guards) -> Decision`` is the pure decision: hold, promote, or a guard's rollback
(``CanaryErrors``, ``CanaryLatency``, ``CanaryAccuracy``, ``CanaryNoTraffic``). ``read_metrics(prom, queries) ->
{variant: VariantMetrics}`` runs the PromQL in ``QUERIES``. ``run_canary(prom, set_weight, ...) -> CanaryRun``
loops: read, decide, apply the weight, log a timeline row. Units: error rates and accuracy are fractions 0..1,
latency in ms, weights in % of requests.

The latency guard compares the variants on their mean latency over the same window, once that window holds only
the current step's traffic (``run_canary`` leaves ``mean_ms`` NaN until then): Triton's p95 is a summary over each
server's own last 60 s, so a challenger reloaded a few seconds ago and a champion serving for minutes are read over
different spans, and a busy second just after a step is a large share of the challenger's few requests and a tiny
share of the champion's. The p95 is held to the SLO alone.

Design notes: docs/internals.md#lab_utilsmlopscanarypy"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import pandas as pd

from lab_utils.args import check_int, check_positive
from lab_utils.mlops.feedback import FEEDBACK_CORRECT, FEEDBACK_TOTAL, VARIANT_LABEL
from lab_utils.monitoring.prometheus import PrometheusError, window_seconds

VARIANTS = ("champion", "challenger")
STEPS = (10, 50, 100)
SERVICE_MODEL = "digits_service"

# The service's metrics come from Triton (one server per variant, scraped as jobs "champion" and "challenger");
# labelled feedback from FeedbackExporter (label "variant"). A failure counter may not exist before the first
# failure: "or ... * 0" makes it 0 where the success counter exists.
_FAILURES = ('(sum by ({by}) (rate(nv_inference_request_failure{{model="{model}"}}[{window}])) '
             'or sum by ({by}) (rate(nv_inference_request_success{{model="{model}"}}[{window}])) * 0)')
_SUCCESSES = 'sum by ({by}) (rate(nv_inference_request_success{{model="{model}"}}[{window}]))'
_INC_SUCCESSES = 'sum by ({by}) (increase(nv_inference_request_success{{model="{model}"}}[{window}]))'
_INC_FAILURES = ('(sum by ({by}) (increase(nv_inference_request_failure{{model="{model}"}}[{window}])) '
                 f'or {_INC_SUCCESSES} * 0)')
QUERIES = {
    # share of requests that failed over the window (0..1)
    "error_rate": f"{_FAILURES} / ({_SUCCESSES} + {_FAILURES})",
    # requests answered over the window (count)
    "requests": f"{_INC_SUCCESSES} + {_INC_FAILURES}",
    # Triton's p95 of request latency (summary over its own sliding window, summary_latencies=true), in ms
    "p95_ms": 'max by ({by}) (nv_inference_request_summary_us{{model="{model}",quantile="0.95"}}) / 1000',
    # mean request latency over the window, in ms: Triton's cumulative request time over its successful requests
    "mean_ms": ('sum by ({by}) (rate(nv_inference_request_duration_us{{model="{model}"}}[{window}])) / '
                f"{_SUCCESSES} / 1000"),
    # accuracy on labelled feedback over the window (0..1), and how many labelled answers it rests on
    "accuracy": (f"sum by ({{feedback_by}}) (increase({FEEDBACK_CORRECT}[{{window}}])) / "
                 f"sum by ({{feedback_by}}) (increase({FEEDBACK_TOTAL}[{{window}}]))"),
    "feedback": f"sum by ({{feedback_by}}) (increase({FEEDBACK_TOTAL}[{{window}}]))"}


def render_queries(window: str = "30s", model: str = SERVICE_MODEL, by: str = "job",
                   feedback_by: str = VARIANT_LABEL) -> dict[str, str]:
    """``QUERIES`` with the window (``"30s"``, at least 2 scrape intervals), the Triton model and the grouping
    labels filled in: PromQL a student can paste into Prometheus."""
    window_seconds(window)  # a PromQL duration, or a ValueError that says so
    return {k: q.format(window=window, model=model, by=by, feedback_by=feedback_by) for k, q in QUERIES.items()}


@dataclass(frozen=True)
class VariantMetrics:
    """One variant over the last window. NaN where nothing was measured (no traffic, no labelled feedback)."""

    error_rate: float = math.nan  # fraction of requests that failed
    p95_ms: float = math.nan  # Triton's summary: the server's own last 60 s, whatever the window
    accuracy: float = math.nan  # on labelled feedback, fraction
    requests: float = 0.0  # answered in the window
    feedback: float = 0.0  # labelled answers in the window
    mean_ms: float = math.nan  # over the window; NaN while the window still holds the previous step's traffic


@dataclass(frozen=True)
class Guards:
    """What the challenger must keep to go on; thresholds in fractions (rates, accuracy) and ms."""

    max_error_rate: float = 0.01
    max_error_rate_delta: float = 0.005  # above the champion's
    max_p95_ms: float | None = 100.0  # the service's SLO on the p95; None: no absolute bound
    max_latency_ratio: float = 1.5  # x the champion's mean latency over the same window
    latency_floor_ms: float = 5.0  # the relative bound is never below this: 3 ms against 2 ms is no regression
    max_accuracy_drop: float = 0.03  # below the champion's accuracy on labelled feedback
    min_requests: int = 20  # a check with fewer challenger requests decides nothing (hold)
    min_feedback: int = 20  # labelled answers before the accuracy guard counts
    checks_per_step: int = 2  # healthy checks in a row before the next step
    max_idle_checks: int = 10  # checks in a row without enough evidence: roll back (CanaryNoTraffic)

    def __post_init__(self) -> None:
        for name in ("max_error_rate", "max_error_rate_delta", "max_accuracy_drop"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 <= v <= 1):
                raise ValueError(f"Guards({name}={v!r}): a fraction between 0 and 1 (0.01 is 1 %)")
        if self.max_p95_ms is not None:  # None: no absolute bound
            check_positive(self.max_p95_ms, "max_p95_ms", "Guards", what="number of milliseconds")
        check_positive(self.latency_floor_ms, "latency_floor_ms", "Guards", zero_ok=True,
                       what="number of milliseconds")
        if not (isinstance(self.max_latency_ratio, (int, float)) and self.max_latency_ratio >= 1):
            raise ValueError(f"Guards(max_latency_ratio={self.max_latency_ratio!r}): a ratio >= 1 (1.5 allows 50 % "
                             "slower)")
        for name in ("min_requests", "min_feedback", "checks_per_step", "max_idle_checks"):
            check_int(getattr(self, name), name, "Guards", 1 if name in ("checks_per_step", "max_idle_checks") else 0)


@dataclass(frozen=True)
class CanaryState:
    """Where the canary stands: the step (index into ``steps``), healthy and idle checks in a row, the status."""

    steps: tuple[int, ...] = STEPS
    step: int = 0
    healthy: int = 0
    idle: int = 0
    status: str = "running"  # running | promoted | rolled_back

    def __post_init__(self) -> None:
        s = tuple(self.steps)
        if not s or any(not isinstance(w, int) for w in s) or list(s) != sorted(set(s)) or s[0] <= 0 or s[-1] != 100:
            raise ValueError(f"steps={self.steps!r}: increasing whole percentages ending at 100, e.g. (10, 50, 100)")
        if not 0 <= self.step < len(s):
            raise ValueError(f"step={self.step}: an index into steps {s}")
        if self.status not in ("running", "promoted", "rolled_back"):
            raise ValueError(f"status={self.status!r}: running, promoted or rolled_back")

    @property
    def weight(self) -> int:
        """The challenger's share of requests now (%)."""
        return 0 if self.status == "rolled_back" else self.steps[self.step]

    @property
    def finished(self) -> bool:
        return self.status != "running"


@dataclass(frozen=True)
class Decision:
    """What ``decide`` concluded: the action, the new state (and weight), why, and the alert a trip raises."""

    action: str
    state: CanaryState
    reason: str
    alert: str | None = None
    checks: dict[str, bool] = field(default_factory=dict)  # guard -> passed (absent: not evaluated)

    @property
    def weight(self) -> int:
        return self.state.weight


def _nan(x: Any) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def _metrics(metrics: Mapping[str, Any]) -> tuple[VariantMetrics, VariantMetrics]:
    if not isinstance(metrics, Mapping) or set(VARIANTS) - set(metrics):
        got = sorted(metrics) if isinstance(metrics, Mapping) else type(metrics).__name__
        raise ValueError(f"metrics: a mapping with keys 'champion' and 'challenger' (VariantMetrics each); got {got}")
    out = []
    for v in VARIANTS:
        m = metrics[v]
        if isinstance(m, Mapping):
            m = VariantMetrics(**m)
        if not isinstance(m, VariantMetrics):
            raise ValueError(f"metrics[{v!r}]: a VariantMetrics (or a dict of its fields), got {m!r}")
        out.append(m)
    return out[0], out[1]


def decide(state: CanaryState, metrics: Mapping[str, VariantMetrics], guards: Guards = Guards()) -> Decision:
    """One check of the canary: ``rollback`` when a guard trips, ``hold`` while evidence is short (too few requests
    or labelled answers; no latency comparison yet: a ``mean_ms`` is NaN) or the step's healthy checks are not all
    in, ``promote`` to the next step (the last is 100 %: promoted), ``done`` once finished. Pure: same inputs, same
    decision."""
    if not isinstance(state, CanaryState):
        raise ValueError(f"state: a CanaryState, got {state!r}")
    if not isinstance(guards, Guards):
        raise ValueError(f"guards: a Guards, got {guards!r}")
    champ, chall = _metrics(metrics)
    if state.finished:
        return Decision("done", state, f"the canary is {state.status.replace('_', ' ')}")

    def rollback(alert: str, why: str, checks: dict[str, bool]) -> Decision:
        return Decision("rollback", replace(state, status="rolled_back", healthy=0), why, alert, checks)

    checks: dict[str, bool] = {}
    if enough := chall.requests >= guards.min_requests and not _nan(chall.error_rate):
        # errors: an absolute bound, and a bound relative to the champion (when it has traffic to compare with)
        bad_abs = chall.error_rate > guards.max_error_rate
        bad_rel = not _nan(champ.error_rate) and chall.error_rate > champ.error_rate + guards.max_error_rate_delta
        checks["errors"] = not (bad_abs or bad_rel)
        if not checks["errors"]:
            ref = "" if _nan(champ.error_rate) else f"; champion {champ.error_rate:.2%}"
            return rollback("CanaryErrors", f"challenger error rate {chall.error_rate:.2%} (limit "
                            f"{guards.max_error_rate:.2%}, or champion + {guards.max_error_rate_delta:.2%}{ref})",
                            checks)
        # the p95 against the SLO; the mean against the champion's over the same window (both numbers only once
        # the window holds the current step's traffic alone)
        slow_abs = not _nan(chall.p95_ms) and guards.max_p95_ms is not None and chall.p95_ms > guards.max_p95_ms
        limit = math.nan if _nan(champ.mean_ms) or champ.mean_ms <= 0 else \
            max(guards.max_latency_ratio * champ.mean_ms, guards.latency_floor_ms)
        slow_rel = not _nan(chall.mean_ms) and not _nan(limit) and chall.mean_ms > limit
        if not (_nan(chall.p95_ms) and _nan(limit)):
            checks["latency"] = not (slow_abs or slow_rel)
        if slow_abs:
            return rollback("CanaryLatency", f"challenger p95 {chall.p95_ms:.1f} ms over the SLO "
                            f"({guards.max_p95_ms:g} ms)", checks)
        if slow_rel:
            return rollback("CanaryLatency", f"challenger mean latency {chall.mean_ms:.1f} ms over the window, over "
                            f"{limit:.1f} ms ({guards.max_latency_ratio:g} x the champion's {champ.mean_ms:.1f} ms, "
                            f"at least {guards.latency_floor_ms:g} ms)", checks)
    if chall.feedback >= guards.min_feedback and not _nan(chall.accuracy) and not _nan(champ.accuracy):
        checks["accuracy"] = chall.accuracy >= champ.accuracy - guards.max_accuracy_drop
        if not checks["accuracy"]:
            return rollback("CanaryAccuracy", f"challenger accuracy {chall.accuracy:.1%} on {chall.feedback:.0f} "
                            f"labelled requests, champion {champ.accuracy:.1%} (allowed drop "
                            f"{guards.max_accuracy_drop:.1%})", checks)
    # no step on traffic alone: a model wrong on one class answers as fast as a right one (when labels are expected)
    if not enough or (guards.min_feedback > 0 and chall.feedback < guards.min_feedback):
        lacking, wait = ((f"{guards.min_requests} challenger requests: no evidence it works",
                          f"waiting for evidence: {chall.requests:.0f} challenger requests in the window, "
                          f"{guards.min_requests} needed") if not enough else
                         (f"{guards.min_feedback} labelled answers from the challenger: no evidence it is right",
                          f"waiting for labelled feedback: {chall.feedback:.0f} of {guards.min_feedback}"))
        if (idle := state.idle + 1) >= guards.max_idle_checks:
            return rollback("CanaryNoTraffic", f"{idle} checks without {lacking}", checks)
        return Decision("hold", replace(state, idle=idle, healthy=0), wait, None, checks)
    # no step before the latency comparison: the window must first hold this step's traffic alone (a wait with the
    # evidence in, not a lack of it: idle back to 0)
    if _nan(chall.mean_ms) or _nan(champ.mean_ms):
        return Decision("hold", replace(state, healthy=0, idle=0), f"waiting for a window of traffic at "
                        f"{state.weight} % alone: no latency comparison yet", None, checks)
    if (healthy := state.healthy + 1) < guards.checks_per_step:
        return Decision("hold", replace(state, healthy=healthy, idle=0),
                        f"healthy check {healthy} of {guards.checks_per_step} at {state.weight} %", None, checks)
    nxt = min(state.step + 1, len(state.steps) - 1)  # steps=(100,): already at 100 %, promoted now
    status = "promoted" if nxt == len(state.steps) - 1 else "running"
    new = replace(state, step=nxt, healthy=0, idle=0, status=status)
    what = "promoted: the challenger takes all traffic" if status == "promoted" else \
        f"step {state.weight} % -> {new.weight} %"
    return Decision("promote", new, f"{guards.checks_per_step} healthy checks in a row; {what}", None, checks)


# --- reading Prometheus ------------------------------------------------------------------------------------------


def read_metrics(prom: Any, queries: Mapping[str, str], by: str = "job",
                 feedback_by: str = VARIANT_LABEL) -> dict[str, VariantMetrics]:
    """Run the rendered ``queries`` (``render_queries``) on ``prom`` (a ``PromAPI``) and gather them per variant.
    A series that is absent leaves NaN (``requests``/``feedback``: 0)."""
    names = {f.name for f in fields(VariantMetrics)}
    values: dict[str, dict[str, float]] = {v: {} for v in VARIANTS}
    for key, expr in queries.items():
        label = feedback_by if key in ("accuracy", "feedback") else by
        df = prom.query(expr)
        if df.empty or label not in df.columns:
            continue
        for _, row in df.iterrows():  # a NaN is left out: the field's default stands (NaN, or 0 for counts)
            if row[label] in values and key in names and not math.isnan(x := float(row["value"])):
                values[row[label]][key] = x
    return {v: VariantMetrics(**values[v]) for v in VARIANTS}


@dataclass
class CanaryRun:
    """The loop's record: the final state, and one timeline row per check (and per weight change)."""

    state: CanaryState
    rows: list[dict[str, Any]]

    @property
    def timeline(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows)

    @property
    def promoted(self) -> bool:
        return self.state.status == "promoted"

    @property
    def rolled_back(self) -> bool:
        return self.state.status == "rolled_back"

    @property
    def alerts(self) -> list[str]:
        return [r["alert"] for r in self.rows if r.get("alert")]


def run_canary(prom: Any, set_weight: Callable[[int], None], *, guards: Guards = Guards(), interval_s: float = 5.0,
               timeout_s: float = 300.0, window: str = "30s", model: str = SERVICE_MODEL,
               feedback_by: str = VARIANT_LABEL, on_row: Callable[[dict[str, Any]], None] | None = None,
               decide_fn: Callable[[CanaryState, Mapping[str, VariantMetrics], Guards], Decision] | None = None
               ) -> CanaryRun:
    """Drive a canary: ``set_weight(STEPS[0])``, then every ``interval_s`` read Prometheus, ``decide``, and apply a
    new weight (``set_weight(w)``: the challenger's %, 0 to roll back). Ends promoted, rolled back, or after
    ``timeout_s`` rolled back (``CanaryTimeout``). A failed ``set_weight`` is retried as a rollback to 0 and then
    raised. A failed query counts as a check without evidence. ``on_row(row)`` sees each timeline row as it is
    written (a live plot, a print). ``decide_fn``: the decision function (default ``decide``; an exercise passes the
    student's).

    Both variants' ``mean_ms`` stay NaN (no latency comparison: ``decide`` holds) until ``window`` plus one check
    interval has passed since the last weight change: only then does the window hold the current split alone, so
    that both means are over the same requests' time (a scrape lags by at most an interval)."""
    state = CanaryState()
    check_positive(interval_s, "interval_s", "run_canary", what="number of seconds")
    rendered = render_queries(window, model, feedback_by=feedback_by)
    settle_s = window_seconds(window) + interval_s
    rows: list[dict[str, Any]] = []
    t0 = changed = time.time()

    def log(action: str, metrics: Mapping[str, VariantMetrics] | None, reason: str, alert: str | None) -> None:
        row: dict[str, Any] = {"time": time.time(), "t_s": time.time() - t0, "weight": state.weight,
                               "action": action, "alert": alert, "reason": reason,
                               **{f"{v}_{k}": x for v, m in (metrics or {}).items() for k, x in asdict(m).items()}}
        rows.append(row)
        if on_row is not None:
            on_row(row)

    def apply(weight: int) -> None:
        nonlocal state, changed
        changed = time.time()
        try:
            set_weight(weight)
        except BaseException as err:
            state = replace(state, status="rolled_back")
            log("rollback", None, f"set_weight({weight}) failed: {err!r}; rolling back to 0 %", "CanaryApplyFailed")
            if weight != 0:
                set_weight(0)
            raise

    apply(state.weight)
    log("start", None, f"challenger at {state.weight} %", None)
    while not state.finished:
        time.sleep(interval_s)
        if time.time() - t0 > timeout_s:
            state = replace(state, status="rolled_back")
            apply(0)
            log("rollback", None, f"no decision within {timeout_s:g} s", "CanaryTimeout")
            break
        try:
            metrics = read_metrics(prom, rendered, feedback_by=feedback_by)
            note = ""
        except PrometheusError as err:
            metrics = {v: VariantMetrics() for v in VARIANTS}
            note = f" (query failed: {err})"
        if time.time() - changed < settle_s:  # the window still holds the previous split's requests
            metrics = {v: replace(m, mean_ms=math.nan) for v, m in metrics.items()}
        before = state.weight
        decision = (decide_fn or decide)(state, metrics, guards)
        state = decision.state
        if state.weight != before:
            apply(state.weight)
        log(decision.action, metrics, decision.reason + note, decision.alert)
    return CanaryRun(state, rows)
