"""Lab 00 exercises: environment and driver.

The questions read the H200 runner's captures in ``lab_utils/data/h200/`` (nvidia-smi.txt,
query-gpu.csv, topo-x2.txt), so every student answers about the same real machine.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from lab_utils.exercises.framework import Exercise, Wrong, close_to, integer

__all__ = ["q1", "q2", "q3", "q4", "q5", "q6", "LAYERS", "COMPONENTS", "parse_version"]

# --- q1: the CUDA version in nvidia-smi is a ceiling ---------------------------------------------

_VERSION = re.compile(r"^\s*(\d+)(?:\.(\d+))?\s*$")


def parse_version(text: str) -> tuple[int, int]:
    """``"12.10"`` -> ``(12, 10)``: (major, minor) as integers, so 12.10 sorts after 12.4."""
    major, minor = text.split(".")[:2] if "." in text else (text, "0")
    return int(major), int(minor)


def _version_answer(value: Any) -> tuple[int, int]:
    """A student's version, given as "13.0", 13.0 or 13, as (major, minor)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise Wrong(f"expected a version: a string like '12.4' or a number like 12.4, "
                    f"got {type(value).__name__}")
    text = str(value).strip()
    if re.fullmatch(r"5\d\d(\.\d+)*", text):  # R5xx drivers: 535.x, 550.x, 580.x
        raise Wrong("that is the driver version (the 'Driver Version' field). The question asks for the "
                    "'CUDA Version' field beside it: the newest CUDA that this driver supports.")
    match = _VERSION.match(text)
    if not match:
        raise Wrong("expected a CUDA version of the form major.minor, like '12.4'")
    return int(match[1]), int(match[2] or 0)


def _grade_ceiling(value: Any) -> None:
    if _version_answer(value) != (13, 0):
        raise Wrong("not the version this capture reports: read the 'CUDA Version' field at the top right "
                    "of the nvidia-smi header, beside 'Driver Version'.")


q1 = Exercise(
    name="00.1 CUDA version ceiling",
    var="cuda_ceiling",
    grade=_grade_ceiling,
    hints=[
        "Open lab_utils/data/h200/nvidia-smi.txt. The first box of the table has three fields on one line.",
        "'Driver Version' is the driver you installed; 'CUDA Version' is not an installed toolkit but the "
        "newest CUDA runtime this driver can run.",
        "Copy the number after 'CUDA Version:' as a string, e.g. cuda_ceiling = \"12.4\" (with this "
        "capture's value).",
    ],
    solution_text=(
        'cuda_ceiling = "13.0"\n'
        "# nvidia-smi's 'CUDA Version' (here 13.0) is the newest CUDA the driver 580.159.04 supports;\n"
        "# NVML gives the same number: pynvml.nvmlSystemGetCudaDriverVersion() -> 13000."
    ),
)

# --- q2: can this runtime run under this driver? -------------------------------------------------

# (driver_ceiling, runtime) -> expected, and why. Simple cases first, so a function that is wrong
# everywhere hears about the simplest case; "12.10" is hypothetical but legal and catches comparing
# versions as strings or floats ("12.10" < "12.4" as strings; 12.10 == 12.1 as a float).
_RUNTIME_CASES: list[tuple[str, str, bool, str]] = [
    ("13.0", "12.8", True, "an older runtime runs on a newer driver (drivers are backward compatible)"),
    ("13.0", "13.0", True, "a runtime equal to the ceiling is supported"),
    ("12.4", "13.0", False, "a runtime newer than the driver's ceiling needs forward compatibility"),
    ("13.0", "13.1", False, "13.1 is newer than 13.0: the minor number counts too"),
    ("13.0", "11.8", True, "an older major version runs on a newer driver"),
    ("12.4", "12.10", False, "12.10 is a newer release than 12.4 (minor 10 > minor 4)"),
    ("12.10", "12.9", True, "12.9 is an older release than 12.10 (minor 9 < minor 10)"),
]


def _is_bool(result: Any) -> bool:
    # numpy's bool (np.bool_ / np.bool) is a fine answer too.
    kind = type(result)
    return isinstance(result, bool) or (kind.__module__ == "numpy" and "bool" in kind.__name__)


def _grade_runtime_ok(fn: Any) -> None:
    if not callable(fn):
        raise Wrong(f"expected a function runtime_ok(driver_ceiling, runtime) -> bool, "
                    f"got a {type(fn).__name__}; define it with `def runtime_ok(...)` and pass the function")
    for ceiling, runtime, expected, why in _RUNTIME_CASES:
        call = f"runtime_ok({ceiling!r}, {runtime!r})"
        try:
            got = fn(ceiling, runtime)
        except Exception as err:
            raise Wrong(f"{call} raised {type(err).__name__}: {err}") from None
        if not _is_bool(got):
            raise Wrong(f"{call} returned {got!r} ({type(got).__name__}); return True or False")
        if bool(got) == expected:
            continue
        # Where comparing as strings and as floats both give the wrong result, that is the bug to name.
        naive = {runtime <= ceiling, float(runtime) <= float(ceiling)}
        if expected not in naive:
            raise Wrong(f"{call} returned {got}, expected {expected}: {why}. Compared as strings, "
                        f"'12.10' < '12.4' (character by character, '1' < '4'); as floats, 12.10 == 12.1. "
                        f"Compare (major, minor) as integers: tuple(int(p) for p in v.split('.')[:2]).")
        raise Wrong(f"{call} returned {got}, expected {expected}: {why}.")


q2 = Exercise(
    name="00.2 runtime under driver",
    var="runtime_ok",
    grade=_grade_runtime_ok,
    hints=[
        "The runtime can run when it is not newer than the driver's ceiling: runtime <= driver_ceiling. "
        "The catch is what '<=' means for versions.",
        "'12.10' <= '12.4' is True for strings (compared character by character), and float('12.10') is "
        "12.1. Versions are compared part by part, as integers.",
        "Turn each version into a tuple of ints: tuple(int(p) for p in v.split('.')[:2]); tuples compare "
        "element by element, so (12, 10) > (12, 4).",
    ],
    solution_text=(
        "def runtime_ok(driver_ceiling: str, runtime: str) -> bool:\n"
        '    """True when a CUDA runtime (e.g. torch.version.cuda) runs under a driver whose\n'
        "    ceiling (nvidia-smi's 'CUDA Version') is driver_ceiling; newer needs forward compat.\"\"\"\n"
        "    def key(v: str) -> tuple[int, int]:\n"
        "        major, minor = (v.split('.') + ['0'])[:2]\n"
        "        return int(major), int(minor)\n"
        "    return key(runtime) <= key(driver_ceiling)"
    ),
)

# --- q3: NVLinks between the two GPUs --------------------------------------------------------------


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


q3 = Exercise(
    name="00.3 NVLinks between GPU0 and GPU1",
    var="nvlinks",
    grade=_grade_nvlinks,
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

# --- q4: total memory in GiB -----------------------------------------------------------------------

_MIB = 143771  # memory.total [MiB] in query-gpu.csv
_GIB = _MIB / 1024  # 140.40 GiB

q4 = Exercise(
    name="00.4 H200 memory in GiB",
    var="memory_gib",
    grade=close_to(
        _GIB,
        rel=0.01,
        reveal=False,
        why="Take memory.total from query-gpu.csv (in MiB) and convert to GiB.",
        slips={
            1024.0: "that is the value in MiB, the CSV's unit; 1 GiB = 1024 MiB.",
            2**30 / 1e9: "that is GB (1e9 bytes), not GiB (2**30 bytes = 1024 MiB): MiB / 1024 gives GiB.",
            1.024: "divide MiB by 1024, not 1000: 1 GiB = 1024 MiB.",
            1 / 1024: "that is TiB; the question asks for GiB (1024 MiB).",
            2.0**30: "that is bytes; the question asks for GiB (2**30 bytes).",
        },
    ),
    hints=[
        "Open lab_utils/data/h200/query-gpu.csv; the header names each column's unit.",
        "memory.total is given in MiB (2**20 bytes). A GiB is 2**30 bytes, i.e. 1024 MiB.",
        "memory_gib = <memory.total in MiB> / 1024 (datasheets say '141 GB': GB of 1e9 bytes, rounded).",
    ],
    solution_text=(
        "memory_gib = 143771 / 1024   # 140.4 GiB (= 150.8 GB of 1e9 bytes; the datasheet rounds to 141 GB)\n"
        "# or with pandas:\n"
        "# df = pd.read_csv(path, skipinitialspace=True)\n"
        "# memory_gib = df['memory.total [MiB]'].str.split().str[0].astype(int)[0] / 1024"
    ),
)

# --- q5: MIG --------------------------------------------------------------------------------------


def _grade_mig(value: Any) -> None:
    n = integer(value, "the number of MIG instances")
    if n == 7:
        return
    if n == 8:
        raise Wrong("8 is the number of memory slices; the compute side splits into 7 slices, and each "
                    "GPU instance needs at least one")
    if n > 8:
        raise Wrong("more instances than the GPU has slices; look for the smallest MIG profile and how "
                    "many of it fit")
    raise Wrong("not the maximum: count how many of the smallest profile (1g.18gb) fit on one H200")


q5 = Exercise(
    name="00.5 MIG instances on an H200",
    var="mig_max",
    grade=_grade_mig,
    hints=[
        "MIG (Multi-Instance GPU) splits one GPU into isolated instances with their own SMs, memory and L2.",
        "The most instances come from the smallest profile; `nvidia-smi mig -lgip` lists each profile with "
        "how many fit (the H200 datasheet says the same under 'Multi-Instance GPUs').",
        "The smallest H200 profile is 1g.18gb: 141 GB shared out at about 18 GB each.",
    ],
    solution_text=(
        "mig_max = 7\n"
        "# H200: up to 7 MIG instances of profile 1g.18gb (7 compute slices; 8 memory slices)."
    ),
)

# --- q6: layers of the stack ---------------------------------------------------------------------

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


q6 = Exercise(
    name="00.6 layers of the stack",
    var="layers",
    grade=_grade_layers,
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
