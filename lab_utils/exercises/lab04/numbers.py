"""04.5, 04.7 and 04.8: the numbers read off a server: Little's law, the queue delay for a p95 target, the average
batch and queue time from Triton's statistics (a fixed response, one drawn at random, the server's)."""

from __future__ import annotations

import copy
import json
import math
import random
from typing import Any

from lab_utils.exercises.framework import CodeExercise, Exercise, Wrong, close_to, integer, items, number, run_student
from lab_utils.exercises.lab04.server import _BOUND, _served_version

# --------------------------------------------------------------------------------------------------
# 04.5 Little's law

Q5_CONCURRENCY = 16  # closed-loop clients, each with one request in flight
Q5_THROUGHPUT_INFER_S = 2387.0  # measured (the H200 reference run, python backend with dynamic batching)
_Q5_MS = Q5_CONCURRENCY / Q5_THROUGHPUT_INFER_S * 1e3  # 6.703 ms

q5 = Exercise(
    "04.5 Little's law", "latency_ms",
    close_to(_Q5_MS, 0.02, "Little's law: requests in flight = throughput × latency.", slips={
        Q5_THROUGHPUT_INFER_S / Q5_CONCURRENCY / _Q5_MS: "that is throughput / concurrency (infer/s per "
        "client), not a time: latency = concurrency / throughput",
        1e-3: "that is in seconds: the answer is asked in milliseconds",
        1e3: "that is in microseconds: the answer is asked in milliseconds",
        1 / Q5_CONCURRENCY: "that is the time between completions (1 / throughput); each client waits for its own "
        "request: multiply by the concurrency",
    }, reveal=False),
    hints=(
        "In a closed loop every client has exactly one request in flight: N requests are in the system.",
        "Little's law: N = X × W (requests in the system = throughput × time each spends there). Solve for W.",
    ),
    solution_text="latency_ms = Q5_CONCURRENCY / Q5_THROUGHPUT_INFER_S * 1e3",
)


# --------------------------------------------------------------------------------------------------
# 04.7 the queue delay for a p95 target

Q7_P95_TARGET_MS = 8.0
# max_queue_delay_microseconds -> what a sweep at concurrency 16 measured (throughput infer/s, p95 ms)
Q7_MEASURED: dict[int, dict[str, float]] = {
    0: {"throughput_infer_s": 1890.0, "p95_ms": 6.1},
    100: {"throughput_infer_s": 2150.0, "p95_ms": 6.8},
    200: {"throughput_infer_s": 2387.0, "p95_ms": 7.6},
    500: {"throughput_infer_s": 2520.0, "p95_ms": 9.4},
    1000: {"throughput_infer_s": 2560.0, "p95_ms": 12.9},
}


def _grade_delay(value: Any) -> None:
    d = integer(value, "the delay")
    if d not in _Q7_TABLE:
        raise Wrong(f"{d} µs was not measured: choose one of {sorted(_Q7_TABLE)}")
    row = _Q7_TABLE[d]
    if row["p95_ms"] > Q7_P95_TARGET_MS:
        raise Wrong(f"at {d} µs p95 is {row['p95_ms']} ms, over the {Q7_P95_TARGET_MS} ms target: more "
                    "throughput, but the target comes first")
    best = max((k for k, r in _Q7_TABLE.items() if r["p95_ms"] <= Q7_P95_TARGET_MS),
               key=lambda k: _Q7_TABLE[k]["throughput_infer_s"])
    if d != best:
        raise Wrong(f"{d} µs meets the target, but a longer delay that still meets it gives more throughput "
                    f"({row['throughput_infer_s']:.0f} infer/s here)")


_Q7_TABLE = copy.deepcopy(Q7_MEASURED)  # the grader's own copy: a student's cell may change the shared one

q7 = Exercise(
    "04.7 queue delay", "queue_delay_us", _grade_delay,
    hints=(
        "A longer max_queue_delay_microseconds lets the batcher wait for fuller batches: throughput rises, "
        "and so does the tail latency.",
        "Keep the delays whose p95 is within the target; of those, take the one with the highest throughput.",
    ),
    solution_text=("queue_delay_us = max((d for d, r in Q7_MEASURED.items() if r['p95_ms'] <= Q7_P95_TARGET_MS),\n"
                   "                     key=lambda d: Q7_MEASURED[d]['throughput_infer_s'])"),
)

# --------------------------------------------------------------------------------------------------
# 04.8 the statistics API: average batch and queue time, from a fixed response and from the server's

def _stats_response(last_inference: int, success_ns: int, stage_ns: dict[str, int], sizes: list[int],
                    counts: list[int]) -> dict[str, Any]:
    """Triton's statistics response for mlp version 1: ``counts[i]`` executions at batch size ``sizes[i]``, every
    stage counted once per inference and taking ``stage_ns`` (no failure, no cache). batch_stats says how many
    executions ran at each size (the times are not used here)."""
    inferences, zero = sum(b * n for b, n in zip(sizes, counts, strict=True)), {"count": 0, "ns": 0}
    stages = ("compute_input", "compute_infer", "compute_output")
    return {"model_stats": [{
        "name": "mlp", "version": "1", "last_inference": last_inference,
        "inference_count": inferences, "execution_count": sum(counts),
        "inference_stats": {"success": {"count": inferences, "ns": success_ns}, "fail": dict(zero),
                            **{k: {"count": inferences, "ns": v} for k, v in stage_ns.items()},
                            "cache_hit": dict(zero), "cache_miss": dict(zero)},
        "batch_stats": [{"batch_size": b, **{k: {"count": n, "ns": 0} for k in stages}}
                        for b, n in zip(sizes, counts, strict=True)],
    }]}


# GET v2/models/mlp/stats after a load test (Triton's statistics extension)
Q8_STATS: dict[str, Any] = _stats_response(
    1764460800000, 44_160_000_000, {"queue": 19_840_000_000, "compute_input": 1_280_000_000,
                                    "compute_infer": 21_120_000_000, "compute_output": 960_000_000},
    [6, 8, 16], [20, 75, 355])


def _expected_split(stats: dict[str, Any]) -> tuple[float, float, float, float]:
    s = stats["model_stats"][0]
    st = s["inference_stats"]
    batch = int(s["inference_count"]) / int(s["execution_count"])
    queue = int(st["queue"]["ns"]) / int(st["queue"]["count"]) / 1e3
    per_exec = int(st["queue"]["ns"]) / int(s["execution_count"]) / 1e3
    request = int(st["success"]["ns"]) / int(st["success"]["count"]) / 1e3
    return batch, queue, per_exec, request


def _random_stats(rng: random.Random) -> dict[str, Any]:
    """A statistics response shaped like ``Q8_STATS`` with numbers drawn at random: a function that returns the
    fixed answer, or reads ``ex.Q8_STATS`` instead of its argument, fails on it."""
    fixed_batch, fixed_queue, _, _ = _expected_split(Q8_STATS)
    while True:
        sizes = sorted(rng.sample(range(2, 33), 3))
        counts = [rng.randint(20, 400) for _ in sizes]
        inferences, executions = sum(b * n for b, n in zip(sizes, counts, strict=True)), sum(counts)
        batch = inferences / executions
        queue_us = rng.uniform(300.0, 20_000.0)
        slips = [max(sizes), sum(sizes) / len(sizes)]  # the unweighted answers _grade_response names
        far = [fixed_batch, *slips, 1.0]
        # the fixed answer must not pass for an unweighted one either (sizes 7, 14, 22 average 14.33: the fixed
        # 14.22 then read as "weight them" instead of "compute it from the argument")
        if all(abs(batch / v - 1) > 0.05 for v in far) and abs(queue_us / fixed_queue - 1) > 0.05 and \
                all(abs(fixed_batch / v - 1) > 0.05 for v in slips):
            break
    stages = {"queue": queue_us, "compute_input": rng.uniform(50, 400), "compute_infer": rng.uniform(500, 5000),
              "compute_output": rng.uniform(50, 300)}
    ns = {k: round(v * 1e3 * inferences) for k, v in stages.items()}
    last = 1764460800000 + rng.randint(0, 10**9)
    return _stats_response(last, sum(ns.values()) + rng.randint(0, 10**9), ns, sizes, counts)


def _grade_response(fn: Any, stats: dict[str, Any], call: str) -> tuple[tuple[float, float], tuple[float, float]]:
    """The student's (avg_batch, queue_us) for ``stats`` and the expected ones, or ``Wrong`` naming the slip."""
    result = run_student(fn, copy.deepcopy(stats), call=call, timeout_s=30)
    if isinstance(result, dict):
        raise Wrong(f"{call} returned a dict; return the two numbers as a tuple: (avg_batch, queue_us)")
    got_batch, got_queue = items(result, 2, call, "two numbers: (avg_batch, queue_us)")
    got_batch, got_queue = number(got_batch, "avg_batch"), number(got_queue, "queue_us")
    batch, queue, per_exec, request = _expected_split(stats)
    sizes = [int(b["batch_size"]) for b in stats["model_stats"][0].get("batch_stats", [])]
    weigh = ("avg_batch: batch_stats lists sizes with how many executions ran at each: weight them, or use "
             "inference_count / execution_count")
    slips = [  # (the answer, its right value, what a slip gives, the slip)
        (got_batch, batch, 1.0, "avg_batch: inference_stats counts requests in every stage (compute_infer.count = "
                                "success.count): the executions are execution_count"),
        (got_batch, batch, 1 / batch, "avg_batch: that is executions per inference: invert it"),
        (got_queue, queue, queue * 1e3, "queue_us: that is nanoseconds (the statistics are in ns): the answer is "
                                        "asked in µs"),
        (got_queue, queue, queue / 1e3, "queue_us: that is milliseconds: the answer is asked in µs"),
        (got_queue, queue, per_exec, "queue_us: queue.ns is summed over requests (queue.count), not over executions"),
        (got_queue, queue, request,
         "queue_us: that is the whole request (success.ns): the queue is only one part of it"),
        *((got_batch, batch, v, weigh) for v in ((max(sizes), sum(sizes) / len(sizes)) if sizes else ())),
    ]
    for got, right, slip, why in slips:  # named only for an answer that is not right as well
        if math.isclose(got, slip, rel_tol=0.01) and not math.isclose(got, right, rel_tol=0.01):
            raise Wrong(f"{call}: {why}")
    return (got_batch, got_queue), (batch, queue)


def _grade_stats(fn: Any) -> str:
    import urllib.request

    call = "batch_and_queue(ex.Q8_STATS)"
    (got_batch, got_queue), (batch, queue) = _grade_response(fn, Q8_STATS, call)
    for what, got, want in (("avg_batch", got_batch, batch), ("queue_us", got_queue, queue)):
        if not math.isclose(got, want, rel_tol=0.01):
            side = "high" if got > want else "low"
            raise Wrong(f"{call}: {what} {got:.4g} is too {side}: avg_batch = inferences per execution, queue_us = "
                        "queue time per queued request, in µs")
    # A second response with numbers drawn here: the answer must be computed from the argument.
    call = "batch_and_queue(<another response, its numbers drawn at random>)"
    got, want = _grade_response(fn, _random_stats(random.Random()), call)
    if not all(math.isclose(g, w, rel_tol=0.01) for g, w in zip(got, want, strict=True)):
        same = all(math.isclose(g, f, rel_tol=0.01) for g, f in zip(got, (batch, queue), strict=True))
        why = ("the answer to ex.Q8_STATS again: compute it from the `stats` argument, not from fixed numbers" if same
               else "avg_batch = inference_count / execution_count, queue_us = queue.ns / queue.count / 1000")
        raise Wrong(f"{call} gave ({got[0]:.4g}, {got[1]:.4g}); that response says ({want[0]:.4g}, {want[1]:.4g}): "
                    f"{why}")
    graded = f"on the fixed response (avg_batch {got_batch:.2f}, queue {got_queue:,.0f} µs) and on one with numbers " \
        "drawn at random"
    if not _BOUND or not _BOUND[0].server.alive():
        return f"{graded}."
    lab = _BOUND[0]
    version, _ = _served_version(lab)
    url = f"{lab.server.http_url.rstrip('/')}/v2/models/{lab.model}/versions/{version}/stats"
    with urllib.request.urlopen(url, timeout=10) as resp:
        live = json.loads(resp.read())
    if not live.get("model_stats") or not int(live["model_stats"][0].get("execution_count", 0)):
        return f"{graded} (the server's own {lab.model} has served nothing yet)."
    call = f"batch_and_queue(<GET v2/models/{lab.model}/versions/{version}/stats>)"
    (got_batch, got_queue), (batch, queue) = _grade_response(fn, live, call)
    if not (math.isclose(got_batch, batch, rel_tol=1e-6) and math.isclose(got_queue, queue, rel_tol=1e-6)):
        raise Wrong(f"{call} gave ({got_batch:.4g}, {got_queue:.4g}); the server's response says ({batch:.4g}, "
                    f"{queue:.4g}): read the counts as numbers (the JSON has them as integers)")
    return (f"on the fixed response, on one with numbers drawn at random, and on the server's own ({lab.model} "
            f"version {version}: avg_batch {batch:.2f}, queue {queue:,.0f} µs per request).")


q8 = CodeExercise(
    name="04.8 average batch and queue time", var="batch_and_queue", grade=_grade_stats,
    signature="batch_and_queue(stats) -> (avg_batch, queue_us)",
    hints=(
        "stats['model_stats'][0] holds inference_count (rows served), execution_count (runs of the model) and "
        "inference_stats: per stage a count and a total time in nanoseconds.",
        "avg_batch = inference_count / execution_count (batch_stats gives the same by weighting each size by its "
        "count); queue_us = queue.ns / queue.count / 1000.",
    ),
    solution_text=(
        "def batch_and_queue(stats):\n"
        "    s = stats['model_stats'][0]\n"
        "    q = s['inference_stats']['queue']\n"
        "    return int(s['inference_count']) / int(s['execution_count']), int(q['ns']) / int(q['count']) / 1e3"
    ),
)
