"""Lab 05 exercises: PromQL, an alert rule, a watchdog, alert thresholds, reading metrics, finding the bottleneck.

One module per concern, each saying how its checks grade: ``promql`` (q1, q2: a real Prometheus), ``alert`` (q4:
``promtool test rules``), ``watchdog`` (q5: a real Triton server the check kills and hangs) and ``readings`` (q3,
q6, q7: fixed data). Without prometheus and promtool the PromQL and rule checks say how to install them instead of
grading; without a Triton server binary the watchdog check is not applicable.

Design notes: docs/internals.md#lab_utilsexerciseslab05
"""

from lab_utils.exercises.lab05.alert import (
    ALERT_BURST_S,
    ALERT_OVERLOAD_S,
    ALERT_SERIES,
    ALERT_THRESHOLD_MS,
    alert_series_frame,
    q4,
)
from lab_utils.exercises.lab05.promql import GRADING_TIMES, RECORDED, q1, q2
from lab_utils.exercises.lab05.readings import (
    BASELINE_P99_MS,
    BASELINE_PENDING,
    BOTTLENECK_MODELS,
    HEADROOM,
    INCIDENT_P99_MS,
    INCIDENT_PENDING,
    SNAPSHOT_AFTER,
    SNAPSHOT_BEFORE,
    SNAPSHOT_SECONDS,
    q3,
    q6,
    q7,
)
from lab_utils.exercises.lab05.watchdog import WATCHDOG_SETTINGS, q5

__all__ = [
    "q1", "q2", "q3", "q4", "q5", "q6", "q7", "RECORDED", "GRADING_TIMES",
    "BASELINE_P99_MS", "INCIDENT_P99_MS", "BASELINE_PENDING", "INCIDENT_PENDING", "HEADROOM",
    "SNAPSHOT_BEFORE", "SNAPSHOT_AFTER", "SNAPSHOT_SECONDS", "BOTTLENECK_MODELS",
    "ALERT_SERIES", "ALERT_BURST_S", "ALERT_OVERLOAD_S", "ALERT_THRESHOLD_MS", "alert_series_frame",
    "WATCHDOG_SETTINGS",
]
