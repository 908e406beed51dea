"""Lab 02's 02.7: accuracy over every rank's samples (one all_reduce of the counts), on shards of unequal sizes drawn
at random per check."""

from __future__ import annotations

import contextlib
import math
import random
from typing import Any

import torch
import torch.distributed as dist

from lab_utils.distributed import ranks as ranks_mod
from lab_utils.distributed.spawn import WorkerContext
from lab_utils.exercises.framework import CodeExercise, References, Wrong, fraction, source_as
from lab_utils.exercises.lab02.in_ranks import grading_ranks, no_distributed, plain, run_in_ranks, shipped_answer, show

METRIC_TIMEOUT_S = 180.0


def metric_shards(nprocs: int, seed: int | None = None) -> list[dict[str, Any]]:
    """Rank r's evaluation shard on ``nprocs`` ranks: rank, correct, seen, accuracy (= correct / seen).

    Drawn at random for every check (``seed`` makes them reproducible): shards of different sizes, as shards of
    files are in a real evaluation, with whole counts, so no fixed accuracy can pass.
    """
    rng = random.Random(seed)
    while True:
        rows = []
        for r in range(nprocs):
            seen = rng.randrange(100, 801, 10)
            correct = round(rng.uniform(0.55, 0.97) * seen)
            rows.append({"rank": r, "correct": correct, "seen": seen, "accuracy": correct / seen})
        total = sum(s["correct"] for s in rows) / sum(s["seen"] for s in rows)
        mean = sum(s["accuracy"] for s in rows) / nprocs
        if nprocs < 2 or abs(mean - total) > 0.005:  # the plain mean, the usual mistake, must not pass
            return rows


def reference_global_accuracy(ctx: WorkerContext, correct: int, seen: int) -> float:
    """Accuracy over every rank's samples: the counts summed with one all_reduce, then divided (on every rank)."""
    counts = torch.tensor([correct, seen], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(counts)  # sums over the ranks, result on every rank
    return (counts[0] / counts[1]).item()  # correct / seen over all shards


def _metric_worker(ctx: WorkerContext, student: ranks_mod.Shipped, shards: list[dict[str, Any]]) -> Any:
    fn = student.load()
    mine = shards[ctx.rank]
    return plain(fn(ctx, mine["correct"], mine["seen"]))


def _judge_metric(values: list[Any], shards: list[dict[str, Any]], call: str) -> str:
    n = len(shards)
    correct, seen = sum(s["correct"] for s in shards), sum(s["seen"] for s in shards)
    total = correct / seen
    accs = [s["accuracy"] for s in shards]
    mean = sum(accs) / n
    for r, v in enumerate(values):
        if v is None:
            raise Wrong(f"{call} returned None on rank {r} (does it end with `return ...`?); expected the accuracy "
                        "as a float on every rank")
        if isinstance(v, str) and v.strip().endswith("%"):  # "85.3%" means 0.853: the same answer
            with contextlib.suppress(Wrong):
                v = fraction(v)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise Wrong(f"{call} returned {show(v)} on rank {r}; expected the accuracy as a float")
        if math.isclose(v, total, rel_tol=1e-6):
            continue
        own = shards[r]["accuracy"]
        head = f"{call}: rank {r} returned {v:.6g}, not the accuracy over all {n} ranks' samples"
        if math.isclose(v, own, rel_tol=1e-6):
            if any(math.isclose(w, total, rel_tol=1e-6) for w in values if isinstance(w, (int, float))):
                raise Wrong(f"{head}: it is rank {r}'s own accuracy, while another rank has the total. dist.reduce "
                            "leaves the sum on one rank only; dist.all_reduce puts it on every rank")
            raise Wrong(f"{head}: it is rank {r}'s own accuracy ({shards[r]['correct']}/{shards[r]['seen']}): "
                        "nothing was combined over the ranks. dist.all_reduce the counts")
        if math.isclose(v, mean, rel_tol=1e-6):
            raise Wrong(f"{head}: it is the plain mean of the per-rank accuracies. The shards differ in size "
                        f"({', '.join(str(s['seen']) for s in shards)} samples), so each accuracy must count by its "
                        "samples: all_reduce the counts (correct, seen) with SUM, then divide")
        if math.isclose(v, sum(accs), rel_tol=1e-6):
            raise Wrong(f"{head}: it is the sum of the accuracies (an all_reduce, SUM by default, of each rank's "
                        "accuracy). Reduce the counts (correct, seen), then divide")
        if math.isclose(v, 100 * total, rel_tol=1e-6):
            raise Wrong(f"{head}: that is a percentage; return a fraction between 0 and 1")
        if math.isclose(v, correct, rel_tol=1e-6):
            raise Wrong(f"{head}: that is the number of correct predictions; divide it by the samples seen")
        if v == 0 or v == math.floor(total):
            raise Wrong(f"{head}: integer division? correct // seen is 0; divide with / (or in a float tensor)")
        raise Wrong(f"{head}: sum the correct counts and the sample counts over the ranks (one all_reduce of "
                    "a tensor [correct, seen]), then divide")
    return f"Every one of {n} ranks got {total:.5f} = {correct}/{seen}, not the mean of the accuracies ({mean:.5f})."


def _grade_global_accuracy(fn: Any) -> str:
    backend, nprocs = grading_ranks()
    shards = metric_shards(nprocs)
    call = f"global_accuracy(ctx, correct, seen) on {nprocs} {backend} ranks"
    with shipped_answer(fn, "global_accuracy") as shipped:
        values = run_in_ranks(_metric_worker, shipped, call, nprocs, backend, METRIC_TIMEOUT_S, {"shards": shards})
    return _judge_metric(values, shards, call)


q7 = CodeExercise(
    name="02.7 a metric over all ranks", var="global_accuracy", grade=_grade_global_accuracy,
    references=References("all_reduce the counts and divide yourself", reference_global_accuracy),
    signature="global_accuracy(ctx, correct, seen) -> float", applicable=no_distributed,
    hints=[
        "The accuracy over all samples is all correct predictions over all samples seen, on every rank. The "
        "shards differ in size, so the mean of the ranks' accuracies is not it.",
        "Put both counts in one tensor on ctx.device (float64 is exact for counts), dist.all_reduce it (SUM is "
        "the default), and divide. all_reduce, not reduce: every rank needs the answer.",
        "After the all_reduce the tensor holds the sums over the ranks: its first element over its second, as a "
        "Python float (.item()), is the answer on every rank.",
    ],
    solution_text=source_as(reference_global_accuracy, "global_accuracy(ctx, correct, seen)")
    + "# The mean of the per-rank accuracies weights a rank of 150 samples like one of 500.",
)
