"""Lab 05 exercises: PromQL, an alert rule, a watchdog, alert thresholds, reading metrics, finding the bottleneck.

Four of the seven are code that the check executes against the real component: q1 and q2 (PromQL) are graded by a
Prometheus serving recorded samples (``RECORDED``, evaluated at ``GRADING_TIMES``), q4 (an alerting rule) by
``promtool test rules`` over ``ALERT_SERIES``, q5 (a watchdog loop) against a real Triton server that the check
kills and hangs. q3, q6 and q7 take numbers or choices from fixed data in this module. Without prometheus and
promtool the PromQL and rule checks say how to install them instead of grading; without a Triton server binary
the watchdog check is not applicable.

Design notes: docs/internals.md#lab_utilsexerciseslab05py
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import math
import os
import random
import re
import signal
import subprocess
import threading
import time
import urllib.error
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from lab_utils.course.probe import find_prometheus
from lab_utils.exercises.framework import (
    CodeExercise,
    Exercise,
    NotApplicable,
    Outcome,
    References,
    Status,
    StudentLine,
    StudentThread,
    StudentTimeout,
    Wrong,
    choice,
    is_blank,
    match_slip,
    number,
    raised_message,
)
from lab_utils.monitoring import prometheus
from lab_utils.procs import free_port, owned_tempdir, temporary_folder, wait_until
from lab_utils.serving import server as triton_server

__all__ = [
    "q1", "q2", "q3", "q4", "q5", "q6", "q7",
    "RECORDED", "RECORDING_START", "GRADING_TIMES",
    "BASELINE_P99_MS", "INCIDENT_P99_MS", "BASELINE_PENDING", "INCIDENT_PENDING", "HEADROOM",
    "SNAPSHOT_BEFORE", "SNAPSHOT_AFTER", "SNAPSHOT_SECONDS",
    "BOTTLENECK_MODELS", "BOTTLENECK_CHOICES",
    "ALERT_SERIES", "ALERT_STEP_S", "ALERT_END_S", "ALERT_BURST_S", "ALERT_OVERLOAD_S", "ALERT_THRESHOLD_MS",
    "alert_series_frame", "WATCHDOG_SETTINGS", "WatchedServer",
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


def _recorded_samples(start: float = RECORDING_START, servers: Sequence[tuple[str, float]] = _SERVERS,
                      models: Mapping[str, Mapping[str, Any]] = _MODELS,
                      restart: tuple[int, int] | None = None) -> list[prometheus.Sample]:
    """The samples of ``servers`` serving ``models`` from ``start``; a model may split its requests over
    ``versions`` ({version: share}, default all "1"). ``restart`` = (server, step): that server restarts just
    before that scrape, its counters starting again from 0."""
    rows: list[prometheus.Sample] = []
    versions = {m: dict(spec.get("versions", {"1": 1.0})) for m, spec in models.items()}
    totals = {(s, m, v): [_START_REQUESTS * vs, _START_REQUESTS * vs * _START_LATENCY_MS * 1000]
              for s in range(len(servers)) for m in models for v, vs in versions[m].items()}  # requests, time (us)
    for step in range(_PHASES * _PHASE_S // _STEP_S + 1):
        t = start + step * _STEP_S
        phase = max(0, step - 1) * _STEP_S // _PHASE_S  # the phase of the 15 s that end at t
        for s, (instance, share) in enumerate(servers):
            rows.append(({"__name__": "up", "job": "triton", "instance": instance}, t, 1.0))
            for j, (model, m) in enumerate(models.items()):
                for version, v_share in versions[model].items():
                    total = totals[(s, model, version)]
                    if restart == (s, step):
                        total[0] = total[1] = 0.0
                    if step:
                        wobble = 1 + 0.2 * math.sin(1.3 * step + 2.1 * s + 0.7 * j)
                        n = m["qps"][phase] * share * v_share * _STEP_S * wobble
                        total[0] += n
                        total[1] += n * m["latency_ms"][phase][s] * 1000 * (1 + 0.1 * math.cos(0.9 * step + s + j))
                    requests, busy_us = total
                    labels = {"job": "triton", "instance": instance, "model": model, "version": version}
                    values = {
                        "nv_inference_request_success": requests,
                        "nv_inference_count": requests * m["inferences"],
                        "nv_inference_exec_count": requests * m["inferences"] / m["per_exec"],
                        "nv_inference_request_duration_us": busy_us,
                        "nv_inference_queue_duration_us": busy_us * _QUEUE_SHARE,
                        "nv_inference_compute_infer_duration_us": busy_us * _COMPUTE_SHARE,
                        # Little's law: requests in the queue = arrival rate x time queued
                        "nv_inference_pending_request_count": round(
                            m["qps"][phase] * share * v_share * m["latency_ms"][phase][s] / 1000 * _QUEUE_SHARE),
                    }
                    for name, v in values.items():
                        rows.append(({"__name__": name, **labels}, t, v))
                    rows.append(({"__name__": "nv_inference_request_failure", **labels, "reason": "BACKEND"}, t,
                                 0.0))
    return rows


RECORDED = tuple(_recorded_samples())


# A second recording, drawn afresh for every check and never shown: three servers, bert in two versions, other
# batch sizes and loads, and one server restarting (its counters drop to 0) within a minute before a grading
# time. A query that is right gives the reference's numbers here too; one that is right only by a coincidence of
# RECORDED (two servers, two requests per execution) or that ignores counter resets does not.
_HIDDEN_START = RECORDING_START + 4 * 3600  # hours after RECORDED: no window reaches back into it
_HIDDEN_TIMES = tuple(_HIDDEN_START + _PHASE_S * (i + 1) for i in range(_PHASES))
_HIDDEN_WHAT = ("a second recording the check draws afresh each time (three servers, bert in two versions, other "
                "batch sizes, and a server restart that resets its counters)")


def _hidden_samples(rng: random.Random) -> list[prometheus.Sample]:
    shares = [rng.uniform(1.0, 3.0) for _ in range(3)]
    servers = tuple((f"10.0.1.{i + 11}:8002", w / sum(shares)) for i, w in enumerate(shares))

    def load(low: float, high: float, ms: tuple[float, float]) -> dict[str, Any]:
        return {"qps": tuple(rng.uniform(low, high) for _ in range(_PHASES)),
                "latency_ms": tuple(tuple(rng.uniform(*ms) for _ in servers) for _ in range(_PHASES))}

    first = rng.uniform(0.5, 0.8)
    models = {"resnet50": {**load(60, 240, (15, 60)), "inferences": 6, "per_exec": rng.choice((8, 16))},
              "bert": {**load(20, 80, (6, 20)), "inferences": 3, "per_exec": rng.choice((4, 12)),
                       "versions": {"1": first, "2": 1 - first}}}
    phase = rng.randrange(1, _PHASES)  # the restart lands 15 to 45 s before the end of this phase
    restart = (rng.randrange(len(servers)), (phase + 1) * _PHASE_S // _STEP_S - rng.randint(1, 3))
    return _recorded_samples(_HIDDEN_START, servers, models, restart)


# --- grading a query with Prometheus ------------------------------------------------------------------------

Labels = tuple[tuple[str, str], ...]
Values = dict[float, dict[Labels, float]]  # {unix time: {series labels: value}}


def _at(t: float) -> str:
    if t >= _HIDDEN_START:
        return f"{(t - _HIDDEN_START) / 60:g}m into the second recording"
    return f"{(t - RECORDING_START) / 60:g}m"


def _evaluate(server: prometheus.PromAPI, expr: str) -> Values:
    """``expr`` at every grading time of both recordings, as Prometheus answers it; Wrong with Prometheus' words
    when it refuses."""
    out: Values = {t: {} for t in (*GRADING_TIMES, *_HIDDEN_TIMES)}
    for times in (GRADING_TIMES, _HIDDEN_TIMES):
        try:
            df = server.query_range(expr, times[0], times[-1], _PHASE_S)
        except prometheus.QueryError as err:
            if "range vector" in err.why and "range query" in err.why:
                raise Wrong("that is a range vector (metric[1m]: the raw samples of a window); wrap it in a function "
                            "such as rate()") from None
            raise Wrong(f"Prometheus refuses it: {err.why}") from None
        names = [c for c in df.columns if c not in ("time", "value", "__name__")]
        for r in df.to_dict("records"):
            labels = tuple(sorted((k, r[k]) for k in names if isinstance(r[k], str)))
            out.setdefault(round(r["time"], 3), {})[labels] = r["value"]
    return out


def _visible(values: Values) -> Values:
    """``values`` at the grading times of ``RECORDED``, the recording the student sees."""
    return {t: v for t, v in values.items() if t < _HIDDEN_START}


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
        hint = match_slip(k, why, 1e-3) or ""
        raise Wrong(f"your values are {k:.4g}x the reference's at every time{hint}")
    matching = [t for t in want if all(math.isclose(proj[t].get(k, math.nan), v, rel_tol=1e-6)
                                       for k, v in want[t].items())]
    t = next((t for t in want if t not in matching), GRADING_TIMES[-1])
    if matching:
        raise Wrong(f"it agrees with the reference at {', '.join(map(_at, matching))} but not at {_at(t)} "
                    f"({_show(proj[t])} instead of {_show(want[t])}): the question asks for a [1m] window")
    raise Wrong(f"at {_at(t)} it gives {_show(proj[t])} where {what} is {_show(want[t])}")


_DELTA = re.compile(r"\b(i?delta)\s*\(")


def _no_delta(expr: str) -> None:
    """``Wrong`` for delta()/idelta() in ``expr``: every series the questions use is a counter."""
    m = _DELTA.search(expr)
    if m:
        fn = m.group(1)
        raise Wrong(f"{fn}() is for gauges (a value that goes up and down); these are counters. On a counter "
                    f"{fn}() breaks when a server restarts: the counter drops to 0 and {fn}() reports a huge negative "
                    f"change. rate() (per second) or increase() (per window) account for counter resets: "
                    f"use {'rate' if fn == 'delta' else 'irate'}()")


def _grade_query(expr: Any, reference: str, mistakes: Sequence[tuple[str, str]], what: str) -> None:
    """Grade ``expr`` against ``reference`` with a Prometheus serving ``RECORDED`` and a second recording drawn
    here (started and stopped here)."""
    if not isinstance(expr, str) or not expr.strip():
        raise Wrong(f"give the PromQL expression as a string, e.g. 'rate(metric[1m])', not {type(expr).__name__}")
    _no_delta(expr)
    with prometheus.recorded_server([*RECORDED, *_hidden_samples(random.Random())]) as server:
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
    seen, hidden = _visible(got), {t: v for t, v in got.items() if t >= _HIDDEN_START}
    if _same(seen, _visible(want)):
        proj = _project(hidden, _label_names(want)) or {}
        t = next((t for t in _HIDDEN_TIMES if not _same({t: hidden.get(t, {})}, {t: want[t]})), _HIDDEN_TIMES[-1])
        shown = _show(proj.get(t, hidden.get(t, {})))
        raise Wrong(f"it gives the reference's numbers on ex.RECORDED, but not on {_HIDDEN_WHAT}: at {_at(t)} it "
                    f"gives {shown} where {what} is {_show(want[t])}. A query right only "
                    "because of how ex.RECORDED happens to be (two servers, two requests per execution, no restart) "
                    "is not the question's quantity")
    _diagnose(seen, _visible(want), what)


@dataclass
class PrometheusExercise(Exercise):
    """An exercise graded by Prometheus' own tools (``tools``: a query by prometheus and promtool, an alerting
    rule by promtool). Where one is missing, the check says how to install it instead of grading (the answer is
    not judged); ``graded_by`` says what would have graded it."""

    tools: tuple[str, ...] = ("prometheus", "promtool")
    graded_by: str = "Prometheus grades this query"

    def _outcome(self, value: Any) -> Outcome:
        why = prometheus.missing(*self.tools)
        if why is None or is_blank(value):
            return super()._outcome(value)
        return Outcome(self.name, Status.NOT_ATTEMPTED, f"`{self.var}` was not checked ({self.graded_by}): {why}")


def _window_slips(expr: str, what: str) -> list[tuple[str, str]]:
    return [(expr.replace("[1m]", f"[{w}]"), f"that is {what} over a {w} window; the question asks for [1m]")
            for w in ("30s", "2m", "5m", "10m")]


def _per_request(counter: str, per: str = "nv_inference_request_success", unit: str = " / 1000") -> str:
    """PromQL: the [1m] rate of ``counter`` over that of ``per``, each summed by model (``unit``: µs to ms)."""
    return f"sum by (model) (rate({counter}[1m])) / sum by (model) (rate({per}[1m])){unit}"


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

q1 = PrometheusExercise(
    name="05.1 QPS in PromQL", var="qps_query",
    grade=functools.partial(_grade_query, reference=_QPS, mistakes=_QPS_SLIPS, what="the requests per second"),
    hints=[
        "Triton counts successful requests in a counter; a counter only grows, so look at how fast it grows.",
        "rate(counter[1m]) is the per-second increase averaged over the last minute; sum by (model) adds up the "
        "series of one model (its servers and versions).",
        "Put together: the [1m] rate of nv_inference_request_success, inside a sum by (model).",
    ],
    solution_text=(
        'qps_query = "sum by (model) (rate(nv_inference_request_success[1m]))"\n'
        "# requests, not inferences (nv_inference_count) or executions (nv_inference_exec_count)"
    ),
)

# --- q2: average latency in PromQL ------------------------------------------------------------------------------

_LATENCY = _per_request("nv_inference_request_duration_us")
_LATENCY_SLIPS = [
    (_per_request("nv_inference_request_duration_us", unit=""),
     "that is in microseconds (Triton's *_duration_us): your values are 1000x the reference; divide by 1000 for ms"),
    ("sum by (model) (nv_inference_request_duration_us) / sum by (model) (nv_inference_request_success) / 1000",
     "the counters themselves divided give the average since the server started; divide their rates to get the "
     "last minute's average"),
    (_per_request("nv_inference_queue_duration_us"),
     "that is only the time requests wait in the queue (nv_inference_queue_duration_us); the whole request is "
     "nv_inference_request_duration_us"),
    (_per_request("nv_inference_compute_infer_duration_us"),
     "that is only the model's compute (nv_inference_compute_infer_duration_us); the whole request is "
     "nv_inference_request_duration_us"),
    (_per_request("nv_inference_request_duration_us", "nv_inference_count"),
     "that divides by inferences (nv_inference_count); the latency of a request is request time over requests "
     "(nv_inference_request_success)"),
    (_per_request("nv_inference_request_duration_us", "nv_inference_exec_count"),
     "that is per execution (nv_inference_exec_count), not per request"),
    ("avg by (model) (rate(nv_inference_request_duration_us[1m]) / rate(nv_inference_request_success[1m])) / 1000",
     "that averages the servers' averages: the slower server, which serves 30 % of the requests, weighs as much "
     "as the other. Add the time and the requests up first, then divide (sum by (model) over sum by (model))"),
    *_window_slips(_LATENCY, "the average latency"),
]

q2 = PrometheusExercise(
    name="05.2 average latency in PromQL", var="latency_query",
    grade=functools.partial(_grade_query, reference=_LATENCY, mistakes=_LATENCY_SLIPS,
                            what="the average latency in ms"),
    hints=[
        "Triton adds every request's duration (µs) to a counter and counts the requests in another: their "
        "ratio is an average.",
        "Divide the two rates over the same [1m] window, each summed by model first (not the counters themselves: "
        "that is the average since the server started), then convert µs to ms.",
        "Numerator: the [1m] rate of nv_inference_request_duration_us summed by model; denominator: the same for "
        "nv_inference_request_success; the quotient over 1000.",
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
# A threshold at least this much above the healthy peak: a healthy hour's maximum is one sample, and the next
# healthy hour's peak lands a little higher or lower; just above it pages on a normal busy minute.
HEADROOM = 0.2


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
        if got < (1 + HEADROOM) * low:
            above = 100 * (got / low - 1)
            raise Wrong(f"{what} = {got:g}{unit} is only {above:.1f} % above the healthy hour's peak ({low:g}{unit}): "
                        "one sample of one hour, and the next healthy hour peaks a little higher, so this pages on a "
                        f"normal busy minute. Leave at least {100 * HEADROOM:g} % headroom: {what} >= "
                        f"{(1 + HEADROOM) * low:g}{unit}")
        if got >= high:
            raise Wrong(f"{what} = {got:g}{unit}: the overload never stays above it, so the alert would sleep "
                        f"through the incident; stay below the overload's lowest minute")


q3 = Exercise(
    name="05.3 alert thresholds from a baseline", var="thresholds", grade=_grade_thresholds,
    hints=[
        "An alert threshold sits between normal and broken: above everything a healthy hour shows, below "
        "what an incident shows.",
        "Look at max(BASELINE_P99_MS) and the lowest value of INCIDENT_P99_MS once the overload started "
        "(from minute 20); the same for pending requests.",
        "Leave headroom above the healthy maximum, at least 20 % (the check's ex.HEADROOM), e.g. about 1.5x it, "
        "checking it stays below the incident's minimum.",
    ],
    solution_text=(
        "p99_cap = min(INCIDENT_P99_MS[20:]); pending_cap = min(INCIDENT_PENDING[20:])\n"
        'thresholds = {"p99_ms": min(1.5 * max(BASELINE_P99_MS), (max(BASELINE_P99_MS) + p99_cap) / 2),\n'
        '              "pending": min(1.5 * max(BASELINE_PENDING), (max(BASELINE_PENDING) + pending_cap) / 2)}'
    ),
)

# --- q4: an alert rule, graded by promtool test rules -------------------------------------------------------

# Fourteen minutes of one Triton server's counters, scraped every 15 s, for two models. bert is calm (requests
# wait about 30 ms in the queue) except for one burst: in the 15 s before 4m15s its requests waited 2.4 s. resnet50
# is calm until minute 6, then overloaded to the end: its queue time climbs from 200 to 400 ms. Each request also
# computes (bert 80 ms, resnet50 50 ms), so the whole request of a calm bert takes over 100 ms.
ALERT_STEP_S, ALERT_END_S = 15, 840
ALERT_BURST_S = 255  # bert's slow scrape interval ends here (4m15s)
ALERT_OVERLOAD_S = 360  # resnet50 overloaded from here (6m) to the end
ALERT_THRESHOLD_MS = 100
_ALERT_INSTANCE = {"job": "triton", "instance": "10.0.0.7:8002", "version": "1"}
_ALERT_MODELS: dict[str, dict[str, float]] = {
    "bert": {"qps": 40, "queue_ms": 30, "compute_ms": 80, "inferences": 2},
    "resnet50": {"qps": 120, "queue_ms": 25, "compute_ms": 50, "inferences": 4},
}


def _alert_queue_ms(model: str, step: int) -> float:
    """Queue time per request (ms) in the 15 s scrape interval that ends at ``step`` x 15 s."""
    t = step * ALERT_STEP_S
    j = list(_ALERT_MODELS).index(model)
    calm = _ALERT_MODELS[model]["queue_ms"] * (1 + 0.15 * math.sin(0.8 * step + 1.7 * j))
    if model == "bert" and t == ALERT_BURST_S:
        return 2400.0
    if model == "resnet50" and t > ALERT_OVERLOAD_S:
        return 200 + 200 * (t - ALERT_OVERLOAD_S) / (ALERT_END_S - ALERT_OVERLOAD_S) * (1 + 0.05 * math.sin(step))
    return calm


def _alert_counters() -> dict[str, dict[str, list[float]]]:
    """{model: {metric: [counter value at each scrape]}}: what the server exported, every 15 s from 0 to 14m."""
    out: dict[str, dict[str, list[float]]] = {}
    for j, (model, m) in enumerate(_ALERT_MODELS.items()):
        req, queue_us, compute_us, inferences = 1_000_000.0, 1e6 * 10_000, 1e6 * 40_000, 1e6 * m["inferences"]
        rows: dict[str, list[float]] = {}
        for step in range(ALERT_END_S // ALERT_STEP_S + 1):
            if step:
                n = round(m["qps"] * ALERT_STEP_S * (1 + 0.1 * math.sin(1.1 * step + j)))
                req += n
                inferences += n * m["inferences"]
                queue_us += round(n * _alert_queue_ms(model, step) * 1000)
                compute_us += round(n * m["compute_ms"] * 1000)
            for name, v in (("nv_inference_request_success", req), ("nv_inference_count", inferences),
                            ("nv_inference_queue_duration_us", queue_us),
                            ("nv_inference_compute_infer_duration_us", compute_us),
                            ("nv_inference_request_duration_us", queue_us + compute_us)):
                rows.setdefault(name, []).append(v)
        out[model] = rows
    return out


ALERT_SERIES = _alert_counters()


def alert_series_frame() -> pd.DataFrame:
    """``ALERT_SERIES`` per scrape interval: minute, model, queue and request time per request (ms) in the 15 s
    before it. (The alert itself averages over [1m]: four of these intervals.)"""
    rows = []
    for model, s in ALERT_SERIES.items():
        req, queue, whole = (s[k] for k in ("nv_inference_request_success", "nv_inference_queue_duration_us",
                                            "nv_inference_request_duration_us"))
        for i in range(1, len(req)):
            n = req[i] - req[i - 1]
            rows.append({"minute": i * ALERT_STEP_S / 60, "model": model,
                         "queue_ms": (queue[i] - queue[i - 1]) / n / 1000,
                         "request_ms": (whole[i] - whole[i - 1]) / n / 1000})
    return pd.DataFrame(rows)


def _input_series() -> list[dict[str, str]]:
    """``ALERT_SERIES`` as promtool's input_series."""
    out = []
    for model, metrics in ALERT_SERIES.items():
        labels = ", ".join(f'{k}="{v}"' for k, v in {**_ALERT_INSTANCE, "model": model}.items())
        for name, values in metrics.items():
            out.append({"series": f"{name}{{{labels}}}", "values": " ".join(f"{v:.0f}" for v in values)})
    return out


_ALERT_BASE = _per_request("nv_inference_queue_duration_us")
_SEVERITIES = ("warning", "critical")
_DURATION = re.compile(r"^(?:(\d+)(ms|s|m|h|d|w|y))+$")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def _the_rule(value: Any) -> dict[str, Any]:
    """The one alerting rule in the answer: YAML text (a rule, a list of one, or a rules file) or a dict."""
    if isinstance(value, str):
        import yaml

        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as err:
            where = getattr(err, "problem_mark", None)
            at = f" (line {where.line + 1})" if where is not None else ""
            raise Wrong(f"that is not valid YAML{at}: {getattr(err, 'problem', None) or err}. Indent the keys "
                        "under the rule and quote text that contains ': '") from None
    if isinstance(value, Mapping) and "groups" in value:
        value = [r for g in value.get("groups") or [] for r in (g.get("rules") or [])]
    if isinstance(value, list):
        rules = [r for r in value if isinstance(r, Mapping) and "alert" in r]
        if len(rules) != 1:
            raise Wrong(f"give one alerting rule (found {len(rules)} with an `alert:` key)")
        value = rules[0]
    if not isinstance(value, Mapping):
        raise Wrong("give the rule as YAML text (alert:, expr:, for:, labels:) or as a dict with those keys")
    if "record" in value and "alert" not in value:
        raise Wrong("that is a recording rule (record:): it stores a series and never fires. An alerting rule "
                    "starts with `alert: <name>`")
    missing = [k for k in ("alert", "expr") if not value.get(k)]
    if missing:
        raise Wrong(f"the rule has no {' and no '.join(missing)}: an alerting rule needs `alert: <name>` and "
                    "`expr: <PromQL that returns the series in trouble>`")
    if not isinstance(value["alert"], str) or not isinstance(value["expr"], str):
        raise Wrong("`alert:` and `expr:` should be text")
    return dict(value)


def _promtool_passes(rule_file: Path, probes: Mapping[str, Sequence[tuple[str, float, float]]]) -> dict[str, bool]:
    """For each probe (a list of (PromQL, eval time s, expected value) that must all hold), whether promtool's
    rule test passes: the rule evaluated every 15 s over ``ALERT_SERIES`` as Prometheus would. One promtool
    process per probe, all at once: the exit code is the verdict."""
    tool = find_prometheus("promtool")
    if tool is None:
        raise prometheus.PrometheusMissing(prometheus.missing("promtool") or "promtool not found")
    series = _input_series()
    procs = {}
    for name, checks in probes.items():
        test = {"rule_files": [rule_file.name], "evaluation_interval": f"{ALERT_STEP_S}s",
                "tests": [{"interval": f"{ALERT_STEP_S}s", "input_series": series,
                           "promql_expr_test": [{"expr": expr, "eval_time": f"{t:.0f}s",
                                                 "exp_samples": [{"labels": "{}", "value": v}]}
                                                for expr, t, v in checks]}]}
        path = rule_file.parent / f"probe_{name}.yml"
        path.write_text(json.dumps(test))
        procs[name] = subprocess.Popen([tool, "test", "rules", path.name], cwd=rule_file.parent,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = {}
    for name, p in procs.items():
        try:
            out[name] = p.wait(timeout=120) == 0
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise RuntimeError(f"promtool test rules did not finish in 120 s (probe {name})") from None
    return out


def _firing(name: str, model: str, window_s: float) -> str:
    """1 when alert ``name`` was firing for ``model`` at some evaluation in the window, else 0."""
    sel = f'ALERTS{{alertname={json.dumps(name)}, alertstate="firing", model="{model}"}}'
    return f"max(max_over_time({sel}[{window_s:.0f}s])) or vector(0)"


def _matches(expr: str, candidate: str) -> list[tuple[str, float, float]]:
    """Checks that hold when every value the rule's expression returned from minute 5 on (once a 5m window is full)
    equals ``candidate``'s, for some evaluation at least: the rule computes ``candidate``."""
    ratio = f"abs(max by (model) ((\n{expr}\n)) / on (model) ({candidate}) - 1)"
    window = f"[{ALERT_END_S - 300}s:{ALERT_STEP_S}s]"
    return [(f"max_over_time((clamp_max(count({ratio} < 0.001), 1)){window}) or vector(0)", ALERT_END_S, 1),
            (f"max_over_time((clamp_max(count({ratio} >= 0.001), 1)){window}) or vector(0)", ALERT_END_S, 0)]


_ALERT_SLIPS = (
    (f"60 * ({_ALERT_BASE})",
     "increase() where the per-second rate() belongs: the queue time summed over the minute is 60x its rate, so "
     "the average came out 60x too high and the alert fires on calm bert (about 30 ms a request). Divide rate by "
     "rate, or increase by increase over the same window"),
    (f"1000 * ({_ALERT_BASE})",
     "your expression is in microseconds (Triton's *_duration_us) and the threshold in ms: calm bert's 30 ms is "
     "30000 µs > 100, so it fires all the time. Divide by 1000, or compare with 100000"),
    (_LATENCY,
     "that is the whole request's time (nv_inference_request_duration_us: queue + compute), and calm bert "
     "computes 80 ms a request, so it fires without any queueing. The question is about queueing: "
     "nv_inference_queue_duration_us"),
    ("sum by (model) (rate(nv_inference_queue_duration_us[1m])) / 1000",
     "that is milliseconds of queueing per second (all requests together), not per request: divide by the "
     "request rate, sum by (model) (rate(nv_inference_request_success[1m]))"),
    (_ALERT_BASE.replace("[1m]", "[5m]"),
     "a 5m window keeps bert's burst in the average for five minutes, long enough to outlast `for:`, so it "
     "fires on a burst that was over minutes ago; the question asks for [1m]"),
)


def _same_times(expr: str) -> list[tuple[str, float, float]]:
    """A check that holds when ``expr`` returns a series for the same models at every evaluation as the queue time
    per request > the threshold does: its condition is the question's."""
    def models(e: str) -> str:
        return f"(count(count by (model) ((\n{e}\n))) or vector(0))"

    differs = f"{models(expr)} != bool {models(f'{_ALERT_BASE} > {ALERT_THRESHOLD_MS}')}"
    return [(f"max_over_time(({differs})[{ALERT_END_S}s:{ALERT_STEP_S}s])", ALERT_END_S, 0)]


def _behaviour(rule_file: Path, name: str, expr: str) -> dict[str, bool]:
    end, over, burst = ALERT_END_S, ALERT_OVERLOAD_S, ALERT_BURST_S
    return _promtool_passes(rule_file, {
        # the condition holds exactly when the question's does, and the values are the queue time (ms or µs)
        "same_times": _same_times(expr),
        "values_ms": _matches(expr, _ALERT_BASE),
        "values_us": _matches(expr, f"1000 * ({_ALERT_BASE})"),
        # firing in the overload's last five minutes (before, a rule that fires on low values may still fire)
        "fires_on_overload": [(_firing(name, "resnet50", 300), end, 1)],
        "calm_before_overload": [(_firing(name, "resnet50", over), over, 0)],
        "calm_on_bert": [(_firing(name, "bert", end), end, 0)],
        "fires_on_burst": [(_firing(name, "bert", 180), burst + 165, 1)],
        "calm_on_bert_but_burst": [(_firing(name, "bert", burst - 15), burst - 15, 0),
                                   (_firing(name, "bert", end - burst - 165), end, 0)],
        "fires_without_model": [(_firing(name, "", end), end, 1)],
    })


def _grade_alert_rule(value: Any) -> str:
    rule = _the_rule(value)
    name = rule["alert"]
    picked = re.search(r'\bmodel\s*(=~|!~|!=|=)\s*"[^"]*"', rule["expr"])
    if picked:
        raise Wrong(f"the expression keeps only some models ({picked.group(0)}): the alert must watch every model "
                    "the server serves, including the ones deployed next week. Drop the matcher")
    _no_delta(rule["expr"])
    for_text = str(rule.get("for", "0s"))
    for_s = (sum(int(n) * _UNIT_S[u] for n, u in re.findall(r"(\d+)(ms|s|m|h|d|w|y)", for_text))
             if _DURATION.match(for_text.strip()) else None)  # seconds of a Prometheus duration ("1m30s"), or None
    labels = rule.get("labels") or {}
    with temporary_folder("alert") as tmp:
        rule_file = tmp / "student_rules.yml"
        rule_file.write_text(json.dumps({"groups": [{"name": "student", "rules": [rule]}]}, indent=2, default=str))
        try:
            prometheus.check_rules(rule_file)
        except prometheus.ConfigError as err:
            said = str(err).split("FAILED:", 1)[-1].strip()
            said = re.sub(r'^.*?group "student", rule \d+(, "[^"]*")?: ', "", said.splitlines()[0] if said else "")
            raise Wrong(f"promtool check rules refuses it: {said or err}") from None
        seen = _behaviour(rule_file, name, rule["expr"])
        calm = seen["calm_on_bert"] and seen["calm_before_overload"]
        slips = {}
        if not calm:  # the condition held on a calm series: is it a known slip? (its values tell)
            slips = _promtool_passes(rule_file, {f"slip{i}": _matches(rule["expr"], cand)
                                                 for i, (cand, _) in enumerate(_ALERT_SLIPS)})
    fired_on_burst = seen["fires_on_burst"] and not seen["calm_on_bert"]
    if seen["fires_without_model"]:
        raise Wrong("its alerts carry no model label: `sum(...)` without `by (model)` adds the models together, so "
                    "the page cannot say which model is in trouble (and a calm model dilutes the overloaded one). "
                    "Keep the model: sum by (model) (...)")
    if for_s is None or for_s == 0:
        spike = (f" It fired on bert's burst at {ALERT_BURST_S // 60}m{ALERT_BURST_S % 60}s: a single slow scrape "
                 "interval, over within a minute, would have paged someone." if fired_on_burst else "")
        raise Wrong(f"no `for:`: the alert fires at the first evaluation where the condition holds.{spike} Add "
                    "`for: 2m` so that the condition must hold for two minutes")
    if not calm:
        for i, (_, message) in enumerate(_ALERT_SLIPS):
            if slips.get(f"slip{i}"):
                raise Wrong(message)
        if not seen["fires_on_overload"]:
            raise Wrong("the comparison points the wrong way: it fires while the queue time is low (calm bert, "
                        "resnet50 before minute 6) and never during the overload. An alert expression returns the "
                        "series that are in trouble: queue time > 100")
        if " bool " in f" {rule['expr']} ":
            raise Wrong("`bool` turns the comparison into 0 or 1 for every series, and an alert fires for every "
                        "series its expression returns, 0 included: drop `bool`")
        if seen["calm_on_bert_but_burst"] and seen["calm_before_overload"] and fired_on_burst:
            raise Wrong(f"`for: {rule['for']}` is too short: it fired on bert's burst at {ALERT_BURST_S // 60}m"
                        f"{ALERT_BURST_S % 60}s, which keeps the one-minute average above 100 ms for only about "
                        "30 s. A longer `for:` (2m) rides out a blip and still catches the overload")
        where = "calm bert" if not seen["calm_on_bert"] else "resnet50 before its overload (minute 6)"
        raise Wrong(f"it fires on {where}, whose requests wait about 30 ms in the queue: check the threshold "
                    f"({ALERT_THRESHOLD_MS} ms), its unit, and that the expression is the queue time per request "
                    "over [1m]")
    if not seen["fires_on_overload"]:
        lasts = ALERT_END_S - ALERT_OVERLOAD_S
        if for_s >= lasts - 90:
            raise Wrong(f"`for: {rule['for']}` is longer than the overload had lasted when the recording ends "
                        f"({lasts // 60} minutes, the queue time above 100 ms from about 6m30s): it never fired. A "
                        "page that comes after the incident is no page; 2m is enough to ride out a blip")
        raise Wrong("it never fires on resnet50's overload (from minute 6 its requests wait 200 to 400 ms in the "
                    "queue): check the metric (nv_inference_queue_duration_us over nv_inference_request_success), "
                    "the units (µs -> ms) and the threshold")
    values_right = seen["values_ms"] or seen["values_us"]
    if not values_right:
        raise Wrong("it fires at the right times on these series, but the values it returns are not the queue time "
                    "per request (in ms, or in µs against 100000): e.g. twice it, against a threshold twice 100. "
                    "The alert carries its expression's value ({{ $value }} on the page), and another load would "
                    "fire it at other times: the queue-time counter's rate over the requests' rate, each summed "
                    "by model, / 1000 > 100")
    if not seen["same_times"]:
        raise Wrong(f"the expression is the queue time per request, but its condition holds at other evaluations "
                    f"than queue time > {ALERT_THRESHOLD_MS} ms does (it fires here, but with another threshold "
                    f"than the question's): compare with {ALERT_THRESHOLD_MS} (ms), or 100000 in µs")
    if "severity" not in labels:
        raise Wrong("it fires at the right times, but has no severity label: Alertmanager routes, groups and "
                    "silences alerts by their labels, and the course's rules say how urgent each one is with "
                    "`labels: {severity: warning}` (or critical)")
    if str(labels["severity"]).lower() not in _SEVERITIES:
        raise Wrong(f"severity {labels['severity']!r}: the course's rules (and their routing) use "
                    f"{' or '.join(_SEVERITIES)}")
    return (f"promtool test rules: it fires during resnet50's overload and stays silent on bert, its burst at "
            f"{ALERT_BURST_S // 60}m{ALERT_BURST_S % 60}s included (for: {rule['for']}).")


q4 = PrometheusExercise(
    name="05.4 an alert rule, tested by promtool", var="alert_rule", grade=_grade_alert_rule,
    tools=("promtool",), graded_by="promtool grades this rule",
    hints=[
        "An alerting rule has `alert:` (its name), `expr:` (PromQL returning the series in trouble: a comparison "
        "keeps the series for which it holds), `for:` (how long it must hold before the alert fires) and "
        "`labels:` (severity, for routing).",
        "The queue time per request is the queue-time counter's rate over the requests' rate, each summed by "
        "model, in ms: the same shape as exercise 2 with nv_inference_queue_duration_us. Then `> 100`.",
        "A one-minute burst must not page: `for: 2m`. And `labels: {severity: warning}`.",
    ],
    solution_text=(
        'alert_rule = """\n'
        "alert: TritonQueueTimeHigh\n"
        "expr: >-\n"
        "  sum by (model) (rate(nv_inference_queue_duration_us[1m]))\n"
        "  / sum by (model) (rate(nv_inference_request_success[1m])) / 1000 > 100\n"
        "for: 2m\n"
        "labels:\n"
        "  severity: warning\n"
        "annotations:\n"
        '  summary: "requests to {{ $labels.model }} wait {{ $value }} ms in the queue"\n'
        '"""'
    ),
)

# --- q5: a watchdog, graded against a real Triton server that the check kills --------------------------------

# What the check passes to the student's watchdog: short times, so that the whole check takes seconds.
WATCHDOG_SETTINGS = {"poll_s": 0.1, "timeout_s": 1.0, "failures": 2, "backoff_s": 0.1, "max_backoff_s": 2.0}
_CALL = "watchdog(server, stop, " + ", ".join(f"{k}={v:g}" for k, v in WATCHDOG_SETTINGS.items()) + ")"
# The bounds are generous: a verdict never depends on how loaded the machine is. A right watchdog restarts a
# killed or hung server within about a second, and returns within a poll after stop is set.
_HEALTHY_S = 0.8  # a ready server must not be restarted in this long
_QUIET_S = 0.8  # nor again in this long once it is back
_RESTART_WITHIN_S = 20.0  # a killed server restarted within this
_HUNG_WITHIN_S = 8.0  # a hung server (accepts connections, never answers) restarted within this
_READY_WITHIN_S = 120.0  # the restarted server ready again (the restart itself starts Triton)
_STORM_S = 3.0  # restarts failing: the attempts are counted over this long
_STORM_MAX = 7  # exponential backoff from 0.1 s tries about 5 times in 3 s; a fixed pause or none, 10 or more
_STOP_WITHIN_S = 5.0  # stop set -> the function returned


_ECHO_CONFIG = """name: "echo"
backend: "python"
max_batch_size: 8
input [{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] }]
output [{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] }]
instance_group [{ kind: KIND_CPU count: 1 }]
"""
_ECHO_MODEL = """import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT__0", pb_utils.get_input_tensor_by_name(r, "INPUT__0").as_numpy())]) for r in requests]
"""


@functools.cache
def _watchdog_repo() -> Path:
    """A repository with one small python-backend model that echoes its input (written once per process, removed
    at exit): the server the watchdog watches loads a model, as a real one does."""
    model = owned_tempdir("watchdog") / "repo" / "echo"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(_ECHO_CONFIG)
    (model / "1" / "model.py").write_text(_ECHO_MODEL)
    return model.parent


def watched_server(http_port: int, grpc_port: int, metrics_port: int) -> Any:
    """The real Triton server the watchdog watches, on fixed ports (its address survives a restart). The course's
    tests grade wrong watchdogs against a stand-in process with the same ``start/stop/restart/alive/ready/pid``."""
    return triton_server.TritonServer(_watchdog_repo(), http_port=http_port, grpc_port=grpc_port,
                                      metrics_port=metrics_port, startup_timeout_s=_READY_WITHIN_S, stop_grace_s=0.2)


class _Rig:
    """The check's Triton server (fixed ports, so its address survives a restart) and what a restart does in each
    phase: really restart it, or (``failing``) stop what is left and fail, as a start whose port is still taken."""

    def __init__(self) -> None:
        ports: set[int] = set()
        while len(ports) < 3:  # HTTP, gRPC and metrics: three different ones
            ports.add(free_port())
        http_port, grpc_port, metrics_port = ports
        self.server = watched_server(http_port, grpc_port, metrics_port)
        self.http_url = f"http://127.0.0.1:{http_port}"
        self.failing = False
        self.calls: list[list[Any]] = []  # [monotonic time of the call, whether the restart worked (None: under way)]
        self._lock = threading.Lock()
        self._closed = False

    def restart(self) -> None:
        with self._lock:
            if self._closed:
                raise StudentTimeout()  # the check is over: this ends the student's loop
            call = [time.monotonic(), None]  # counted from the moment it is asked for
            self.calls.append(call)
            try:
                if self.failing:
                    if self.server.alive():
                        self.signal(signal.SIGCONT)  # a stopped process handles no SIGTERM: let stop() end it
                    self.server.stop()
                    raise triton_server.ServerStartError(
                        "tritonserver exited with code 1 before it was ready (the port is still taken by the old "
                        "process)")
                self.server.restart()
            except BaseException:
                call[1] = False
                raise
            call[1] = True

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the server's main process (SIGKILL: a crash; SIGSTOP: a hang)."""
        pid = self.server.pid
        if pid is None or pid <= 0:
            raise RuntimeError("the check's server has no process")
        os.kill(pid, sig)

    def busy(self) -> bool:
        """True while a restart is under way."""
        return self._lock.locked()

    def close(self) -> None:
        """No restart from now on (waits for one under way); stop the server and everything it started."""
        with self._lock:
            self._closed = True
        if self.server.alive():  # a stopped ("hung") server must be able to exit
            with contextlib.suppress(OSError):
                self.signal(signal.SIGCONT)
        self.server.stop()


class WatchedServer:
    """The server as the student's watchdog sees it: ``http_url`` and ``restart()``, as a ``TritonServer`` has."""

    def __init__(self, rig: _Rig):
        self._rig = rig
        self.http_url = rig.http_url

    def restart(self) -> WatchedServer:
        """Stop the server (if it still runs) and start it again; raises when the start fails."""
        self._rig.restart()
        return self

    def __repr__(self) -> str:
        return f"<the check's Triton server at {self._rig.http_url}>"


class _StudentLoop(StudentThread):
    """The student's watchdog running in a thread until ``stop`` is set."""

    def __init__(self, fn: Callable[..., Any], server: WatchedServer, stop: threading.Event):
        self.last_seen: StudentLine | None = None  # where it was when it had to be interrupted
        self.started = time.monotonic()
        self.stop = stop
        super().__init__(fn, server, stop, name="student watchdog", **WATCHDOG_SETTINGS)

    def at(self) -> str:
        line = self.where() if self.thread.is_alive() else self.last_seen
        return f" (it was at {line})" if line else ""

    def ended(self) -> Wrong | None:
        """Why the loop is over while it should still watch; None while it runs (or when the check ended it)."""
        if self.thread.is_alive() or isinstance(self.error, StudentTimeout):
            return None
        err = self.error
        if err is None:
            after = (self.ended_at or time.monotonic()) - self.started
            return Wrong(f"{_CALL} returned after {after:.1f} s, while the server still needed watching: loop until "
                         "`stop` is set (while not stop.is_set(): ...)")
        message = raised_message(_CALL, err)
        if isinstance(err, (OSError, http.client.HTTPException)) and not isinstance(err, urllib.error.URLError):
            message += (". urlopen raises URLError only for what fails before the request is sent; a timeout or a "
                        "connection closed while waiting for the answer raises TimeoutError or ConnectionError: "
                        "catch OSError (URLError, HTTPError, refused connections and timeouts all are one)")
        elif isinstance(err, triton_server.ServerStartError):
            message += (". A restart can fail (the port still taken, a model that does not load): catch the "
                        "error, back off and try again")
        return Wrong(message)

    def wait(self, condition: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until ``condition()`` holds (True) or ``timeout_s`` passes (False); Wrong when the loop ends."""
        def holds() -> bool:
            if condition():
                return True
            gone = self.ended()
            if gone is not None:
                raise gone
            return False

        return wait_until(holds, timeout_s, 0.02)

    def end(self, timeout_s: float) -> None:
        """Set stop and wait for the loop; a loop that does not return is interrupted (best effort)."""
        self.stop.set()
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            self.last_seen = self.interrupt()
            self.thread.join(2.0)


def _server_unavailable() -> str | None:
    try:
        triton_server.find_server(local=True)
    except triton_server.ServerNotFound as err:
        return "this check runs your watchdog against a real Triton server, and there is none here. " + \
            str(err).splitlines()[0]
    return None


def _grade_watchdog(fn: Callable[..., Any]) -> str:
    rig = _Rig()
    try:
        rig.server.start()
    except Exception as err:
        rig.close()
        raise NotApplicable(f"the check's Triton server did not start here ({str(err).splitlines()[0]}); "
                            "your watchdog was not run") from None
    stop = threading.Event()
    loop = _StudentLoop(fn, WatchedServer(rig), stop)
    try:
        # 1. A ready server: leave it alone.
        if loop.wait(lambda: bool(rig.calls), _HEALTHY_S):
            raise Wrong(f"it restarted a healthy server (it answered 200 on /v2/health/ready) after "
                        f"{rig.calls[0][0] - loop.started:.1f} s: does your poll count HTTP 200 from "
                        "f'{server.http_url}/v2/health/ready' as ready? (/api/health/ready is Triton's old v1 "
                        "path: it answers 404)")
        # 2. Killed, as a crash would: restarted once, ready again, and then left alone.
        t_kill = time.monotonic()
        rig.signal(signal.SIGKILL)
        if not loop.wait(lambda: bool(rig.calls), _RESTART_WITHIN_S):
            raise Wrong(f"the server was killed and {_CALL} did not restart it within {_RESTART_WITHIN_S:g} s"
                        f"{loop.at()}: after `failures` failed polls in a row, call server.restart()")
        if not loop.wait(lambda: not rig.busy() and any(ok for _, ok in rig.calls) and rig.server.ready(),
                         _READY_WITHIN_S):
            raise Wrong(f"the server was not ready again within {_READY_WITHIN_S:g} s of the kill: every restart "
                        "failed")
        recovery_s = time.monotonic() - t_kill
        n = len(rig.calls)
        if loop.wait(lambda: len(rig.calls) > n, _QUIET_S):
            raise Wrong(f"the server was ready again {recovery_s:.1f} s after the kill, and {_CALL} restarted it "
                        f"again: {len(rig.calls)} restarts for one crash (a restart storm). Once a poll answers 200, "
                        "start counting failed polls from zero again")
        # 3. Hung: the process still holds the port and accepts connections, but never answers. From now on a
        # restart stops what is left of it and fails, as a start whose port is still taken would.
        n, t_hang = len(rig.calls), time.monotonic()
        rig.failing = True
        rig.signal(signal.SIGSTOP)
        if not loop.wait(lambda: len(rig.calls) > n, _HUNG_WITHIN_S):
            raise Wrong(f"the server hung (its process holds the port and accepts connections, but never answers) "
                        f"and {_CALL} did not restart it within {_HUNG_WITHIN_S:g} s{loop.at()}: give every request "
                        "a timeout, urlopen(url, timeout=timeout_s); without one a poll of a hung server waits "
                        "forever")
        t_first = rig.calls[n][0]
        hang_s = t_first - t_hang
        # 4. Every restart fails: try again, ever more slowly. The tries are counted for _STORM_S from the first.
        loop.wait(lambda: time.monotonic() - t_first >= _STORM_S, _STORM_S + 1)
        tries = sum(1 for t, _ in rig.calls[n:] if t - t_first <= _STORM_S)
        if tries > _STORM_MAX:
            gap = _STORM_S / (tries - 1)
            raise Wrong(f"a restart storm: while every restart failed, it tried {tries} times in {_STORM_S:g} s (one "
                        f"every {gap:.2f} s on average). After a failed restart wait backoff_s, double the wait after "
                        "each failure (at most max_backoff_s), and reset it once the server is ready again")
        # 5. Stop: the function returns promptly.
        loop.end(_STOP_WITHIN_S)
        if loop.thread.is_alive() or isinstance(loop.error, StudentTimeout):
            raise Wrong(f"{_CALL} did not return within {_STOP_WITHIN_S:g} s after `stop` was set{loop.at()}: check "
                        "`stop` between polls, and wait with stop.wait(seconds), which returns as soon as stop is set "
                        "(time.sleep does not)")
        if loop.error is not None:
            raise loop.ended() or Wrong(raised_message(_CALL, loop.error))
        return (f"Against a real Triton: killed, it was restarted once and ready again {recovery_s:.1f} s later; "
                f"hung, it was restarted after {hang_s:.1f} s; with every restart failing from then on, {tries} "
                f"tries in {_STORM_S:g} s (backing off).")
    finally:
        stop.set()
        rig.close()
        loop.end(2.0)


q5 = CodeExercise(
    name="05.5 a watchdog, tested against a real Triton", var="watchdog", grade=_grade_watchdog,
    references=References("write the poll, restart and back-off loop yourself", "lab_utils.monitoring.drills.Watchdog"),
    signature="watchdog(server, stop, poll_s, timeout_s, failures, backoff_s, max_backoff_s) -> None",
    applicable=_server_unavailable,
    hints=[
        "One loop until stop.is_set(): GET f'{server.http_url}/v2/health/ready' with urlopen(url, "
        "timeout=timeout_s); HTTP 200 is ready, anything else (an HTTPError, a refused connection, a timeout: all "
        "OSError) is a failed poll. Count failed polls in a row.",
        "After `failures` failed polls in a row: server.restart() inside try/except (a restart can fail), then wait "
        "`delay` and double it (at most max_backoff_s); when a poll is ready again, reset the count and the delay "
        "to backoff_s.",
        "Wait with stop.wait(seconds), not time.sleep: it returns as soon as stop is set, so the watchdog stops "
        "promptly.",
    ],
    solution_text=(
        "import urllib.request\n\n"
        "def watchdog(server, stop, poll_s=0.5, timeout_s=2.0, failures=3, backoff_s=1.0, max_backoff_s=30.0):\n"
        "    bad, delay = 0, backoff_s\n"
        "    while not stop.is_set():\n"
        "        try:\n"
        "            with urllib.request.urlopen(f\"{server.http_url}/v2/health/ready\", timeout=timeout_s) as r:\n"
        "                ready = r.status == 200\n"
        "        except OSError:  # refused, reset, timed out, or HTTP 4xx/5xx (HTTPError is an OSError too)\n"
        "            ready = False\n"
        "        bad, delay = (0, backoff_s) if ready else (bad + 1, delay)\n"
        "        if bad < failures:\n"
        "            stop.wait(poll_s)\n"
        "            continue\n"
        "        try:\n"
        "            server.restart()\n"
        "        except Exception:\n"
        "            pass  # the start failed: the backoff below grows, and the next failed polls try again\n"
        "        bad = 0\n"
        "        stop.wait(delay)\n"
        "        delay = min(2 * delay, max_backoff_s)"
    ),
)

# --- q6: read a metrics snapshot ------------------------------------------------------------------------------

SNAPSHOT_SECONDS = 10.0
_S_REQ, _S_BATCH, _S_INF_PER_EXEC, _S_QUEUE_US = 2400, 2, 8, 12_500
_S0 = {"success": 500_000, "queue_us": 500_000 * 3_000}


_EXPOSED = (  # (name, help, type) of each series in the snapshot, in the order Triton writes them
    ("nv_inference_request_success", "Number of successful inference requests, all batch sizes", "counter"),
    ("nv_inference_count", "Number of inferences performed (does not include cached requests)", "counter"),
    ("nv_inference_exec_count", "Number of model executions performed (does not include cached requests)",
     "counter"),
    ("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds", "counter"),
    ("nv_inference_pending_request_count", "Instantaneous number of pending requests awaiting execution", "gauge"),
)


def _exposition(success: int, queue_us: float) -> str:
    infer = success * _S_BATCH
    values = (success, infer, infer // _S_INF_PER_EXEC, f"{queue_us:.0f}", 17)
    return "".join(f"# HELP {name} {what}\n# TYPE {name} {kind}\n{name}{{model=\"detector\",version=\"1\"}} {v}\n"
                   for (name, what, kind), v in zip(_EXPOSED, values, strict=True))


SNAPSHOT_BEFORE = _exposition(_S0["success"], _S0["queue_us"])
SNAPSHOT_AFTER = _exposition(_S0["success"] + _S_REQ, _S0["queue_us"] + _S_REQ * _S_QUEUE_US)
_SNAPSHOT = {"qps": _S_REQ / SNAPSHOT_SECONDS, "avg_batch": float(_S_INF_PER_EXEC), "avg_queue_ms": _S_QUEUE_US / 1000}


def _grade_snapshot(value: Any) -> None:
    if not isinstance(value, Mapping) or set(value) != set(_SNAPSHOT):
        raise Wrong("give a dict with the keys 'qps', 'avg_batch' and 'avg_queue_ms'")
    qps = number(value["qps"], "snapshot['qps']")
    if not _close(qps, _SNAPSHOT["qps"]):
        if _close(qps, _S_REQ):
            raise Wrong("qps: that is the requests between the two scrapes; divide by the seconds between them")
        if _close(qps, _SNAPSHOT["qps"] * _S_BATCH):
            raise Wrong("qps: that counts inferences (nv_inference_count); requests are "
                        "nv_inference_request_success")
        if qps > 1e4:
            raise Wrong("qps: that uses a counter's total; take the difference between the two snapshots")
        raise Wrong(f"qps = {qps:g}: requests per second is the growth of nv_inference_request_success over "
                    f"the {SNAPSHOT_SECONDS:g} s between the snapshots")
    batch = number(value["avg_batch"], "snapshot['avg_batch']")
    if not _close(batch, _SNAPSHOT["avg_batch"]):
        if _close(batch, _SNAPSHOT["avg_batch"] / _S_BATCH):
            raise Wrong("avg_batch: that is requests per execution; a batch is counted in inferences "
                        "(nv_inference_count), and each request here carries 2")
        raise Wrong(f"avg_batch = {batch:g}: the average batch is Δ nv_inference_count / Δ nv_inference_exec_count")
    queue = number(value["avg_queue_ms"], "snapshot['avg_queue_ms']")
    if not _close(queue, _SNAPSHOT["avg_queue_ms"]):
        if _close(queue, _SNAPSHOT["avg_queue_ms"] * 1000):
            raise Wrong("avg_queue_ms: that is in microseconds; divide by 1000")
        if _close(queue, _SNAPSHOT["avg_queue_ms"] / _S_BATCH):
            raise Wrong("avg_queue_ms: that divides by inferences; the queue time is per request "
                        "(nv_inference_request_success)")
        if _close(queue, _S0["queue_us"] / _S0["success"] / 1000, 0.1) or _close(
                queue, (_S0["queue_us"] + _S_REQ * _S_QUEUE_US) / (_S0["success"] + _S_REQ) / 1000, 0.05):
            raise Wrong("avg_queue_ms: that is the average since the server started; use the differences "
                        "between the snapshots")
        raise Wrong(f"avg_queue_ms = {queue:g}: Δ queue µs / Δ successful requests / 1000")


q6 = Exercise(
    name="05.6 read a metrics snapshot", var="snapshot", grade=_grade_snapshot,
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

# --- q7: where does the time go? -------------------------------------------------------------------------------

BOTTLENECK_CHOICES = ("queue", "compute", "outside")
# Five-minute averages per request, from rate() of Triton's duration counters, and what else a dashboard shows:
# gpu_util_pct is DCGM_FI_DEV_GPU_UTIL (the share of time any kernel ran), sm_active_pct DCGM_FI_PROF_SM_ACTIVE
# and tensor_active_pct DCGM_FI_PROF_PIPE_TENSOR_ACTIVE (x 100), from dcgm-exporter's profiling metrics.
BOTTLENECK_MODELS = {
    "detector": {"instances": 1, "queue_ms": 46.0, "compute_infer_ms": 6.1, "server_request_ms": 53.0,
                 "client_p50_ms": 55.0, "gpu_util_pct": 34, "sm_active_pct": 11, "tensor_active_pct": 4},
    "ranker": {"instances": 2, "queue_ms": 1.2, "compute_infer_ms": 38.5, "server_request_ms": 40.4,
               "client_p50_ms": 43.0, "gpu_util_pct": 97, "sm_active_pct": 91, "tensor_active_pct": 2},
    "embedder": {"instances": 2, "queue_ms": 0.4, "compute_infer_ms": 2.9, "server_request_ms": 3.6,
                 "client_p50_ms": 61.0, "gpu_util_pct": 100, "sm_active_pct": 3, "tensor_active_pct": 1},
}
_BOTTLENECK = {"detector": "queue", "ranker": "compute", "embedder": "outside"}
_BOTTLENECK_WHY = {
    "detector": "46 of its 53 server-side ms are spent waiting in the queue, while a kernel runs only 34 % of the "
                "time and the SMs are active 11 % of their cycles: one instance cannot keep up. Add instances or "
                "allow larger batches (dynamic batching), not a faster GPU.",
    "ranker": "its requests barely queue (1.2 ms) and spend 38.5 ms computing. GPU utilization 97 % alone would "
              "only say that some kernel was running; SM activity 91 % says the SMs really are busy: the model "
              "itself is the limit. Its tensor pipes are busy 2 % of the cycles (FP32 math on the CUDA cores), so "
              "a lower-precision engine (TensorRT FP16/BF16) is the first thing to try; more instances on the "
              "same GPU do not help.",
    "embedder": "the server spends only 3.6 ms on a request but clients wait 61 ms: the time goes outside "
                "Triton (network, serialization, the client's own queue). Its GPU utilization reads 100 %, yet the "
                "SMs are active 3 % of their cycles: a small kernel was running all the time, which is all "
                "DCGM_FI_DEV_GPU_UTIL measures. The GPU is not the problem; look at the client and the path to it.",
}


def _grade_bottleneck(value: Any) -> None:
    if not isinstance(value, Mapping) or set(value) != set(BOTTLENECK_MODELS):
        keys = ", ".join(repr(m) + ": ..." for m in BOTTLENECK_MODELS)
        raise Wrong(f"give a dict with one answer per model: {{{keys}}}")
    for model, expected in _BOTTLENECK.items():
        picked = choice(value[model], BOTTLENECK_CHOICES)
        if picked is None:
            raise Wrong(f"{model}: answer one of {list(BOTTLENECK_CHOICES)}")
        if picked != expected:
            raise Wrong(f"{model} is not {picked!r}: {_BOTTLENECK_WHY[model]}")


q7 = Exercise(
    name="05.7 find the bottleneck", var="bottleneck", grade=_grade_bottleneck,
    hints=[
        "Split each model's time: queue_ms + compute ≈ the server's request time; the client's latency adds "
        "what happens outside the server.",
        "A long queue with idle SMs means too little capacity configured; a short queue with busy SMs means the "
        "model itself is slow. Read SM activity for how busy the SMs are: GPU utilization only says that some "
        "kernel was running.",
        "When the server's time is small but the client's is large, the server is not where the time goes.",
    ],
    solution_text=(
        'bottleneck = {"detector": "queue", "ranker": "compute", "embedder": "outside"}\n'
        "# detector: queue 46 of 53 ms, SMs active 11 % -> more instances / larger batches\n"
        "# ranker: compute 38.5 ms, SMs active 91 %, tensor pipes 2 % -> a lower-precision engine, more GPUs\n"
        "# embedder: server 3.6 ms, client 61 ms -> network, serialization or the client\n"
        "#   (its GPU utilization 100 % with SMs active 3 %: a small kernel always running, not a busy GPU)"
    ),
)
