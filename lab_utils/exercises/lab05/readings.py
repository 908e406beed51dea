"""Lab 05's questions on fixed data: q3 alert thresholds from a baseline, q6 reading a metrics snapshot, q7 where a
request's time goes (the bottleneck). Numbers in ms unless named otherwise."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from lab_utils.exercises.framework import Exercise, Wrong, choice, number

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


def _close(a: float, b: float, rel: float = 0.02) -> bool:
    return math.isfinite(a) and math.isclose(a, b, rel_tol=rel)


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
