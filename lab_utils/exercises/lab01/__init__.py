"""Lab 01 exercises: CUDA and cuBLAS timing, run on this machine's device (the GPU, else the CPU) against the
reference implementations. Units: ms, TFLOP/s = 1e12 FLOP/s, GB/s = 1e9 bytes/s.

``timing_loop`` (01.1 and the device the checks run on), ``roofline`` (01.2-01.3 rates from your timing, 01.4-01.6
the roofline), ``graph`` (01.7 a CUDA graph), each exercise with its reference.

Design notes: docs/internals.md#lab_utilsexerciseslab01
"""

from lab_utils.exercises.lab01.graph import graph_unavailable, q7, reference_replay_with_graph
from lab_utils.exercises.lab01.roofline import (
    H200_RIDGE,
    q2,
    q3,
    q4,
    q5,
    q6,
    reference_copy_gbps,
    reference_matmul_tflops,
)
from lab_utils.exercises.lab01.timing_loop import AsyncDevice, grading_device, q1, reference_time_ms

__all__ = [
    "q1", "q2", "q3", "q4", "q5", "q6", "q7",
    "AsyncDevice", "H200_RIDGE",
    "reference_time_ms", "reference_matmul_tflops", "reference_copy_gbps", "reference_replay_with_graph",
    "graph_unavailable", "grading_device",
]
