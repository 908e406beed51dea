"""Lab 03 exercises: ONNX export, ONNX Runtime, ModelOpt INT8 and the TensorRT builder run against the real
tools (q1 and q2 ``onnx_checks``, q3 and q6 ``engines``, on the digits CNN of ``onnx_checks``), and the decisions
made with their numbers (q4, q5, q7, q8 ``decisions``). torch, onnx and the rest are imported when a check runs.

Design notes: docs/internals.md#lab_utilsexerciseslab03
"""

from lab_utils.exercises.lab03.decisions import (
    CALIBRATION_GPU_MIN,
    FP16_IMAGES_PER_S,
    IMAGES_PER_DAY,
    LATENCY_P50_MS,
    LATENCY_P95_MS,
    PRECISION_BUDGET_POINTS,
    PRECISION_CANDIDATES,
    PRECISION_CHOICES,
    PROFILE,
    QUEUE_DELAY_MS,
    REQUESTS,
    RETRAIN_DAYS,
    SLO_P95_MS,
    q4,
    q5,
    q7,
    q8,
)
from lab_utils.exercises.lab03.engines import q3, q6
from lab_utils.exercises.lab03.onnx_checks import (
    EXPORT_BATCHES,
    EXPORT_MIN_OPSET,
    ONNX_OPSET,
    ORT_BATCH,
    ORT_LEVELS,
    q1,
    q2,
)

__all__ = [
    "q1", "q2", "q3", "q4", "q5", "q6", "q7", "q8",
    "ONNX_OPSET", "EXPORT_MIN_OPSET", "EXPORT_BATCHES", "ORT_BATCH", "ORT_LEVELS",
    "PRECISION_CANDIDATES", "PRECISION_BUDGET_POINTS", "PRECISION_CHOICES",
    "CALIBRATION_GPU_MIN", "IMAGES_PER_DAY", "RETRAIN_DAYS", "FP16_IMAGES_PER_S",
    "PROFILE", "REQUESTS",
    "LATENCY_P50_MS", "LATENCY_P95_MS", "SLO_P95_MS", "QUEUE_DELAY_MS",
]
