"""Lab 08 exercises: MLOps, checked against the real tools: an MLflow tracking server, a Prometheus scraping metric
sources whose history the check scripts, and the canary loop of ``lab_utils.mlops.canary``.

``use_tracking(server)``, ``use_ab(result)`` and ``use_bench(bench)`` (optional) hand the checks what the lab
started or measured. q1 ``log_run(tracking_uri, experiment, result, onnx_path) -> run_id`` (``tracking``); q2
``canary_queries(window) -> {"error_rate", "p95_ms", "accuracy"}`` (``promql``, on its metrics bench); q3
``decide(state, metrics, guards) -> Decision`` (``decision``); q4 ``sample_size(p_a, p_b, alpha=0.05, power=0.8) ->
int`` per group, q5 the A/B verdict, ``"real"`` or ``"not real"``, q6 ``psi(reference, current, bins=10) -> float``
(``stats``). Nothing is imported or started at import.

Design notes: docs/internals.md#lab_utilsexerciseslab08
"""

from lab_utils.exercises.lab08.common import Q2_WINDOW, SERVICE_MODEL, use_ab, use_tracking
from lab_utils.exercises.lab08.decision import LIVE_GUARDS, q3, reference_decide
from lab_utils.exercises.lab08.promql import MetricsBench, q2, reference_canary_queries, use_bench
from lab_utils.exercises.lab08.stats import q4, q5, q6, reference_psi, reference_sample_size, reference_verdict
from lab_utils.exercises.lab08.tracking import q1, reference_log_run

__all__ = [
    "q1", "q2", "q3", "q4", "q5", "q6", "use_tracking", "use_ab", "use_bench", "MetricsBench",
    "reference_log_run", "reference_canary_queries", "reference_decide", "reference_sample_size", "reference_psi",
    "reference_verdict", "SERVICE_MODEL", "Q2_WINDOW", "LIVE_GUARDS",
]
