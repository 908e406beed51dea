"""Lab 05's PromQL questions, q1 (QPS) and q2 (average latency), graded by a real Prometheus serving the recordings
(``recordings``) at their grading times; the helpers q4's alert rule shares (``PrometheusExercise``, ``per_request``,
``no_delta``)."""

from __future__ import annotations

import functools
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lab_utils.exercises.framework import Exercise, Outcome, Status, Wrong, is_blank, match_slip
from lab_utils.exercises.lab05.recordings import (
    GRADING_TIMES,
    HIDDEN_START,
    HIDDEN_TIMES,
    HIDDEN_WHAT,
    PHASE_S,
    RECORDED,
    RECORDING_START,
    hidden_samples,
)
from lab_utils.monitoring import prometheus

# --- grading a query with Prometheus ------------------------------------------------------------------------

Labels = tuple[tuple[str, str], ...]
Values = dict[float, dict[Labels, float]]  # {unix time: {series labels: value}}


def _at(t: float) -> str:
    if t >= HIDDEN_START:
        return f"{(t - HIDDEN_START) / 60:g}m into the second recording"
    return f"{(t - RECORDING_START) / 60:g}m"


def _evaluate(server: prometheus.PromAPI, expr: str) -> Values:
    """``expr`` at every grading time of both recordings, as Prometheus answers it; Wrong with Prometheus' words
    when it refuses."""
    out: Values = {t: {} for t in (*GRADING_TIMES, *HIDDEN_TIMES)}
    for times in (GRADING_TIMES, HIDDEN_TIMES):
        try:
            df = server.query_range(expr, times[0], times[-1], PHASE_S)
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
    return {t: v for t, v in values.items() if t < HIDDEN_START}


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


def no_delta(expr: str) -> None:
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
    no_delta(expr)
    with prometheus.recorded_server([*RECORDED, *hidden_samples(random.Random())]) as server:
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
    seen, hidden = _visible(got), {t: v for t, v in got.items() if t >= HIDDEN_START}
    if _same(seen, _visible(want)):
        proj = _project(hidden, _label_names(want)) or {}
        t = next((t for t in HIDDEN_TIMES if not _same({t: hidden.get(t, {})}, {t: want[t]})), HIDDEN_TIMES[-1])
        shown = _show(proj.get(t, hidden.get(t, {})))
        raise Wrong(f"it gives the reference's numbers on ex.RECORDED, but not on {HIDDEN_WHAT}: at {_at(t)} it "
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


def per_request(counter: str, per: str = "nv_inference_request_success", unit: str = " / 1000") -> str:
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

LATENCY = per_request("nv_inference_request_duration_us")
_LATENCY_SLIPS = [
    (per_request("nv_inference_request_duration_us", unit=""),
     "that is in microseconds (Triton's *_duration_us): your values are 1000x the reference; divide by 1000 for ms"),
    ("sum by (model) (nv_inference_request_duration_us) / sum by (model) (nv_inference_request_success) / 1000",
     "the counters themselves divided give the average since the server started; divide their rates to get the "
     "last minute's average"),
    (per_request("nv_inference_queue_duration_us"),
     "that is only the time requests wait in the queue (nv_inference_queue_duration_us); the whole request is "
     "nv_inference_request_duration_us"),
    (per_request("nv_inference_compute_infer_duration_us"),
     "that is only the model's compute (nv_inference_compute_infer_duration_us); the whole request is "
     "nv_inference_request_duration_us"),
    (per_request("nv_inference_request_duration_us", "nv_inference_count"),
     "that divides by inferences (nv_inference_count); the latency of a request is request time over requests "
     "(nv_inference_request_success)"),
    (per_request("nv_inference_request_duration_us", "nv_inference_exec_count"),
     "that is per execution (nv_inference_exec_count), not per request"),
    ("avg by (model) (rate(nv_inference_request_duration_us[1m]) / rate(nv_inference_request_success[1m])) / 1000",
     "that averages the servers' averages: the slower server, which serves 30 % of the requests, weighs as much "
     "as the other. Add the time and the requests up first, then divide (sum by (model) over sum by (model))"),
    *_window_slips(LATENCY, "the average latency"),
]

q2 = PrometheusExercise(
    name="05.2 average latency in PromQL", var="latency_query",
    grade=functools.partial(_grade_query, reference=LATENCY, mistakes=_LATENCY_SLIPS,
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
