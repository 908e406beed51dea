"""Lab 04 exercises: Triton model configuration, Little's law, the queue delay for a latency target, and the
statistics API. No server is needed to check them: the configuration is checked by Triton's protobuf
schema and the same semantic checks the lab's repository builder runs, the rest are numbers.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from lab_utils.exercises.framework import Exercise, Wrong, close_to, integer, number

__all__ = [
    "q1", "q2", "q3", "q4", "q5",
    "Q1_REQUIREMENTS", "Q1_MODEL_SHAPES",
    "Q2_CONCURRENCY", "Q2_THROUGHPUT_INFER_S",
    "Q3_P95_TARGET_MS", "Q3_MEASURED",
    "Q4_STATS",
]

# --- q1: a config.pbtxt for stated requirements --------------------------------------------------------

Q1_REQUIREMENTS = """\
Serve the digits classifier exported to ONNX (model.onnx; input INPUT__0 of shape [batch, 64], float32;
output OUTPUT__0 of shape [batch, 10], float32) with Triton's ONNX Runtime backend, as model "digits_onnx":
  - requests may carry up to 32 rows; let Triton batch requests together;
  - prefer batches of 8 and 16, and never hold a request back more than 100 microseconds to form one;
  - two instances of the model, on the CPU."""
# what model.onnx declares (the batch axis is dynamic)
Q1_MODEL_SHAPES: dict[str, list[int | str | None]] = {"INPUT__0": ["batch", 64]}


def _field(cfg: Any, name: str) -> Any:
    return getattr(cfg, name)


def _grade_config(text: Any) -> None:
    from lab_utils.serving.repository import ConfigError, check_config, parse_config

    if not isinstance(text, str):
        raise Wrong(f"expected the text of a config.pbtxt (a str), got a {type(text).__name__}")
    try:
        cfg = parse_config(text)
    except ConfigError as err:
        raise Wrong(f"Triton's schema refuses it: {err.problems[0][1]}") from None
    problems = check_config(cfg, gpus=0, model_shapes=Q1_MODEL_SHAPES)
    if problems:
        f, why = problems[0]
        raise Wrong(f"{f}: {why}")
    if cfg.name != "digits_onnx":
        raise Wrong(f'name is {cfg.name!r}: the model is called "digits_onnx" (and so must its folder be)')
    if cfg.platform != "onnxruntime_onnx" and cfg.backend != "onnxruntime":
        got = cfg.platform or cfg.backend
        raise Wrong(f'{got!r} does not run model.onnx: use platform: "onnxruntime_onnx" (or backend: "onnxruntime")')
    if cfg.max_batch_size != 32:
        raise Wrong(f"max_batch_size is {cfg.max_batch_size}: requests carry up to 32 rows, so 32")
    ins = {t.name: t for t in cfg.input}
    outs = {t.name: t for t in cfg.output}
    from tritonclient.grpc import model_config_pb2 as pb

    for group, want, dims in (("input", "INPUT__0", [64]), ("output", "OUTPUT__0", [10])):
        table = ins if group == "input" else outs
        if want not in table:
            raise Wrong(f"no {group} named {want}: names must match the ONNX model's (it has {want})")
        t = table[want]
        if t.data_type != pb.TYPE_FP32:
            raise Wrong(f"{want} is {pb.DataType.Name(t.data_type)}: the model takes float32, TYPE_FP32")
        if list(t.dims) != dims:
            raise Wrong(f"{want} dims {list(t.dims)}: with max_batch_size > 0 leave the batch dimension out: {dims}")
    if not cfg.HasField("dynamic_batching"):
        raise Wrong("requests are not batched together: add a dynamic_batching { ... } block")
    db = cfg.dynamic_batching
    if sorted(db.preferred_batch_size) != [8, 16]:
        raise Wrong(f"preferred_batch_size {list(db.preferred_batch_size)}: the requirement prefers 8 and 16")
    if db.max_queue_delay_microseconds != 100:
        raise Wrong(f"max_queue_delay_microseconds {db.max_queue_delay_microseconds}: at most 100 µs "
                    "(the field is in microseconds)")
    count = sum(max(g.count, 1) for g in cfg.instance_group)
    kinds = {pb.ModelInstanceGroup.Kind.Name(g.kind) for g in cfg.instance_group}
    if not cfg.instance_group or count != 2:
        raise Wrong(f"{count if cfg.instance_group else 'no'} instance(s): instance_group [{{ count: 2 kind: "
                    "KIND_CPU }] gives two")
    if kinds != {"KIND_CPU"}:
        raise Wrong(f"instance kind {sorted(kinds)}: the instances run on the CPU, KIND_CPU")


q1 = Exercise(
    "04.1 config.pbtxt", "config_pbtxt", _grade_config,
    hints=(
        "Start from the fields: name, platform, max_batch_size, input [...], output [...], dynamic_batching "
        "{...}, instance_group [...]. Names and types must match the ONNX model.",
        "With max_batch_size > 0 Triton adds the batch dimension itself: dims are the shape of ONE row ([64]).",
        "dynamic_batching { preferred_batch_size: [8, 16] max_queue_delay_microseconds: 100 } and "
        "instance_group [{ count: 2 kind: KIND_CPU }].",
    ),
    solution_text='''config_pbtxt = """
name: "digits_onnx"
platform: "onnxruntime_onnx"
max_batch_size: 32
input [{ name: "INPUT__0" data_type: TYPE_FP32 dims: [64] }]
output [{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [10] }]
dynamic_batching { preferred_batch_size: [8, 16] max_queue_delay_microseconds: 100 }
instance_group [{ count: 2 kind: KIND_CPU }]
"""''',
)

# --- q2: Little's law ---------------------------------------------------------------------------------

Q2_CONCURRENCY = 16  # closed-loop clients, each with one request in flight
Q2_THROUGHPUT_INFER_S = 2387.0  # measured (the H200 reference run, python backend with dynamic batching)
_Q2_MS = Q2_CONCURRENCY / Q2_THROUGHPUT_INFER_S * 1e3  # 6.703 ms

q2 = Exercise(
    "04.2 Little's law", "latency_ms",
    close_to(_Q2_MS, 0.02, "Little's law: requests in flight = throughput × latency.", slips={
        Q2_THROUGHPUT_INFER_S / Q2_CONCURRENCY / _Q2_MS: "that is throughput / concurrency (infer/s per "
        "client), not a time: latency = concurrency / throughput",
        1e-3: "that is in seconds: the answer is asked in milliseconds",
        1e3: "that is in microseconds: the answer is asked in milliseconds",
        1 / Q2_CONCURRENCY: "that is the time between completions (1 / throughput); each client waits for its own "
        "request: multiply by the concurrency",
    }, reveal=False),
    hints=(
        "In a closed loop every client has exactly one request in flight: N requests are in the system.",
        "Little's law: N = X × W (requests in the system = throughput × time each spends there). Solve for W.",
    ),
    solution_text="latency_ms = Q2_CONCURRENCY / Q2_THROUGHPUT_INFER_S * 1e3",
)

# --- q3: the queue delay for a p95 target -----------------------------------------------------------------

Q3_P95_TARGET_MS = 8.0
# max_queue_delay_microseconds -> what a sweep at concurrency 16 measured (throughput infer/s, p95 ms)
Q3_MEASURED: dict[int, dict[str, float]] = {
    0: {"throughput_infer_s": 1890.0, "p95_ms": 6.1},
    100: {"throughput_infer_s": 2150.0, "p95_ms": 6.8},
    200: {"throughput_infer_s": 2387.0, "p95_ms": 7.6},
    500: {"throughput_infer_s": 2520.0, "p95_ms": 9.4},
    1000: {"throughput_infer_s": 2560.0, "p95_ms": 12.9},
}


def _grade_delay(value: Any) -> None:
    table = copy.deepcopy(_Q3_TABLE)
    d = integer(value, "the delay")
    if d not in table:
        raise Wrong(f"{d} µs was not measured: choose one of {sorted(table)}")
    row = table[d]
    if row["p95_ms"] > Q3_P95_TARGET_MS:
        raise Wrong(f"at {d} µs p95 is {row['p95_ms']} ms, over the {Q3_P95_TARGET_MS} ms target: more "
                    "throughput, but the target comes first")
    best = max((k for k, r in table.items() if r["p95_ms"] <= Q3_P95_TARGET_MS),
               key=lambda k: table[k]["throughput_infer_s"])
    if d != best:
        raise Wrong(f"{d} µs meets the target, but a longer delay that still meets it gives more throughput "
                    f"({row['throughput_infer_s']:.0f} infer/s here)")


_Q3_TABLE = copy.deepcopy(Q3_MEASURED)  # the grader's own copy: a student's cell may change the shared one

q3 = Exercise(
    "04.3 queue delay", "queue_delay_us", _grade_delay,
    hints=(
        "A longer max_queue_delay_microseconds lets the batcher wait for fuller batches: throughput rises, "
        "and so does the tail latency.",
        "Keep the delays whose p95 is within the target; of those, take the one with the highest throughput.",
    ),
    solution_text=("queue_delay_us = max((d for d, r in Q3_MEASURED.items() if r['p95_ms'] <= Q3_P95_TARGET_MS),\n"
                   "                     key=lambda d: Q3_MEASURED[d]['throughput_infer_s'])"),
)

# --- q4, q5: a statistics response ------------------------------------------------------------------------

Q4_STATS: dict[str, Any] = {  # GET v2/models/mlp/stats after a load test (Triton's statistics extension)
    "model_stats": [{
        "name": "mlp", "version": "1", "last_inference": 1764460800000,
        "inference_count": 6400, "execution_count": 450,
        "inference_stats": {
            "success": {"count": 6400, "ns": 44_160_000_000},
            "fail": {"count": 0, "ns": 0},
            "queue": {"count": 6400, "ns": 19_840_000_000},
            "compute_input": {"count": 6400, "ns": 1_280_000_000},
            "compute_infer": {"count": 6400, "ns": 21_120_000_000},
            "compute_output": {"count": 6400, "ns": 960_000_000},
            "cache_hit": {"count": 0, "ns": 0}, "cache_miss": {"count": 0, "ns": 0},
        },
        "batch_stats": [
            {"batch_size": 6, "compute_input": {"count": 20, "ns": 0}, "compute_infer": {"count": 20, "ns": 0},
             "compute_output": {"count": 20, "ns": 0}},
            {"batch_size": 8, "compute_input": {"count": 75, "ns": 0}, "compute_infer": {"count": 75, "ns": 0},
             "compute_output": {"count": 75, "ns": 0}},
            {"batch_size": 16, "compute_input": {"count": 355, "ns": 0}, "compute_infer": {"count": 355, "ns": 0},
             "compute_output": {"count": 355, "ns": 0}},
        ],
    }],
}
_S = copy.deepcopy(Q4_STATS["model_stats"][0])
_BATCH = _S["inference_count"] / _S["execution_count"]  # 14.22
_QUEUE_US = _S["inference_stats"]["queue"]["ns"] / _S["inference_stats"]["queue"]["count"] / 1e3  # 3100 µs
_REQUEST_US = _S["inference_stats"]["success"]["ns"] / _S["inference_stats"]["success"]["count"] / 1e3  # 6900


def _grade_batch(value: Any) -> None:
    got = number(value, "the average batch")
    if math.isclose(got, 1.0, rel_tol=0.01):
        raise Wrong("inference_stats counts requests in every stage (compute_infer.count = 6400 = success.count): "
                    "the executions are execution_count")
    if math.isclose(got, 1 / _BATCH, rel_tol=0.01):
        raise Wrong("that is executions per inference: invert it")
    if math.isclose(got, 16.0, rel_tol=0.01) or math.isclose(got, 10.0, rel_tol=0.01):
        raise Wrong("batch_stats lists sizes with how many executions ran at each: weight them, or use "
                    "inference_count / execution_count")
    close_to(_BATCH, 0.01, "rows (inferences) per model execution", reveal=False)(got)


q4 = Exercise(
    "04.4 average batch", "avg_batch", _grade_batch,
    hints=(
        "inference_count counts inferences (rows); execution_count counts runs of the model.",
        "avg_batch = inference_count / execution_count; batch_stats gives the same by weighting each size "
        "by its count.",
    ),
    solution_text=("s = Q4_STATS['model_stats'][0]\n"
                   "avg_batch = s['inference_count'] / s['execution_count']"),
)


def _grade_queue(value: Any) -> None:
    got = number(value, "the queue time")
    if math.isclose(got, _QUEUE_US * 1e3, rel_tol=0.01):
        raise Wrong("that is nanoseconds (the statistics are in ns): the answer is asked in µs")
    if math.isclose(got, _QUEUE_US / 1e3, rel_tol=0.01):
        raise Wrong("that is milliseconds: the answer is asked in µs")
    if math.isclose(got, _S["inference_stats"]["queue"]["ns"] / _S["execution_count"] / 1e3, rel_tol=0.01):
        raise Wrong("queue.ns is summed over requests (queue.count), not over executions")
    if math.isclose(got, _REQUEST_US, rel_tol=0.01):
        raise Wrong("that is the whole request (success.ns): the queue is only one part of it")
    close_to(_QUEUE_US, 0.01, "total queue ns / number of queued requests, in µs", reveal=False)(got)


q5 = Exercise(
    "04.5 queue time", "queue_us", _grade_queue,
    hints=(
        "Every stage of inference_stats has a count and a total in nanoseconds.",
        "queue_us = queue.ns / queue.count / 1000. Compare it with success.ns / success.count: the share of the "
        "request spent waiting.",
    ),
    solution_text=("q = Q4_STATS['model_stats'][0]['inference_stats']['queue']\n"
                   "queue_us = q['ns'] / q['count'] / 1e3"),
)
