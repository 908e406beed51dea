"""Lab 04 exercises: the code a serving engineer writes, run against the lab's Triton server
(``use_server(server, repo)``), and the numbers read off it: q1 and q2 ``config``, q3 and q4 ``server``, q6
``execute``, q5, q7 and q8 ``numbers``. tritonclient is imported when a check runs.

Design notes: docs/internals.md#lab_utilsexerciseslab04
"""

from lab_utils.exercises.lab04.config import (
    DEPLOY_CONFIG,
    DEPLOY_DISK_CONFIG,
    DEPLOY_MODEL,
    Q1_MODEL_SHAPES,
    Q1_REQUIREMENTS,
    q1,
    q2,
)
from lab_utils.exercises.lab04.execute import EXECUTE_MODEL, EXECUTE_ROWS, q6
from lab_utils.exercises.lab04.numbers import (
    Q5_CONCURRENCY,
    Q5_THROUGHPUT_INFER_S,
    Q7_MEASURED,
    Q7_P95_TARGET_MS,
    Q8_STATS,
    q5,
    q7,
    q8,
)
from lab_utils.exercises.lab04.server import q3, q4, use_server

__all__ = [
    "q1", "q2", "q3", "q4", "q5", "q6", "q7", "q8",
    "use_server",
    "Q1_REQUIREMENTS", "Q1_MODEL_SHAPES",
    "DEPLOY_MODEL", "DEPLOY_DISK_CONFIG", "DEPLOY_CONFIG",
    "Q5_CONCURRENCY", "Q5_THROUGHPUT_INFER_S",
    "EXECUTE_MODEL", "EXECUTE_ROWS",
    "Q7_P95_TARGET_MS", "Q7_MEASURED",
    "Q8_STATS",
]
