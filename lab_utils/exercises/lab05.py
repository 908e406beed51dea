"""Lab 05 exercises: PromQL, alert thresholds, reading metrics, finding the bottleneck.

The PromQL answers (q1, q2) are graded by Prometheus itself. ``RECORDED`` holds twelve minutes of two Triton
servers' counters for two models, scraped every 15 s, the load changing every 3 minutes. A check starts a
Prometheus that serves these samples (backfilled by promtool), evaluates the student's query and the reference at
the end of each phase (``GRADING_TIMES``, where the reference's value changes), and compares the series: an
equivalent query written another way gives the same numbers and passes, a constant that matches once does
not. A wrong answer is told its symptom: a known mistake (``increase`` for ``rate``, inferences for requests,
microseconds) is recognised by its numbers, evaluated by Prometheus too; a missing ``sum by (model)`` by its
series. Without prometheus and promtool these two checks say how to install them instead of grading.

The other questions take numbers or choices from fixed data in this module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from lab_utils.exercises.framework import Exercise, Outcome, Status, Wrong, is_blank, number
from lab_utils.monitoring import prometheus

__all__ = [
    "q1", "q2", "q3", "q4", "q5",
    "RECORDED", "RECORDING_START", "GRADING_TIMES", "recorded_frame",
    "BASELINE_P99_MS", "INCIDENT_P99_MS", "BASELINE_PENDING", "INCIDENT_PENDING",
    "SNAPSHOT_BEFORE", "SNAPSHOT_AFTER", "SNAPSHOT_SECONDS",
    "Q5_MODELS", "Q5_CHOICES",
]

# --- recorded samples for q1 and q2 -------------------------------------------------------------------------

# Two servers behind a load balancer (70 % / 30 % of each model's requests; the second one is slower), two
# models, four 3-minute phases of different load, and from one 15 s scrape to the next the traffic wobbles
# (+-20 %), as real traffic does, so that only the asked-for [1m] window gives the reference's numbers. Each
# request of resnet50 carries 4 inferences, of bert 2; the dynamic batcher runs 8 and 4 inferences per
# execution. 60 % of a request's time is queueing, 30 % computing. The servers had been up a while: the
# counters start high, and their latency was lower then.
RECORDING_START = 1_700_000_000.0  # unix seconds of the first sample: fixed, so the grade never depends on the clock
_STEP_S, _PHASE_S, _PHASES = 15, 180, 4
_SERVERS = (("10.0.0.7:8002", 0.7), ("10.0.0.8:8002", 0.3))  # (instance, share of each model's requests)
_MODELS: dict[str, dict[str, Any]] = {
    "resnet50": {"qps": (80, 120, 200, 150), "latency_ms": ((20, 26), (24, 30), (41, 55), (30, 36)),
                 "inferences": 4, "per_exec": 8},
    "bert": {"qps": (30, 45, 20, 60), "latency_ms": ((8, 12), (10, 11), (9, 14), (15, 18)),
             "inferences": 2, "per_exec": 4},
}
_QUEUE_SHARE, _COMPUTE_SHARE = 0.6, 0.3
_START_REQUESTS, _START_LATENCY_MS = 1_000_000, 10.0
# The end of each phase: the reference's value changes from one to the next.
GRADING_TIMES = tuple(RECORDING_START + _PHASE_S * (i + 1) for i in range(_PHASES))


def _recorded_samples() -> list[prometheus.Sample]:
    rows: list[prometheus.Sample] = []
    totals = {(s, m): [float(_START_REQUESTS), _START_REQUESTS * _START_LATENCY_MS * 1000]
              for s in range(len(_SERVERS)) for m in _MODELS}  # requests, request time (us) so far
    for step in range(_PHASES * _PHASE_S // _STEP_S + 1):
        t = RECORDING_START + step * _STEP_S
        phase = max(0, step - 1) * _STEP_S // _PHASE_S  # the phase of the 15 s that end at t
        for s, (instance, share) in enumerate(_SERVERS):
            rows.append(({"__name__": "up", "job": "triton", "instance": instance}, t, 1.0))
            for j, (model, m) in enumerate(_MODELS.items()):
                total = totals[(s, model)]
                if step:
                    wobble = 1 + 0.2 * math.sin(1.3 * step + 2.1 * s + 0.7 * j)
                    n = m["qps"][phase] * share * _STEP_S * wobble
                    total[0] += n
                    total[1] += n * m["latency_ms"][phase][s] * 1000 * (1 + 0.1 * math.cos(0.9 * step + s + j))
                requests, busy_us = total
                labels = {"job": "triton", "instance": instance, "model": model, "version": "1"}
                values = {
                    "nv_inference_request_success": requests,
                    "nv_inference_count": requests * m["inferences"],
                    "nv_inference_exec_count": requests * m["inferences"] / m["per_exec"],
                    "nv_inference_request_duration_us": busy_us,
                    "nv_inference_queue_duration_us": busy_us * _QUEUE_SHARE,
                    "nv_inference_compute_infer_duration_us": busy_us * _COMPUTE_SHARE,
                    # Little's law: requests in the queue = arrival rate x time queued
                    "nv_inference_pending_request_count": round(
                        m["qps"][phase] * share * m["latency_ms"][phase][s] / 1000 * _QUEUE_SHARE),
                }
                for name, v in values.items():
                    rows.append(({"__name__": name, **labels}, t, v))
                rows.append(({"__name__": "nv_inference_request_failure", **labels, "reason": "BACKEND"}, t, 0.0))
    return rows


RECORDED = tuple(_recorded_samples())


def recorded_frame() -> pd.DataFrame:
    """``RECORDED`` as a table: one row per sample (metric, labels, seconds since the start, value)."""
    return pd.DataFrame([{"metric": lab["__name__"], **{k: v for k, v in lab.items() if k != "__name__"},
                          "t_s": t - RECORDING_START, "value": v} for lab, t, v in RECORDED])


# --- grading a query with Prometheus ------------------------------------------------------------------------

Labels = tuple[tuple[str, str], ...]
Values = dict[float, dict[Labels, float]]  # {unix time: {series labels: value}}


def _at(t: float) -> str:
    return f"{(t - RECORDING_START) / 60:g}m"


def _evaluate(server: prometheus.PromAPI, expr: str) -> Values:
    """``expr`` at every grading time, as Prometheus answers it; Wrong with Prometheus' words when it refuses."""
    try:
        df = server.query_range(expr, GRADING_TIMES[0], GRADING_TIMES[-1], _PHASE_S)
    except prometheus.QueryError as err:
        if "range vector" in err.why and "range query" in err.why:
            raise Wrong("that is a range vector (metric[1m]: the raw samples of a window); wrap it in a function "
                        "such as rate()") from None
        raise Wrong(f"Prometheus refuses it: {err.why}") from None
    out: Values = {t: {} for t in GRADING_TIMES}
    names = [c for c in df.columns if c not in ("time", "value", "__name__")]
    for r in df.to_dict("records"):
        labels = tuple(sorted((k, r[k]) for k in names if isinstance(r[k], str)))
        out.setdefault(round(r["time"], 3), {})[labels] = r["value"]
    return out


def _project(values: Values, names: Sequence[str]) -> Values | None:
    """``values`` keyed by the labels ``names`` only (extra labels that tell nothing apart are ignored); None
    when a series lacks one of them or two series fall together."""
    out: Values = {}
    for t, series in values.items():
        out[t] = {}
        for labels, v in series.items():
            d = dict(labels)
            if not set(names) <= set(d):
                return None
            key = tuple((k, d[k]) for k in sorted(names))
            if key in out[t]:
                return None
            out[t][key] = v
    return out


def _label_names(values: Values) -> list[str]:
    return sorted({k for series in values.values() for labels in series for k, _ in labels})


def _same(got: Values, want: Values, rel: float = 1e-6) -> bool:
    proj = _project(got, _label_names(want))
    if proj is None:
        return False
    return all(proj.get(t, {}).keys() == want[t].keys() and
               all(math.isclose(proj[t][k], v, rel_tol=rel, abs_tol=1e-9) for k, v in want[t].items())
               for t in want)


def _series_name(labels: Labels) -> str:
    """``bert`` for a series told apart by its model alone, else every label: ``{instance="...", model="bert"}``."""
    if [k for k, _ in labels] == ["model"]:
        return labels[0][1]
    return "{" + ", ".join(f'{k}="{v}"' for k, v in labels) + "}"


def _show(series: dict[Labels, float]) -> str:
    return ", ".join(f"{_series_name(k)}: {v:.4g}" for k, v in sorted(series.items())) or "nothing"


def _diagnose(got: Values, want: Values, what: str) -> None:
    """Raise Wrong naming the symptom of ``got`` against the reference's ``want``."""
    models = sorted({dict(k).get("model") for s in want.values() for k in s})
    if not any(got.values()):
        raise Wrong(f"it returns no series at all: check the metric names and label matchers (the models are "
                    f"{' and '.join(models)})")
    per_time = [sorted(s.values()) for s in got.values()]
    if all(len(v) == len(per_time[0]) and all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
                                              for a, b in zip(v, per_time[0], strict=True)) for v in per_time):
        first = want[GRADING_TIMES[0]]
        key = next(iter(sorted(first)))
        trend = " -> ".join(f"{want[t].get(key, math.nan):.4g}" for t in GRADING_TIMES)
        raise Wrong(f"this query is a constant: it gives {_show(got[GRADING_TIMES[0]])} at every time, while the "
                    f"reference changes ({_series_name(key)}: {trend} at "
                    f"{', '.join(map(_at, GRADING_TIMES))}): {what} must be computed from the counters")
    names = _label_names(want)
    if any(not set(names) <= {k for k, _ in labels} for s in got.values() for labels in s):
        raise Wrong(f"missing sum by (model): the result has no model label ({_show(got[GRADING_TIMES[-1]])} at "
                    f"{_at(GRADING_TIMES[-1])}), but the question asks for one number per model")
    proj = _project(got, names)
    if proj is None:
        n = max(len(s) for s in got.values())
        raise Wrong(f"missing sum by (model): {n} series for {len(models)} models (one per server and version: "
                    f"{_show(got[GRADING_TIMES[-1]])}); add each model's series up with sum by (model) (...)")
    seen = sorted({dict(k)["model"] for s in proj.values() for k in s})
    if seen != models:
        raise Wrong(f"it has the models {seen}, the reference {models}: drop the label matcher that filters them")
    pairs = [(proj[t][k], v, t) for t in want for k, v in want[t].items() if k in proj.get(t, {})]
    ratios = [g / w for g, w, _ in pairs if w]
    if ratios and all(math.isclose(r, ratios[0], rel_tol=1e-3) for r in ratios):
        k = ratios[0]
        why = {60.0: " (increase() over [1m] instead of rate()?)", 1000.0: " (microseconds instead of ms?)",
               0.001: " (divided by 1000 once too often?)"}
        hint = next((w for f, w in why.items() if math.isclose(k, f, rel_tol=1e-3)), "")
        raise Wrong(f"your values are {k:.4g}x the reference's at every time{hint}")
    matching = [t for t in want if all(math.isclose(proj[t].get(k, math.nan), v, rel_tol=1e-6)
                                       for k, v in want[t].items())]
    t = next((t for t in want if t not in matching), GRADING_TIMES[-1])
    if matching:
        raise Wrong(f"it agrees with the reference at {', '.join(map(_at, matching))} but not at {_at(t)} "
                    f"({_show(proj[t])} instead of {_show(want[t])}): the question asks for a [1m] window")
    raise Wrong(f"at {_at(t)} it gives {_show(proj[t])} where {what} is {_show(want[t])}")


def _grade_query(expr: Any, reference: str, mistakes: Sequence[tuple[str, str]], what: str) -> None:
    """Grade ``expr`` against ``reference`` with a Prometheus serving ``RECORDED`` (started and stopped here)."""
    if not isinstance(expr, str) or not expr.strip():
        raise Wrong(f"give the PromQL expression as a string, e.g. 'rate(metric[1m])', not {type(expr).__name__}")
    with prometheus.recorded_server(RECORDED) as server:
        got = _evaluate(server, expr)
        want = _evaluate(server, reference)
        if _same(got, want):
            return
        slips = [(_evaluate(server, mistake), message) for mistake, message in mistakes]
        for values, message in slips:  # a known slip, told by its symptom
            if _same(got, values):
                raise Wrong(message)
        if "model" in _label_names(got) and _project(got, ["model"]) is None:
            # several series per model: a slip may hide behind the missing sum, so Prometheus adds them up
            summed = _evaluate(server, f"sum by (model) ({expr})")
            for values, message in slips:
                if _same(summed, values):
                    raise Wrong(f"missing sum by (model) (one series per server and version), and {message}")
    _diagnose(got, want, what)


class PromQLExercise(Exercise):
    """An exercise whose answer is a PromQL query, graded by Prometheus. Where prometheus or promtool is
    missing, the check says how to install them instead of grading (the answer is not judged)."""

    def check(self, value: Any, *, quiet: bool = False) -> Outcome:
        why = prometheus.missing()
        if why is None or is_blank(value):
            return super().check(value, quiet=quiet)
        out = Outcome(self.name, Status.NOT_ATTEMPTED,
                      f"`{self.var}` was not checked (Prometheus grades this query): {why}")
        if not quiet:
            print(out)
        return out


def _window_slips(expr: str, what: str) -> list[tuple[str, str]]:
    return [(expr.replace("[1m]", f"[{w}]"), f"that is {what} over a {w} window; the question asks for [1m]")
            for w in ("30s", "2m", "5m", "10m")]


# --- q1: QPS in PromQL --------------------------------------------------------------------------------------

_QPS = "sum by (model) (rate(nv_inference_request_success[1m]))"
_QPS_SLIPS = [
    ("sum by (model) (increase(nv_inference_request_success[1m]))",
     "increase instead of rate: your values are 60x the reference. increase() counts the requests in the window; "
     "per second is rate() (or increase() divided by the window's 60 s)"),
    ("sum by (model) (rate(nv_inference_count[1m]))",
     "that counts inferences (nv_inference_count: each resnet50 request carries 4, each bert request 2); "
     "requests are nv_inference_request_success"),
    ("sum by (model) (rate(nv_inference_exec_count[1m]))",
     "that counts executions (nv_inference_exec_count: the batches the model ran); requests are "
     "nv_inference_request_success"),
    ("sum by (model) (nv_inference_request_success)",
     "that is the counter's total since the server started: a counter only means something as a rate, "
     "rate(counter[1m])"),
    ("sum by (model) (irate(nv_inference_request_success[1m]))",
     "irate() takes only the last two samples of the window (the last 15 s here), not the whole minute: use rate()"),
    *_window_slips(_QPS, "the request rate"),
]



def _grade_qps(expr: Any) -> None:
    _grade_query(expr, _QPS, _QPS_SLIPS, "the requests per second")


q1 = PromQLExercise(
    name="05.1 QPS in PromQL",
    var="qps_query",
    grade=_grade_qps,
    hints=[
        "Triton counts successful requests in a counter; a counter only grows, so look at how fast it grows.",
        "rate(counter[1m]) is the per-second increase averaged over the last minute; sum by (model) adds up the "
        "series of one model (its servers and versions).",
        "sum by (model) (rate(nv_inference_request_success[1m]))",
    ],
    solution_text=(
        'qps_query = "sum by (model) (rate(nv_inference_request_success[1m]))"\n'
        "# requests, not inferences (nv_inference_count) or executions (nv_inference_exec_count)"
    ),
)

# --- q2: average latency in PromQL ------------------------------------------------------------------------------

_LATENCY = ("sum by (model) (rate(nv_inference_request_duration_us[1m])) "
            "/ sum by (model) (rate(nv_inference_request_success[1m])) / 1000")
_LATENCY_SLIPS = [
    ("sum by (model) (rate(nv_inference_request_duration_us[1m])) / sum by (model) "
     "(rate(nv_inference_request_success[1m]))",
     "that is in microseconds (Triton's *_duration_us): your values are 1000x the reference; divide by 1000 for ms"),
    ("sum by (model) (nv_inference_request_duration_us) / sum by (model) (nv_inference_request_success) / 1000",
     "the counters themselves divided give the average since the server started; divide their rates to get the "
     "last minute's average"),
    ("sum by (model) (rate(nv_inference_queue_duration_us[1m])) / sum by (model) "
     "(rate(nv_inference_request_success[1m])) / 1000",
     "that is only the time requests wait in the queue (nv_inference_queue_duration_us); the whole request is "
     "nv_inference_request_duration_us"),
    ("sum by (model) (rate(nv_inference_compute_infer_duration_us[1m])) / sum by (model) "
     "(rate(nv_inference_request_success[1m])) / 1000",
     "that is only the model's compute (nv_inference_compute_infer_duration_us); the whole request is "
     "nv_inference_request_duration_us"),
    ("sum by (model) (rate(nv_inference_request_duration_us[1m])) / sum by (model) "
     "(rate(nv_inference_count[1m])) / 1000",
     "that divides by inferences (nv_inference_count); the latency of a request is request time over requests "
     "(nv_inference_request_success)"),
    ("sum by (model) (rate(nv_inference_request_duration_us[1m])) / sum by (model) "
     "(rate(nv_inference_exec_count[1m])) / 1000",
     "that is per execution (nv_inference_exec_count), not per request"),
    ("avg by (model) (rate(nv_inference_request_duration_us[1m]) / rate(nv_inference_request_success[1m])) / 1000",
     "that averages the servers' averages: the slower server, which serves 30 % of the requests, weighs as much "
     "as the other. Add the time and the requests up first, then divide (sum by (model) over sum by (model))"),
    *_window_slips(_LATENCY, "the average latency"),
]



def _grade_latency(expr: Any) -> None:
    _grade_query(expr, _LATENCY, _LATENCY_SLIPS, "the average latency in ms")


q2 = PromQLExercise(
    name="05.2 average latency in PromQL",
    var="latency_query",
    grade=_grade_latency,
    hints=[
        "Triton adds every request's duration (µs) to a counter and counts the requests in another: their "
        "ratio is an average.",
        "Divide the two rates over the same [1m] window, each summed by model first (not the counters themselves: "
        "that is the average since the server started), then convert µs to ms.",
        "sum by (model) (rate(nv_inference_request_duration_us[1m])) / sum by (model) "
        "(rate(nv_inference_request_success[1m])) / 1000",
    ],
    solution_text=(
        'latency_query = ("sum by (model) (rate(nv_inference_request_duration_us[1m]))"\n'
        '                 " / sum by (model) (rate(nv_inference_request_success[1m])) / 1000")'
    ),
)


def _close(a: float, b: float, rel: float = 0.02) -> bool:
    return math.isfinite(a) and math.isclose(a, b, rel_tol=rel)


# --- q3: thresholds from the baseline --------------------------------------------------------------------------

# One-minute p99 (ms) and pending requests of a healthy hour, and of the hour an overload began.
BASELINE_P99_MS = tuple(round(38 + 6 * math.sin(i / 5.0) + (9 if i % 17 == 0 else 0) + (i % 3), 1) for i in range(60))
INCIDENT_P99_MS = tuple([*BASELINE_P99_MS[:20], *(round(160 + 3 * i + 20 * math.sin(i), 1) for i in range(40))])
BASELINE_PENDING = tuple(int(2 + (i * 7) % 5 + (6 if i % 23 == 0 else 0)) for i in range(60))
INCIDENT_PENDING = tuple([*BASELINE_PENDING[:20], *(int(40 + (i * 13) % 30) for i in range(40))])

_P99_LOW, _P99_HIGH = max(BASELINE_P99_MS), min(INCIDENT_P99_MS[20:])
_PEND_LOW, _PEND_HIGH = max(BASELINE_PENDING), min(INCIDENT_PENDING[20:])


def _grade_thresholds(value: Any) -> None:
    if not isinstance(value, Mapping) or set(value) != {"p99_ms", "pending"}:
        raise Wrong("give a dict with two keys: {'p99_ms': ..., 'pending': ...}")
    p99 = number(value["p99_ms"], "thresholds['p99_ms']")
    pend = number(value["pending"], "thresholds['pending']")
    for got, low, high, base, what, unit in ((p99, _P99_LOW, _P99_HIGH, BASELINE_P99_MS, "p99_ms", "ms"),
                                             (pend, _PEND_LOW, _PEND_HIGH, BASELINE_PENDING, "pending", "")):
        if got <= low:
            false_alarms = sum(v > got for v in base)
            raise Wrong(f"{what} = {got:g}{unit} is not above the healthy hour's maximum: it would have fired on "
                        f"{false_alarms} of its 60 minutes (false alarms teach people to ignore the page)")
        if got >= high:
            raise Wrong(f"{what} = {got:g}{unit}: the overload never stays above it, so the alert would sleep "
                        f"through the incident; stay below the overload's lowest minute")


q3 = Exercise(
    name="05.3 alert thresholds from a baseline",
    var="thresholds",
    grade=_grade_thresholds,
    hints=[
        "An alert threshold sits between normal and broken: above everything a healthy hour shows, below "
        "what an incident shows.",
        "Look at max(BASELINE_P99_MS) and the lowest value of INCIDENT_P99_MS once the overload started "
        "(from minute 20); the same for pending requests.",
        "Pick something with headroom above the healthy maximum, e.g. about 1.5x it, checking it stays below "
        "the incident's minimum.",
    ],
    solution_text=(
        "p99_cap = min(INCIDENT_P99_MS[20:]); pending_cap = min(INCIDENT_PENDING[20:])\n"
        'thresholds = {"p99_ms": min(1.5 * max(BASELINE_P99_MS), (max(BASELINE_P99_MS) + p99_cap) / 2),\n'
        '              "pending": min(1.5 * max(BASELINE_PENDING), (max(BASELINE_PENDING) + pending_cap) / 2)}'
    ),
)

# --- q4: read a metrics snapshot ------------------------------------------------------------------------------

SNAPSHOT_SECONDS = 10.0
_S_REQ, _S_BATCH, _S_INF_PER_EXEC, _S_QUEUE_US = 2400, 2, 8, 12_500
_S0 = {"success": 500_000, "queue_us": 500_000 * 3_000}


def _exposition(success: int, queue_us: float) -> str:
    infer = success * _S_BATCH
    return (
        "# HELP nv_inference_request_success Number of successful inference requests, all batch sizes\n"
        "# TYPE nv_inference_request_success counter\n"
        f'nv_inference_request_success{{model="detector",version="1"}} {success}\n'
        "# HELP nv_inference_count Number of inferences performed (does not include cached requests)\n"
        "# TYPE nv_inference_count counter\n"
        f'nv_inference_count{{model="detector",version="1"}} {infer}\n'
        "# HELP nv_inference_exec_count Number of model executions performed (does not include cached requests)\n"
        "# TYPE nv_inference_exec_count counter\n"
        f'nv_inference_exec_count{{model="detector",version="1"}} {infer // _S_INF_PER_EXEC}\n'
        "# HELP nv_inference_queue_duration_us Cumulative inference queuing duration in microseconds\n"
        "# TYPE nv_inference_queue_duration_us counter\n"
        f'nv_inference_queue_duration_us{{model="detector",version="1"}} {queue_us:.0f}\n'
        "# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution\n"
        "# TYPE nv_inference_pending_request_count gauge\n"
        f'nv_inference_pending_request_count{{model="detector",version="1"}} 17\n'
    )


SNAPSHOT_BEFORE = _exposition(_S0["success"], _S0["queue_us"])
SNAPSHOT_AFTER = _exposition(_S0["success"] + _S_REQ, _S0["queue_us"] + _S_REQ * _S_QUEUE_US)
_Q4 = {"qps": _S_REQ / SNAPSHOT_SECONDS, "avg_batch": float(_S_INF_PER_EXEC), "avg_queue_ms": _S_QUEUE_US / 1000}


def _grade_snapshot(value: Any) -> None:
    if not isinstance(value, Mapping) or set(value) != set(_Q4):
        raise Wrong("give a dict with the keys 'qps', 'avg_batch' and 'avg_queue_ms'")
    qps = number(value["qps"], "snapshot['qps']")
    if not _close(qps, _Q4["qps"]):
        if _close(qps, _S_REQ):
            raise Wrong("qps: that is the requests between the two scrapes; divide by the seconds between them")
        if _close(qps, _Q4["qps"] * _S_BATCH):
            raise Wrong("qps: that counts inferences (nv_inference_count); requests are "
                        "nv_inference_request_success")
        if qps > 1e4:
            raise Wrong("qps: that uses a counter's total; take the difference between the two snapshots")
        raise Wrong(f"qps = {qps:g}: requests per second is the growth of nv_inference_request_success over "
                    f"the {SNAPSHOT_SECONDS:g} s between the snapshots")
    batch = number(value["avg_batch"], "snapshot['avg_batch']")
    if not _close(batch, _Q4["avg_batch"]):
        if _close(batch, _Q4["avg_batch"] / _S_BATCH):
            raise Wrong("avg_batch: that is requests per execution; a batch is counted in inferences "
                        "(nv_inference_count), and each request here carries 2")
        raise Wrong(f"avg_batch = {batch:g}: the average batch is Δ nv_inference_count / Δ nv_inference_exec_count")
    queue = number(value["avg_queue_ms"], "snapshot['avg_queue_ms']")
    if not _close(queue, _Q4["avg_queue_ms"]):
        if _close(queue, _Q4["avg_queue_ms"] * 1000):
            raise Wrong("avg_queue_ms: that is in microseconds; divide by 1000")
        if _close(queue, _Q4["avg_queue_ms"] / _S_BATCH):
            raise Wrong("avg_queue_ms: that divides by inferences; the queue time is per request "
                        "(nv_inference_request_success)")
        if _close(queue, _S0["queue_us"] / _S0["success"] / 1000, 0.1) or _close(
                queue, (_S0["queue_us"] + _S_REQ * _S_QUEUE_US) / (_S0["success"] + _S_REQ) / 1000, 0.05):
            raise Wrong("avg_queue_ms: that is the average since the server started; use the differences "
                        "between the snapshots")
        raise Wrong(f"avg_queue_ms = {queue:g}: Δ queue µs / Δ successful requests / 1000")


q4 = Exercise(
    name="05.4 read a metrics snapshot",
    var="snapshot",
    grade=_grade_snapshot,
    hints=[
        "Counters mean something only as differences: subtract SNAPSHOT_BEFORE's value from SNAPSHOT_AFTER's "
        "(prometheus.parse_exposition reads the text for you).",
        "qps = Δ requests / seconds; average batch = Δ inferences / Δ executions; average queue time = "
        "Δ queue µs / Δ requests.",
        "Requests carry 2 inferences each here: nv_inference_count is not nv_inference_request_success.",
    ],
    solution_text=(
        "from lab_utils.monitoring.prometheus import parse_exposition\n"
        "def values(text):\n"
        '    return {labels["__name__"]: v for labels, v in parse_exposition(text)}\n'
        "b, a = values(SNAPSHOT_BEFORE), values(SNAPSHOT_AFTER)\n"
        "d = {k: a[k] - b[k] for k in a}\n"
        'snapshot = {"qps": d["nv_inference_request_success"] / SNAPSHOT_SECONDS,\n'
        '            "avg_batch": d["nv_inference_count"] / d["nv_inference_exec_count"],\n'
        '            "avg_queue_ms": d["nv_inference_queue_duration_us"] / d["nv_inference_request_success"] / 1000}'
    ),
)

# --- q5: where does the time go? -------------------------------------------------------------------------------

Q5_CHOICES = ("queue", "compute", "outside")
# Five-minute averages per request, from rate() of Triton's duration counters, and what else a dashboard shows.
Q5_MODELS = {
    "detector": {"instances": 1, "queue_ms": 46.0, "compute_infer_ms": 6.1, "server_request_ms": 53.0,
                 "client_p50_ms": 55.0, "gpu_util_pct": 34},
    "ranker": {"instances": 2, "queue_ms": 1.2, "compute_infer_ms": 38.5, "server_request_ms": 40.4,
               "client_p50_ms": 43.0, "gpu_util_pct": 97},
    "embedder": {"instances": 2, "queue_ms": 0.4, "compute_infer_ms": 2.9, "server_request_ms": 3.6,
                 "client_p50_ms": 61.0, "gpu_util_pct": 22},
}
_Q5 = {"detector": "queue", "ranker": "compute", "embedder": "outside"}
_Q5_WHY = {
    "detector": "46 of its 53 server-side ms are spent waiting in the queue while the GPU is 34 % busy: one "
                "instance cannot keep up. Add instances or allow larger batches (dynamic batching), not a faster GPU.",
    "ranker": "its requests barely queue (1.2 ms) and spend 38.5 ms computing with the GPU at 97 %: the model "
              "itself is the limit. A faster model (TensorRT, lower precision) or more GPUs help; more instances "
              "on the same GPU do not.",
    "embedder": "the server spends only 3.6 ms on a request but clients wait 61 ms: the time goes outside "
                "Triton (network, serialization, the client's own queue). Look at the client and the path to it.",
}


def _grade_bottleneck(value: Any) -> None:
    if not isinstance(value, Mapping) or set(value) != set(Q5_MODELS):
        raise Wrong(f"give a dict with one answer per model: {{{', '.join(repr(m) + ': ...' for m in Q5_MODELS)}}}")
    for model, expected in _Q5.items():
        got = value[model]
        if not isinstance(got, str) or got.strip().lower() not in Q5_CHOICES:
            raise Wrong(f"{model}: answer one of {list(Q5_CHOICES)}")
        if got.strip().lower() != expected:
            raise Wrong(f"{model} is not {got.strip().lower()!r}: {_Q5_WHY[model]}")


q5 = Exercise(
    name="05.5 find the bottleneck",
    var="bottleneck",
    grade=_grade_bottleneck,
    hints=[
        "Split each model's time: queue_ms + compute ≈ the server's request time; the client's latency adds "
        "what happens outside the server.",
        "A long queue with an idle GPU means too little capacity configured; a short queue with a busy GPU "
        "means the model itself is slow.",
        "When the server's time is small but the client's is large, the server is not where the time goes.",
    ],
    solution_text=(
        'bottleneck = {"detector": "queue", "ranker": "compute", "embedder": "outside"}\n'
        "# detector: queue 46 of 53 ms with the GPU 34 % busy -> more instances / larger batches\n"
        "# ranker: compute 38.5 ms, GPU 97 % -> a faster model or more GPUs\n"
        "# embedder: server 3.6 ms, client 61 ms -> network, serialization or the client"
    ),
)
