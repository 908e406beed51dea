"""Lab 00, exercises read off the stack and the H200 captures: 00.1 the layers, 00.4 the memory in GiB,
00.6 the NVLinks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lab_utils.exercises.framework import Exercise, Wrong, close_to, integer

# --- q1: layers of the stack ---------------------------------------------------------------------

LAYERS = ("driver", "cuda runtime", "cuda-x library", "framework", "serving")

# component -> (layer, a nudge shown when the student's layer is wrong)
_LAYER_OF: dict[str, tuple[str, str]] = {
    "libcuda.so": ("driver", "libcuda.so is installed with the driver package, not the toolkit: it is the "
                             "user-mode driver that every CUDA program talks to"),
    "nvidia-smi": ("driver", "nvidia-smi ships with the driver and reads it through NVML"),
    "libcudart.so": ("cuda runtime", "libcudart is the CUDA runtime API (cudaMalloc, kernel launches), "
                                     "shipped in the toolkit and inside wheels such as torch's"),
    "cuBLAS": ("cuda-x library", "cuBLAS is one of NVIDIA's math libraries built on the runtime"),
    "NCCL": ("cuda-x library", "NCCL is NVIDIA's library of GPU collectives, called by frameworks; it sits "
                               "beside cuBLAS"),
    "PyTorch": ("framework", "PyTorch calls the libraries (cuBLAS, cuDNN, NCCL); you write models in it"),
    "Triton Inference Server": ("serving", "Triton serves trained models over HTTP/gRPC"),
}
COMPONENTS = tuple(_LAYER_OF)


def _grade_layers(value: Any) -> None:
    if not isinstance(value, Mapping):
        raise Wrong(f"expected a dict mapping each component to a layer, got {type(value).__name__}")
    given = {str(k).strip().lower(): v for k, v in value.items()}
    missing = [c for c in COMPONENTS if c.lower() not in given]
    if missing:
        raise Wrong(f"missing components: {missing}")
    for component, (layer, nudge) in _LAYER_OF.items():
        answer = given[component.lower()]
        if not isinstance(answer, str) or answer.strip().lower() not in LAYERS:
            raise Wrong(f"{component!r}: {answer!r} is not a layer; use one of {list(LAYERS)}")
        if answer.strip().lower() != layer:
            raise Wrong(f"{component!r} is not in layer {answer!r}: {nudge}")


q1 = Exercise(
    name="00.1 layers of the stack", var="layers", grade=_grade_layers,
    hints=[
        f"Make a dict with every component of COMPONENTS as a key and one of LAYERS as its value: {LAYERS}.",
        "Bottom up: the driver (kernel module, libcuda, NVML tools) -> the CUDA runtime (libcudart) -> "
        "CUDA-X libraries (math, communication) -> frameworks -> serving.",
        "Two components belong to the driver, two are CUDA-X libraries; the runtime, the framework and the "
        "server are one each.",
    ],
    solution_text=(
        "layers = {\n"
        '    "libcuda.so": "driver", "nvidia-smi": "driver",\n'
        '    "libcudart.so": "cuda runtime",\n'
        '    "cuBLAS": "cuda-x library", "NCCL": "cuda-x library",\n'
        '    "PyTorch": "framework",\n'
        '    "Triton Inference Server": "serving",\n'
        "}"
    ),
)

# --- q4: total memory in GiB -----------------------------------------------------------------------

_MIB = 143771  # memory.total [MiB] in query-gpu.csv
# 140.40 GiB = 150.75e9 bytes. Datasheets count memory capacity in powers of two: the H200's "141 GB" is about
# 141 GiB (nvidia-smi: 140.4 GiB); reading it as 141e9 bytes gives 131.3 GiB, 9 GiB less than the card has.
# Bandwidth (4.8 TB/s) and link speeds count powers of ten.
_GIB = _MIB / 1024
_CAPACITY_UNITS = ("GPU datasheets count memory capacity in powers of two: the H200's '141 GB' is about 141 GiB; "
                   "bandwidth (4.8 TB/s) and link speeds count powers of ten.")
_q4_close = close_to(
    _GIB, rel=0.01, reveal=False,
    why="Take memory.total from query-gpu.csv (in MiB) and convert to GiB.",
    slips={
        1024.0: "that is the value in MiB, the CSV's unit; 1 GiB = 1024 MiB.",
        2**30 / 1e9: "that is GB (1e9 bytes), not GiB (2**30 bytes = 1024 MiB): the same memory is 7 % more in GB "
                     "than in GiB. The question asks for GiB.",
        1.024: "divide MiB by 1024, not 1000: 1 GiB = 1024 MiB.",
        1 / 1024: "that is TiB; the question asks for GiB (1024 MiB).",
        2.0**30: "that is bytes; the question asks for GiB (2**30 bytes).",
        141e9 / 2**30 / _GIB: "that reads the datasheet's '141 GB' as 141e9 bytes (131.3 GiB), which the card does "
                              "not have: " + _CAPACITY_UNITS + " The question asks for what nvidia-smi reports, "
                              "in GiB.",
    },
)


def _grade_q4(value: Any) -> None:
    from lab_utils.exercises.quiz import in_byte_unit  # lazy: pulls pandas (lab 00 needs none)

    _q4_close(in_byte_unit(value, "GiB"))  # "150.8 GB" says its unit: read in it


q4 = Exercise(
    name="00.4 H200 memory in GiB", var="memory_gib", grade=_grade_q4,
    hints=[
        "Open lab_utils/data/h200/query-gpu.csv; the header names each column's unit.",
        "memory.total is given in MiB (2**20 bytes). A GiB is 2**30 bytes, i.e. 1024 MiB.",
        "memory_gib = <memory.total in MiB> / 1024. That is the binary figure, 140.4 GiB (150.8e9 bytes). "
        + _CAPACITY_UNITS,
    ],
    solution_text=(
        "memory_gib = 143771 / 1024   # 140.4 GiB\n"
        "# 143,771 MiB = 140.4 GiB, the binary figure; in bytes 143771 * 2**20 = 150.8e9.\n"
        "# The datasheet's '141 GB' counts capacity in powers of two too: about 141 GiB, not 141e9 bytes\n"
        "# (that would be 131.3 GiB). Bandwidth (4.8 TB/s) and link speeds count powers of ten.\n"
        "# or with pandas:\n"
        "# df = pd.read_csv(path, skipinitialspace=True)\n"
        "# memory_gib = df['memory.total [MiB]'].str.split().str[0].astype(int)[0] / 1024"
    ),
)

# --- q6: NVLinks between the two GPUs --------------------------------------------------------------


def _grade_nvlinks(value: Any) -> None:
    if isinstance(value, str) and value.strip().upper().startswith("NV"):
        raise Wrong("that is the matrix entry. The legend says NV# is 'a bonded set of # NVLinks': "
                    "answer with the number of links, as an int")
    links = integer(value, "the number of NVLinks")
    if links == 18:
        return
    if links == 2:
        raise Wrong("2 is the number of GPUs; the question asks how many NVLinks join them")
    if links in (450, 900):
        raise Wrong("that is the NVLink bandwidth in GB/s; the question asks for the number of links")
    raise Wrong("read the entry in row GPU0, column GPU1 of the topology matrix, and the legend for NV#")


q6 = Exercise(
    name="00.6 NVLinks between GPU0 and GPU1", var="nvlinks", grade=_grade_nvlinks,
    hints=[
        "Open lab_utils/data/h200/topo-x2.txt (the output of `nvidia-smi topo -m` on two H200s).",
        "Find row GPU0, column GPU1. The legend at the bottom explains the code you find there.",
        "NV# means 'a bonded set of # NVLinks': the number after NV is the answer (an int).",
    ],
    solution_text=(
        "nvlinks = 18\n"
        "# topo -m shows NV18 between GPU0 and GPU1: a bonded set of 18 NVLink 4 links, 25 GB/s each way\n"
        "# per link: 450 GB/s per direction, the datasheet's 900 GB/s counting both directions."
    ),
)
