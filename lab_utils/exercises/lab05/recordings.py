"""Lab 05's recorded samples for the PromQL questions (q1, q2): ``RECORDED``, which the student sees, and a second
recording drawn afresh for every check and never shown."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

from lab_utils.monitoring import prometheus

# Two servers behind a load balancer (70 % / 30 % of each model's requests; the second one is slower), two
# models, four 3-minute phases of different load, and from one 15 s scrape to the next the traffic wobbles
# (+-20 %), as real traffic does, so that only the asked-for [1m] window gives the reference's numbers. Each
# request of resnet50 carries 4 inferences, of bert 2; the dynamic batcher runs 8 and 4 inferences per
# execution. 60 % of a request's time is queueing, 30 % computing. The servers had been up a while: the
# counters start high, and their latency was lower then.
RECORDING_START = 1_700_000_000.0  # unix seconds of the first sample: fixed, so the grade never depends on the clock
STEP_S, PHASE_S, PHASES = 15, 180, 4
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
GRADING_TIMES = tuple(RECORDING_START + PHASE_S * (i + 1) for i in range(PHASES))


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
    for step in range(PHASES * PHASE_S // STEP_S + 1):
        t = start + step * STEP_S
        phase = max(0, step - 1) * STEP_S // PHASE_S  # the phase of the 15 s that end at t
        for s, (instance, share) in enumerate(servers):
            rows.append(({"__name__": "up", "job": "triton", "instance": instance}, t, 1.0))
            for j, (model, m) in enumerate(models.items()):
                for version, v_share in versions[model].items():
                    total = totals[(s, model, version)]
                    if restart == (s, step):
                        total[0] = total[1] = 0.0
                    if step:
                        wobble = 1 + 0.2 * math.sin(1.3 * step + 2.1 * s + 0.7 * j)
                        n = m["qps"][phase] * share * v_share * STEP_S * wobble
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
HIDDEN_START = RECORDING_START + 4 * 3600  # hours after RECORDED: no window reaches back into it
HIDDEN_TIMES = tuple(HIDDEN_START + PHASE_S * (i + 1) for i in range(PHASES))
HIDDEN_WHAT = ("a second recording the check draws afresh each time (three servers, bert in two versions, other "
                "batch sizes, and a server restart that resets its counters)")


def hidden_samples(rng: random.Random) -> list[prometheus.Sample]:
    shares = [rng.uniform(1.0, 3.0) for _ in range(3)]
    servers = tuple((f"10.0.1.{i + 11}:8002", w / sum(shares)) for i, w in enumerate(shares))

    def load(low: float, high: float, ms: tuple[float, float]) -> dict[str, Any]:
        return {"qps": tuple(rng.uniform(low, high) for _ in range(PHASES)),
                "latency_ms": tuple(tuple(rng.uniform(*ms) for _ in servers) for _ in range(PHASES))}

    first = rng.uniform(0.5, 0.8)
    models = {"resnet50": {**load(60, 240, (15, 60)), "inferences": 6, "per_exec": rng.choice((8, 16))},
              "bert": {**load(20, 80, (6, 20)), "inferences": 3, "per_exec": rng.choice((4, 12)),
                       "versions": {"1": first, "2": 1 - first}}}
    phase = rng.randrange(1, PHASES)  # the restart lands 15 to 45 s before the end of this phase
    restart = (rng.randrange(len(servers)), (phase + 1) * PHASE_S // STEP_S - rng.randint(1, 3))
    return _recorded_samples(HIDDEN_START, servers, models, restart)
