"""Lab 05's PromQL questions, q1 (QPS) and q2 (average latency), graded by a real Prometheus serving recorded samples
(``RECORDED``, and a second recording drawn afresh for every check) at their grading times; and what q4's alert rule
shares with them (``PrometheusExercise``, ``per_request``, ``no_delta``)."""

from __future__ import annotations

import functools
import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lab_utils.exercises.framework import Exercise, Outcome, Status, Wrong, is_blank, match_slip
from lab_utils.monitoring import prometheus

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
                    rows.extend(({"__name__": name, **labels}, t, v) for name, v in values.items())
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


def hidden_samples(rng: random.Random) -> list[prometheus.Sample]:
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


def _same(got: Values, want: Values) -> bool:
    proj = _project(got, _label_names(want))
    return proj is not None and all(proj.get(t, {}).keys() == want[t].keys() and
                                    all(math.isclose(proj[t][k], v, rel_tol=1e-6, abs_tol=1e-9)
                                        for k, v in want[t].items()) for t in want)


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
        key = min(want[GRADING_TIMES[0]])  # the first series, in label order
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
