"""Lab 00 exercises: environment and driver, on this machine where it can and on the H200 captures in
``lab_utils/data/h200/`` elsewhere (``cuda_ceiling``, the GPU inventory and ``cuda_verdict`` are code the check runs).
"""

from lab_utils.exercises.lab00.ceiling import q2, reference_cuda_ceiling
from lab_utils.exercises.lab00.inventory import (
    INVENTORY_FIELDS,
    nvml_unavailable,
    q3,
    reference_nvml_inventory,
    reference_smi_inventory,
)
from lab_utils.exercises.lab00.reading import COMPONENTS, LAYERS, q1, q4, q6
from lab_utils.exercises.lab00.verdict import VERDICT_CASES, VERDICTS, cuda_verdict, q5

__all__ = [
    "q1", "q2", "q3", "q4", "q5", "q6",
    "LAYERS", "COMPONENTS", "VERDICTS", "INVENTORY_FIELDS", "VERDICT_CASES",
    "cuda_verdict", "reference_cuda_ceiling", "reference_smi_inventory",
    "reference_nvml_inventory", "nvml_unavailable",
]
