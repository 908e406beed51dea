"""Lab 05 exercises: PromQL, alert thresholds, reading metrics, finding the bottleneck.

The PromQL answers are evaluated deterministically against recorded samples (``RECORDED``: ten minutes of a
Triton server's counters, scraped every 15 s) with :mod:`lab_utils.monitoring.promql`; the lab then also runs them
against the live Prometheus. The other questions take numbers or choices from fixed data in this module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from lab_utils.exercises.framework import Exercise, Wrong, number
from lab_utils.monitoring import promql

__all__ = [
    "q1", "q2", "q3", "q4", "q5",
    "RECORDED", "RECORDED_AT", "recorded_store", "evaluate_recorded",
    "BASELINE_P99_MS", "INCIDENT_P99_MS", "BASELINE_PENDING", "INCIDENT_PENDING",
    "SNAPSHOT_BEFORE", "SNAPSHOT_AFTER", "SNAPSHOT_SECONDS",
    "Q5_MODELS", "Q5_CHOICES",
]

# --- recorded samples for q1 and q2 -------------------------------------------------------------------------

# A server that had already run a while (the counters start high; its earlier latency was lower), then ten
# minutes at a steady 120 requests/s of batch-4 requests, 25 ms each (15 ms of it queued, 8 ms computing),
# executed 8 inferences at a time.
_STEP_S, _MINUTES = 15, 10
_QPS, _BATCH_PER_REQUEST, _INFER_PER_EXEC = 120.0, 4, 8.0
_LATENCY_US, _QUEUE_US, _COMPUTE_US = 25_000.0, 15_000.0, 8_000.0
_START = {"success": 1_000_000.0, "duration_us": 1_000_000.0 * 10_000.0, "queue_us": 1_000_000.0 * 4_000.0,
          "compute_us": 1_000_000.0 * 5_000.0}
_LABELS = {"model": "resnet50", "version": "1", "job": "triton", "instance": "10.0.0.7:8002"}
RECORDED_AT = float(_MINUTES * 60)  # evaluate at the end of the recording (seconds)


def _recorded_rows(qps_scale: float = 1.0, latency_scale: float = 1.0) -> list[tuple[dict[str, str], float, float]]:
    rows = []
    for i in range(_MINUTES * 60 // _STEP_S + 1):
        t = float(i * _STEP_S)
        n = _QPS * qps_scale * t  # requests since the recording started
        values = {
            "nv_inference_request_success": _START["success"] + n,
            "nv_inference_count": (_START["success"] + n) * _BATCH_PER_REQUEST,
            "nv_inference_exec_count": (_START["success"] + n) * _BATCH_PER_REQUEST / _INFER_PER_EXEC,
            "nv_inference_request_duration_us": _START["duration_us"] + n * _LATENCY_US * latency_scale,
            "nv_inference_queue_duration_us": _START["queue_us"] + n * _QUEUE_US,
            "nv_inference_compute_infer_duration_us": _START["compute_us"] + n * _COMPUTE_US,
            "nv_inference_pending_request_count": 3.0,
        }
        for name, v in values.items():
            rows.append(({"__name__": name, **_LABELS}, t, v))
        rows.append(({"__name__": "nv_inference_request_failure", **_LABELS, "reason": "BACKEND"}, t, 0.0))
        rows.append(({"__name__": "up", "job": "triton", "instance": _LABELS["instance"]}, t, 1.0))
    return rows


RECORDED = tuple(_recorded_rows())
# The same server on a busier day (1.5x the requests, each twice as slow): a right query follows the data.
_RECORDED_BUSY = tuple(_recorded_rows(qps_scale=1.5, latency_scale=2.0))


def recorded_store() -> promql.SampleStore:
    """The recorded samples in a fresh store (a student's query cannot change the grader's data)."""
    return promql.store_from_samples(RECORDED)


def _selectors(node: Any) -> list[Any]:
    if isinstance(node, promql.Selector):
        return [node]
    out = []
    for value in vars(node).values() if hasattr(node, "__dict__") else ():
        for child in value if isinstance(value, list) else [value]:
            if hasattr(child, "__dict__"):
                out += _selectors(child)
    return out


def evaluate_recorded(expr: str, *, busy: bool = False) -> float:
    """``expr`` at the end of the recording, as one number (Wrong explains an empty or multi-series answer)."""
    if not isinstance(expr, str):
        raise Wrong(f"give the PromQL expression as a string, e.g. 'rate(metric[1m])', not a {type(expr).__name__}")
    store = promql.store_from_samples(_RECORDED_BUSY) if busy else recorded_store()
    try:
        if not _selectors(promql.parse(expr)):
            raise Wrong("that reads no metric: a query must select Triton's series (e.g. nv_inference_...)")
        data = promql.instant(store, expr, RECORDED_AT)
    except promql.PromQLError as err:
        raise Wrong(f"the expression does not evaluate: {err}") from None
    if data["resultType"] == "scalar":
        return float(data["result"][1])
    if data["resultType"] != "vector":
        raise Wrong("that is a range vector (metric[1m]); wrap it in a function such as rate()")
    if not data["result"]:
        raise Wrong("it returns no series at all: check the metric names and label matchers (the model is "
                    "'resnet50')")
    if len(data["result"]) > 1:
        raise Wrong(f"it returns {len(data['result'])} series; aggregate them (sum by (model) (...))")
    return float(data["result"][0]["value"][1])


def _close(a: float, b: float, rel: float = 0.02) -> bool:
    return math.isfinite(a) and math.isclose(a, b, rel_tol=rel)


# --- q1: QPS in PromQL --------------------------------------------------------------------------------------

_Q1_EXPECTED = _QPS


def _follows_the_data(expr: str, expected_busy: float) -> None:
    busy = evaluate_recorded(expr, busy=True)
    if not _close(busy, expected_busy):
        raise Wrong(f"right on this recording, but on a busier one it gives {busy:.4g} instead of "
                    f"{expected_busy:.4g}: the answer must come from the series, not from constants")


def _grade_qps(expr: Any) -> None:
    got = evaluate_recorded(expr)
    if _close(got, _Q1_EXPECTED):
        _follows_the_data(expr, _Q1_EXPECTED * 1.5)
        return
    if _close(got, _QPS * _BATCH_PER_REQUEST):
        raise Wrong(f"{got:g}/s counts inferences (nv_inference_count: each request here carries "
                    f"{_BATCH_PER_REQUEST}); requests are nv_inference_request_success")
    if _close(got, _QPS * _BATCH_PER_REQUEST / _INFER_PER_EXEC):
        raise Wrong(f"{got:g}/s counts executions (nv_inference_exec_count: batches the model ran); requests "
                    "are nv_inference_request_success")
    for window in (60, 120, 300, 30, 600):
        if _close(got, _QPS * window):
            raise Wrong(f"{got:g} is the number of requests in a {window} s window (increase()); requests per "
                        "second is rate(), or increase() divided by the window's seconds")
    if got > 1e5:
        raise Wrong(f"{got:g} is a counter's total since the server started: a counter only means something "
                    "as a rate, rate(counter[1m])")
    raise Wrong(f"it gives {got:.4g}, not the requests per second of model resnet50. Use the counter of "
                "successful requests and rate() over a window")


q1 = Exercise(
    name="05.1 QPS in PromQL",
    var="qps_promql",
    grade=_grade_qps,
    hints=[
        "Triton counts successful requests in a counter; a counter only grows, so look at how fast it grows.",
        "rate(counter[window]) is the per-second increase averaged over the window; sum by (model) adds the "
        "versions and instances of one model.",
        "sum by (model) (rate(nv_inference_request_success[1m]))",
    ],
    solution_text=(
        'qps_promql = "sum by (model) (rate(nv_inference_request_success[1m]))"\n'
        "# requests, not inferences (nv_inference_count) or executions (nv_inference_exec_count)"
    ),
)

# --- q2: average latency in PromQL ------------------------------------------------------------------------------

_Q2_EXPECTED_MS = _LATENCY_US / 1000


def _grade_latency(expr: Any) -> None:
    got = evaluate_recorded(expr)
    if _close(got, _Q2_EXPECTED_MS):
        _follows_the_data(expr, _Q2_EXPECTED_MS * 2.0)
        return
    e = _Q2_EXPECTED_MS
    lifetime_us = (_START["duration_us"] + _QPS * RECORDED_AT * _LATENCY_US) / (_START["success"] + _QPS * RECORDED_AT)
    slips = [
        (e * 1000, "that is in microseconds (Triton's *_duration_us): divide by 1000 for milliseconds"),
        (e / _BATCH_PER_REQUEST, "that divides by inferences (nv_inference_count); the latency of a request is "
                                 "request time over requests (nv_inference_request_success)"),
        (e * _INFER_PER_EXEC / _BATCH_PER_REQUEST, "that is per execution (nv_inference_exec_count), not per "
                                                   "request"),
        (_QUEUE_US / 1000, "that is only the time requests wait in the queue (nv_inference_queue_duration_us); "
                           "the whole request is nv_inference_request_duration_us"),
        (_COMPUTE_US / 1000, "that is only the model's compute (nv_inference_compute_infer_duration_us); the "
                             "whole request is nv_inference_request_duration_us"),
        (lifetime_us / 1000, "the counters themselves divided give the average since the server started; divide "
                             "their rates to get the last window's average"),
        (lifetime_us, "the counters themselves divided give the average since the server started (and in µs); "
                      "divide their rates"),
    ]
    for value, why in slips:
        if _close(got, value):
            raise Wrong(why)
    raise Wrong(f"it gives {got:.4g}; the average latency of a request in ms is the rate of request time over "
                "the rate of requests")


q2 = Exercise(
    name="05.2 average latency in PromQL",
    var="latency_promql",
    grade=_grade_latency,
    hints=[
        "Triton adds every request's duration (µs) to a counter and counts the requests in another: their "
        "ratio is an average.",
        "Divide the two rates over the same window (not the counters themselves: that is the average since "
        "the server started), then convert µs to ms.",
        "sum by (model) (rate(nv_inference_request_duration_us[1m])) / sum by (model) "
        "(rate(nv_inference_request_success[1m])) / 1000",
    ],
    solution_text=(
        'latency_promql = ("sum by (model) (rate(nv_inference_request_duration_us[1m]))"\n'
        '                  " / sum by (model) (rate(nv_inference_request_success[1m])) / 1000")'
    ),
)

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
        "(monitoring.parse_exposition reads the text for you).",
        "qps = Δ requests / seconds; average batch = Δ inferences / Δ executions; average queue time = "
        "Δ queue µs / Δ requests.",
        "Requests carry 2 inferences each here: nv_inference_count is not nv_inference_request_success.",
    ],
    solution_text=(
        "from lab_utils.monitoring.panels import parse_exposition\n"
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
