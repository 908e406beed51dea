"""Lab 03 exercises: inference optimization decisions.

Four questions a deployment engineer answers with the lab's numbers: the precision an accuracy budget
allows, the speedup that pays for INT8 calibration, which requests an optimization profile accepts, and the
largest batch a latency budget allows. The data are fixed (an engine's measured shape, not this
machine's), so a check gives the same verdict everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lab_utils.exercises.framework import Exercise, Wrong, close_to, integer

__all__ = [
    "q1", "q2", "q3", "q4",
    "Q1_CANDIDATES", "Q1_BUDGET_POINTS", "Q1_CHOICES",
    "Q2_CALIBRATION_GPU_MIN", "Q2_IMAGES_PER_DAY", "Q2_DAYS", "Q2_FP16_IMAGES_PER_S",
    "Q3_PROFILE", "Q3_REQUESTS",
    "Q4_LATENCY_MS", "Q4_SLO_MS", "Q4_QUEUE_MS",
]

# --- q1: an accuracy budget -> the precision ------------------------------------------------------------

# Measured on a validation set for one model: accuracy change against FP32 (points) and engine throughput.
Q1_CANDIDATES = {
    "fp32": {"accuracy_delta_points": 0.0, "images_per_s": 1500},
    "fp16": {"accuracy_delta_points": -0.02, "images_per_s": 4200},
    "int8": {"accuracy_delta_points": -0.7, "images_per_s": 6900},
    "fp8": {"accuracy_delta_points": -1.6, "images_per_s": 7300},
}
Q1_BUDGET_POINTS = 1.0  # the product accepts at most 1 point of accuracy lost against FP32
Q1_CHOICES = tuple(Q1_CANDIDATES)

_Q1_TABLE = {k: dict(v) for k, v in Q1_CANDIDATES.items()}
_Q1_BEST = max((k for k, v in _Q1_TABLE.items() if -v["accuracy_delta_points"] <= Q1_BUDGET_POINTS),
               key=lambda k: _Q1_TABLE[k]["images_per_s"])  # int8


def _grade_precision(value: Any) -> None:
    if not isinstance(value, str) or value.strip().lower() not in _Q1_TABLE:
        raise Wrong(f"answer with one of {list(Q1_CHOICES)}, as a string")
    got = value.strip().lower()
    if got == _Q1_BEST:
        return
    row = _Q1_TABLE[got]
    if -row["accuracy_delta_points"] > Q1_BUDGET_POINTS:
        raise Wrong(f"{got} is the fastest, but it loses {-row['accuracy_delta_points']} points, more than the "
                    f"{Q1_BUDGET_POINTS} point budget.")
    raise Wrong(f"{got} is within the budget, but another precision is too and runs faster "
                f"({row['images_per_s']} images/s here): take the fastest one that fits.")


q1 = Exercise(
    name="03.1 pick the precision for an accuracy budget",
    var="precision",
    grade=_grade_precision,
    hints=[
        "First drop every precision that loses more than Q1_BUDGET_POINTS of accuracy; then compare speed.",
        "Of fp32, fp16 and int8 (within budget), which has the highest images_per_s?",
    ],
    solution_text=(
        "ok = {p: r for p, r in Q1_CANDIDATES.items() if -r['accuracy_delta_points'] <= Q1_BUDGET_POINTS}\n"
        "precision = max(ok, key=lambda p: ok[p]['images_per_s'])   # 'int8'\n"
        "# fp8 would be faster still but loses 1.6 points. Re-measure after every retraining: the loss of a\n"
        "# quantized model depends on the model and the calibration data, not only on the format."
    ),
)

# --- q2: the speedup that pays for calibration --------------------------------------------------------------

Q2_CALIBRATION_GPU_MIN = 30.0  # GPU-minutes: calibrate, build the INT8 engine, validate accuracy
Q2_IMAGES_PER_DAY = 2_000_000
Q2_DAYS = 14  # the model is retrained (and recalibrated) every two weeks
Q2_FP16_IMAGES_PER_S = 5000.0  # the FP16 engine's throughput on the same GPU

_Q2_SERVE_MIN = Q2_IMAGES_PER_DAY * Q2_DAYS / Q2_FP16_IMAGES_PER_S / 60  # 93.3 GPU-minutes at FP16
_Q2_SPEEDUP = 1 / (1 - Q2_CALIBRATION_GPU_MIN / _Q2_SERVE_MIN)  # 1.4737

q2 = Exercise(
    name="03.2 the speedup that pays for calibration",
    var="breakeven_speedup",
    grade=close_to(
        _Q2_SPEEDUP,
        rel=0.01,
        reveal=False,
        why="INT8 saves T·(1 - 1/s) GPU-minutes over the model's life, T being the FP16 serving time; it must "
            "save at least the calibration's cost.",
        slips={
            (1 + Q2_CALIBRATION_GPU_MIN / _Q2_SERVE_MIN) / _Q2_SPEEDUP:
                "that is 1 + C/T. A speedup s cuts the serving time to T/s, so the saving is T - T/s = T(1 - 1/s); "
                "solve T(1 - 1/s) = C for s.",
            1 / (1 - Q2_CALIBRATION_GPU_MIN / (_Q2_SERVE_MIN * 60)) / _Q2_SPEEDUP:
                "the serving time looks like seconds while the calibration cost is in minutes: put both in "
                "GPU-minutes (or both in seconds).",
        },
    ),
    hints=[
        "Serving at FP16 takes T = images / throughput of GPU time over the model's life (Q2_DAYS days). INT8 "
        "at speedup s takes T / s.",
        "Break-even: T - T/s = C (the calibration's GPU-minutes), so s = 1 / (1 - C/T). Keep C and T in the "
        "same unit.",
        "T = Q2_IMAGES_PER_DAY * Q2_DAYS / Q2_FP16_IMAGES_PER_S / 60; breakeven_speedup = 1 / (1 - "
        "Q2_CALIBRATION_GPU_MIN / T)",
    ],
    solution_text=(
        "T = Q2_IMAGES_PER_DAY * Q2_DAYS / Q2_FP16_IMAGES_PER_S / 60     # 93.3 GPU-minutes at FP16\n"
        "breakeven_speedup = 1 / (1 - Q2_CALIBRATION_GPU_MIN / T)          # 1.47\n"
        "# Below a 1.47x INT8 speedup the calibration costs more GPU time than it saves in two weeks; with\n"
        "# ten times the traffic the break-even drops to 1.03x. (Engineer time is extra.)"
    ),
)

# --- q3: read an optimization profile ---------------------------------------------------------------------

Q3_PROFILE = {"input": "input", "min": (1, 3, 224, 224), "opt": (16, 3, 224, 224), "max": (64, 3, 224, 224)}
Q3_REQUESTS = {
    "a": (1, 3, 224, 224),
    "b": (16, 3, 224, 224),
    "c": (64, 3, 224, 224),
    "d": (65, 3, 224, 224),
    "e": (32, 3, 256, 256),
    "f": (8, 3, 224, 224),
}

_Q3_MIN, _Q3_MAX = (1, 3, 224, 224), (64, 3, 224, 224)
_Q3_SHAPES = dict(Q3_REQUESTS)
_Q3_RUNS = {k for k, s in _Q3_SHAPES.items() if all(lo <= d <= hi for lo, d, hi in zip(_Q3_MIN, s, _Q3_MAX,
                                                                                         strict=True))}
_Q3_WHY = {
    "c": "request c is batch 64, exactly the profile's max: min and max are inclusive, so it runs.",
    "a": "request a is batch 1, exactly the profile's min: min and max are inclusive, so it runs.",
    "b": "request b is the opt shape itself: it runs, and with the kernels TensorRT tuned for.",
    "f": "request f is batch 8, between min 1 and max 64: it runs (on kernels tuned for 16).",
    "d": "request d is batch 65, one over the max of 64: set_input_shape refuses it. Split it, or build with a "
         "larger max.",
    "e": "request e is 256x256 px: every dimension must lie within min..max, and this profile fixes the image "
         "at 224x224.",
}


def _names(value: Any) -> set[str]:
    if isinstance(value, str):
        items: Iterable[Any] = [c for c in value.replace(",", " ").split()] if " " in value or "," in value \
            else list(value)
    elif isinstance(value, (set, frozenset, list, tuple)):
        items = value
    else:
        raise Wrong("answer with the names of the requests that run, e.g. {'a', 'b'}")
    names = {str(v).strip().lower() for v in items if str(v).strip()}
    unknown = names - set(_Q3_SHAPES)
    if unknown:
        raise Wrong(f"{sorted(unknown)} are not requests; the requests are {sorted(_Q3_SHAPES)}")
    return names


def _grade_runnable(value: Any) -> None:
    got = _names(value)
    if got == _Q3_RUNS:
        return
    wrongly_in = sorted(got - _Q3_RUNS)
    missing = sorted(_Q3_RUNS - got)
    if wrongly_in:
        raise Wrong(_Q3_WHY[wrongly_in[0]])
    raise Wrong(_Q3_WHY[missing[0]])


q3 = Exercise(
    name="03.3 read an optimization profile",
    var="runnable",
    grade=_grade_runnable,
    hints=[
        "An engine built with a profile accepts an input when every dimension lies between the profile's min "
        "and max, both included. opt only says which shape the kernels were tuned for.",
        "Check each request dimension by dimension against Q3_PROFILE['min'] and Q3_PROFILE['max'].",
        "runnable = {k for k, s in Q3_REQUESTS.items() if all(lo <= d <= hi for lo, d, hi in "
        "zip(Q3_PROFILE['min'], s, Q3_PROFILE['max']))}",
    ],
    solution_text=(
        "lo, hi = Q3_PROFILE['min'], Q3_PROFILE['max']\n"
        "runnable = sorted(k for k, s in Q3_REQUESTS.items() if all(a <= d <= b for a, d, b in zip(lo, s, hi)))\n"
        "# {'a', 'b', 'c', 'f'}: d is one over max (batch 65), e has 256 px images where the profile fixes 224.\n"
        "# In code: lab_utils.inference.tensorrt.Profile('input', lo, Q3_PROFILE['opt'], hi).accepts(shape)"
    ),
)

# --- q4: a latency budget -> the batch size ------------------------------------------------------------

# p50 latency (ms) of one execution of a ResNet-50 FP16 engine by batch size (shape of an engine on one
# data-centre GPU; the point is the trade-off, not the exact numbers).
Q4_LATENCY_MS = {1: 0.9, 2: 1.0, 4: 1.3, 8: 2.0, 16: 3.6, 32: 6.8, 64: 9.1, 128: 17.5}
Q4_SLO_MS = 10.0  # the service's p50 target, from request arrival to response
Q4_QUEUE_MS = 2.5  # the dynamic batcher waits up to this long to fill a batch

_Q4_TABLE = dict(Q4_LATENCY_MS)  # the grader's own copy
_Q4_BEST = max(b for b, ms in _Q4_TABLE.items() if ms + Q4_QUEUE_MS <= Q4_SLO_MS)  # 32
_Q4_NO_QUEUE = max(b for b, ms in _Q4_TABLE.items() if ms <= Q4_SLO_MS)  # 64


def _grade_batch(value: Any) -> None:
    got = integer(value, "the batch size")
    if got not in _Q4_TABLE:
        raise Wrong(f"answer with one of the measured batch sizes {sorted(_Q4_TABLE)}")
    if got == _Q4_BEST:
        return
    if got == _Q4_NO_QUEUE:
        raise Wrong(f"batch {got} runs in {_Q4_TABLE[got]} ms, within {Q4_SLO_MS} ms, but a request also waits up to "
                    f"{Q4_QUEUE_MS} ms in the batcher's queue: {_Q4_TABLE[got]} + {Q4_QUEUE_MS} > {Q4_SLO_MS}.")
    if got == max(_Q4_TABLE):
        raise Wrong(f"batch {got} has the highest throughput, but one execution takes {_Q4_TABLE[got]} ms: "
                    f"over the {Q4_SLO_MS} ms target before any queueing.")
    if got > _Q4_BEST:
        raise Wrong(f"batch {got}: {_Q4_TABLE[got]} ms + {Q4_QUEUE_MS} ms of queueing exceeds {Q4_SLO_MS} ms.")
    raise Wrong(f"batch {got} fits, but a larger one fits too and serves more images per second "
                f"({got / _Q4_TABLE[got] * 1e3:.0f} images/s here): take the largest that fits.")


q4 = Exercise(
    name="03.4 latency budget -> batch size",
    var="max_batch",
    grade=_grade_batch,
    hints=[
        "Throughput grows with the batch, latency too. The latency a user sees is the time waiting for the "
        "batch to fill plus the execution.",
        "A batch size fits when Q4_LATENCY_MS[batch] + Q4_QUEUE_MS <= Q4_SLO_MS. Among those, take the largest.",
        "max_batch = max(b for b, ms in Q4_LATENCY_MS.items() if ms + Q4_QUEUE_MS <= Q4_SLO_MS)",
    ],
    solution_text=(
        "max_batch = max(b for b, ms in Q4_LATENCY_MS.items() if ms + Q4_QUEUE_MS <= Q4_SLO_MS)   # 32\n"
        "# 6.8 ms + 2.5 ms of queueing = 9.3 ms <= 10 ms; batch 64 runs in 9.1 ms alone but 11.6 ms with the\n"
        "# queue. Batch 32 serves 32 / 6.8 ms = 4,700 images/s; batch 1 only 1,100."
    ),
)

