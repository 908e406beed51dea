"""Lab 07 exercises: the service's code and configuration, checked against the running service.

One module per concern: ``service`` (``use_service(service)`` names the ``lab_utils.serving.service.Service`` the
checks use; q1 the ensemble, q3 the nginx upstream), ``preprocess`` (q2, and q5 the GPU decode step) and
``capacity`` (q4 the capacity search, q6 the capacity plan). Rates are in requests/s, latencies in ms. Nothing is
imported or started at import.

Design notes: docs/internals.md#lab_utilsexerciseslab07
"""

from lab_utils.exercises.lab07.capacity import SLO_MS, q4, q6, reference_find_capacity, reference_servers_needed
from lab_utils.exercises.lab07.preprocess import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    MAX_PIXELS,
    PIXEL_SCALE,
    Q5_SIZE,
    SIZE,
    decode_jpeg,
    jpeg_decoder,
    pixel_stats,
    q2,
    q5,
    reference_gpu_preprocess,
    reference_preprocess,
)
from lab_utils.exercises.lab07.service import Q1_NAME, q1, q3, reference_ensemble, reference_upstream, use_service

__all__ = [
    "q1", "q2", "q3", "q4", "q5", "q6", "use_service", "decode_jpeg", "jpeg_decoder", "reference_gpu_preprocess",
    "Q5_SIZE", "IMAGENET_MEAN", "IMAGENET_STD", "Q1_NAME", "PIXEL_SCALE", "SIZE", "MAX_PIXELS", "SLO_MS",
    "reference_ensemble", "reference_preprocess", "reference_find_capacity", "reference_upstream",
    "reference_servers_needed", "pixel_stats",
]
