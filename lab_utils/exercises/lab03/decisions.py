"""03.4, 03.5, 03.7 and 03.8: decisions made with measured numbers (a precision for an accuracy budget, the
speedup that pays for calibration, an optimization profile read, a batch size for a p95 target)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lab_utils.exercises.framework import Exercise, Wrong, choice, close_to, integer

# --------------------------------------------------------------------------------------------------
# 03.4 an accuracy budget -> the precision

# Measured on a 50,000-image validation set for one model: accuracy change against FP32 (points; one image is
# 0.002 points) and engine throughput.
PRECISION_CANDIDATES = {
    "fp32": {"accuracy_delta_points": 0.0, "images_per_s": 1500},
    "fp16": {"accuracy_delta_points": -0.02, "images_per_s": 4200},
    "int8": {"accuracy_delta_points": -0.7, "images_per_s": 6900},
    "fp8": {"accuracy_delta_points": -1.6, "images_per_s": 7300},
}
PRECISION_BUDGET_POINTS = 1.0  # the product accepts at most 1 point of accuracy lost against FP32
PRECISION_CHOICES = tuple(PRECISION_CANDIDATES)

_PRECISION_TABLE = {k: dict(v) for k, v in PRECISION_CANDIDATES.items()}  # the grader's own copy
_PRECISION_BEST = max((k for k, v in _PRECISION_TABLE.items()
                       if -v["accuracy_delta_points"] <= PRECISION_BUDGET_POINTS),
                      key=lambda k: _PRECISION_TABLE[k]["images_per_s"])  # int8


def _grade_precision(value: Any) -> None:
    got = choice(value, PRECISION_CHOICES)
    if got is None:
        raise Wrong(f"answer with one of {list(PRECISION_CHOICES)}, as a string")
    if got == _PRECISION_BEST:
        return
    row = _PRECISION_TABLE[got]
    if -row["accuracy_delta_points"] > PRECISION_BUDGET_POINTS:
        raise Wrong(f"{got} is the fastest, but it loses {-row['accuracy_delta_points']} points, more than the "
                    f"{PRECISION_BUDGET_POINTS} point budget.")
    raise Wrong(f"{got} is within the budget, but another precision is too and runs faster "
                f"({row['images_per_s']} images/s here): take the fastest one that fits.")


q4 = Exercise(
    name="03.4 pick the precision for an accuracy budget", var="precision", grade=_grade_precision,
    hints=[
        "First drop every precision that loses more than PRECISION_BUDGET_POINTS of accuracy; then compare speed.",
        "Of fp32, fp16 and int8 (within budget), which has the highest images_per_s?",
    ],
    solution_text=(
        "budget = PRECISION_BUDGET_POINTS\n"
        "ok = {p: r for p, r in PRECISION_CANDIDATES.items() if -r['accuracy_delta_points'] <= budget}\n"
        "precision = max(ok, key=lambda p: ok[p]['images_per_s'])   # 'int8'\n"
        "# fp8 would be faster still but loses 1.6 points (800 of 50,000 images). Re-measure after every\n"
        "# retraining: the loss of a quantized model depends on the model and the calibration data."
    ),
)

# --------------------------------------------------------------------------------------------------
# 03.5 the speedup that pays for calibration

CALIBRATION_GPU_MIN = 30.0  # GPU-minutes: calibrate, build the INT8 engine, validate accuracy
IMAGES_PER_DAY = 2_000_000
RETRAIN_DAYS = 14  # the model is retrained (and recalibrated) every two weeks
FP16_IMAGES_PER_S = 5000.0  # the FP16 engine's throughput on the same GPU

_SERVE_MIN = IMAGES_PER_DAY * RETRAIN_DAYS / FP16_IMAGES_PER_S / 60  # 93.3 GPU-minutes at FP16
_SPEEDUP = 1 / (1 - CALIBRATION_GPU_MIN / _SERVE_MIN)  # 1.4737

q5 = Exercise(
    name="03.5 the speedup that pays for calibration", var="breakeven_speedup",
    grade=close_to(
        _SPEEDUP, rel=0.01, reveal=False,
        why="INT8 saves T·(1 - 1/s) GPU-minutes over the model's life, T being the FP16 serving time; it must "
            "save at least the calibration's cost.",
        slips={
            (1 + CALIBRATION_GPU_MIN / _SERVE_MIN) / _SPEEDUP:
                "that is 1 + C/T. A speedup s cuts the serving time to T/s, so the saving is T - T/s = T(1 - 1/s); "
                "solve T(1 - 1/s) = C for s.",
            1 / (1 - CALIBRATION_GPU_MIN / (_SERVE_MIN * 60)) / _SPEEDUP:
                "the serving time looks like seconds while the calibration cost is in minutes: put both in "
                "GPU-minutes (or both in seconds).",
        },
    ),
    hints=[
        "Serving at FP16 takes T = images / throughput of GPU time over the model's life (RETRAIN_DAYS days). INT8 "
        "at speedup s takes T / s.",
        "Break-even: T - T/s = C (the calibration's GPU-minutes), so s = 1 / (1 - C/T). Keep C and T in the "
        "same unit.",
        "T: the images of RETRAIN_DAYS days over FP16_IMAGES_PER_S is seconds of GPU time; divide by 60 for "
        "minutes, the unit of CALIBRATION_GPU_MIN. Then hint 2's break-even formula.",
    ],
    solution_text=(
        "T = IMAGES_PER_DAY * RETRAIN_DAYS / FP16_IMAGES_PER_S / 60     # 93.3 GPU-minutes at FP16\n"
        "breakeven_speedup = 1 / (1 - CALIBRATION_GPU_MIN / T)          # 1.47\n"
        "# Below a 1.47x INT8 speedup the calibration costs more GPU time than it saves in two weeks; with\n"
        "# ten times the traffic the break-even drops to 1.03x. (Engineer time is extra.)"
    ),
)


# --------------------------------------------------------------------------------------------------
# 03.7 read an optimization profile

PROFILE = {"input": "input", "min": (1, 3, 224, 224), "opt": (16, 3, 224, 224), "max": (64, 3, 224, 224)}
REQUESTS = {
    "a": (1, 3, 224, 224),
    "b": (16, 3, 224, 224),
    "c": (64, 3, 224, 224),
    "d": (65, 3, 224, 224),
    "e": (32, 3, 256, 256),
    "f": (8, 3, 224, 224),
}

_PROFILE_MIN, _PROFILE_MAX = PROFILE["min"], PROFILE["max"]  # the grader's own (tuples: a later change is no matter)
_SHAPES = dict(REQUESTS)
_RUNS = {k for k, s in _SHAPES.items() if all(lo <= d <= hi for lo, d, hi in zip(_PROFILE_MIN, s, _PROFILE_MAX,
                                                                                  strict=True))}
_WHY = {
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
        items: Iterable[Any] = value.replace(",", " ").split() if " " in value or "," in value else list(value)
    elif isinstance(value, (set, frozenset, list, tuple)):
        items = value
    else:
        raise Wrong("answer with the names of the requests that run, e.g. {'a', 'b'}")
    names = {str(v).strip().lower() for v in items if str(v).strip()}
    unknown = names - set(_SHAPES)
    if unknown:
        raise Wrong(f"{sorted(unknown)} are not requests; the requests are {sorted(_SHAPES)}")
    return names


def _grade_runnable(value: Any) -> None:
    got = _names(value)
    if got != _RUNS:  # the first request wrongly in, else the first one missing
        raise Wrong(_WHY[min(got - _RUNS or _RUNS - got)])


q7 = Exercise(
    name="03.7 read an optimization profile", var="runnable", grade=_grade_runnable,
    hints=[
        "An engine built with a profile accepts an input when every dimension lies between the profile's min "
        "and max, both included. opt only says which shape the kernels were tuned for.",
        "Check each request dimension by dimension against PROFILE['min'] and PROFILE['max'].",
        "Keep the keys of REQUESTS whose shape passes: zip the profile's min, the shape and the profile's max, "
        "and require min <= d <= max for every dimension at once (all).",
    ],
    solution_text=(
        "lo, hi = PROFILE['min'], PROFILE['max']\n"
        "runnable = sorted(k for k, s in REQUESTS.items() if all(a <= d <= b for a, d, b in zip(lo, s, hi)))\n"
        "# {'a', 'b', 'c', 'f'}: d is one over max (batch 65), e has 256 px images where the profile fixes 224.\n"
        "# In code: lab_utils.inference.tensorrt.Profile('input', lo, PROFILE['opt'], hi).accepts(shape)"
    ),
)


# --------------------------------------------------------------------------------------------------
# 03.8 a p95 latency target -> the batch size

# One execution of a ResNet-50 FP16 engine by batch size, p50 and p95 over many executions (the shape of an
# engine on one data-centre GPU under load; the point is the trade-off, not the exact numbers).
LATENCY_P50_MS = {1: 0.9, 2: 1.0, 4: 1.3, 8: 2.0, 16: 3.6, 32: 8.0, 48: 11.0, 64: 13.0, 128: 19.0}
LATENCY_P95_MS = {1: 1.2, 2: 1.4, 4: 1.8, 8: 2.8, 16: 5.0, 32: 11.0, 48: 15.2, 64: 18.0, 128: 25.0}
SLO_P95_MS = 30.0  # the service's p95 target, from request arrival to response
QUEUE_DELAY_MS = 2.0  # the dynamic batcher waits up to this long for a batch to fill when the GPU is free

_P50 = dict(LATENCY_P50_MS)  # the grader's own copies
_P95 = dict(LATENCY_P95_MS)


def _worst_ms(execution_ms: float) -> float:
    """A request that arrives just after a batch started waits for that batch (one execution; its own batch
    fills meanwhile, or for the queue delay if that is longer), then for its own execution."""
    return max(QUEUE_DELAY_MS, execution_ms) + execution_ms


_BATCH_BEST = max(b for b, ms in _P95.items() if _worst_ms(ms) <= SLO_P95_MS)  # 32
_BATCH_P50 = max(b for b, ms in _P50.items() if _worst_ms(ms) <= SLO_P95_MS)  # 64: p50 times instead of p95
_BATCH_NO_WAIT = max(b for b, ms in _P95.items() if QUEUE_DELAY_MS + ms <= SLO_P95_MS)  # 128: no batch in flight


def _grade_batch(value: Any) -> None:
    got = integer(value, "the batch size")
    if got not in _P95:
        raise Wrong(f"answer with one of the measured batch sizes {sorted(_P95)}")
    if got == _BATCH_BEST:
        return
    ms = _P95[got]
    if got > _BATCH_BEST and got == _BATCH_P50 and got != _BATCH_NO_WAIT:
        raise Wrong(f"batch {got} fits with the p50 times ({_P50[got]} + {_P50[got]} = {2 * _P50[got]:g} ms), but the "
                    f"target is a p95: with the p95 times it is {ms} + {ms} = {_worst_ms(ms):g} ms > {SLO_P95_MS:g}.")
    if got > _BATCH_BEST and got == _BATCH_NO_WAIT:
        raise Wrong(f"batch {got} runs in {ms} ms at p95, and {QUEUE_DELAY_MS:g} ms of queueing keeps it within "
                    f"{SLO_P95_MS:g} ms, but a request can arrive just after a batch has started: it waits for that "
                    f"batch ({ms} ms) before its own runs ({ms} ms): {_worst_ms(ms):g} ms > {SLO_P95_MS:g}.")
    if got > _BATCH_BEST:
        raise Wrong(f"batch {got}: the batch already executing ({ms} ms at p95) and then its own ({ms} ms) make "
                    f"{_worst_ms(ms):g} ms > {SLO_P95_MS:g} ms.")
    raise Wrong(f"batch {got} fits, but a larger one fits too and serves more images per second "
                f"({got / _P95[got] * 1e3:.0f} images/s here at p95): take the largest that fits.")


q8 = Exercise(
    name="03.8 a p95 latency target -> batch size", var="max_batch", grade=_grade_batch,
    hints=[
        "The target is a p95, so plan with the p95 execution times. One GPU instance runs one batch at a time.",
        "The worst case: a request arrives just after a batch has started. It waits for that batch to finish "
        "(its own batch fills meanwhile, or for QUEUE_DELAY_MS if that is longer), then for its own execution: "
        "max(QUEUE_DELAY_MS, t) + t.",
        "Go through LATENCY_P95_MS (batch -> p95 ms) and keep the largest batch whose worst case (hint 2) is "
        "within SLO_P95_MS.",
    ],
    solution_text=(
        "max_batch = max(b for b, t in LATENCY_P95_MS.items() if max(QUEUE_DELAY_MS, t) + t <= SLO_P95_MS)   # 32\n"
        "# 11 ms for the batch in flight + 11 ms for its own = 22 ms <= 30; batch 48 needs 30.4 ms. Batch 64\n"
        "# passes with the p50 times (26 ms) but not with the p95 (36 ms); batch 128 passes only if you forget\n"
        "# the batch already executing (2 + 25 = 27 ms)."
    ),
)
