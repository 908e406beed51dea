"""Lab 00 exercises: environment and driver, on this machine where it can and on the H200 captures in
``lab_utils/data/h200/`` elsewhere (``cuda_ceiling``, the GPU inventory and ``cuda_verdict`` are code the check runs).
"""

from __future__ import annotations

import csv
import io
import random
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lab_utils.course import probe, progress
from lab_utils.exercises.framework import (
    CodeExercise,
    Exercise,
    Outcome,
    References,
    Wrong,
    choice,
    close_to,
    integer,
    is_blank,
    match_slip,
    number,
    run_student,
    version,
)

__all__ = [
    "q1", "q2", "q3", "q4", "q5", "q6",
    "LAYERS", "COMPONENTS", "VERDICTS", "INVENTORY_FIELDS", "VERDICT_CASES",
    "parse_version", "cuda_verdict", "reference_cuda_ceiling", "reference_smi_inventory",
    "reference_nvml_inventory", "nvml_unavailable",
]

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

# --- versions ------------------------------------------------------------------------------------

def parse_version(text: str) -> tuple[int, int]:
    """``"12.10"`` -> ``(12, 10)``: (major, minor) as integers, so 12.10 sorts after 12.4."""
    major, minor = text.split(".")[:2] if "." in text else (text, "0")
    return int(major), int(minor)


def _version_of(value: Any, what: str) -> tuple[int, int]:
    """A student's CUDA version as (major, minor) (``framework.version``); ``Wrong`` naming the usual confusions."""
    text = value.decode(errors="replace").strip() if isinstance(value, bytes) else value
    if isinstance(text, str):
        text = text.strip()
        if re.fullmatch(r"\d{3}(\.\d+)+", text):  # R5xx drivers: 535.x, 550.x, 580.159.04
            raise Wrong(f"{what} is {text!r}: that is the driver version (the 'Driver Version' field). The CUDA "
                        "version is the 'CUDA Version' field beside it: the newest CUDA this driver supports")
        if "cuda" in text.lower():
            raise Wrong(f"{what} is {text!r}: give only the number, e.g. '13.0'")
    return version(text, what)


# --- q2: the CUDA ceiling from nvidia-smi's banner --------------------------------------------------


def reference_cuda_ceiling(smi_text: str) -> str | None:
    """The 'CUDA Version' field of plain ``nvidia-smi`` output: the newest CUDA the driver supports."""
    return probe.parse_smi_header(smi_text)["cuda_ceiling"]


# (driver, CUDA ceiling) pairs as released drivers report them.
_OTHER_BANNERS = (("535.183.01", "12.2"), ("550.54.15", "12.4"), ("570.86.10", "12.8"), ("575.51.03", "12.9"),
                  ("520.61.05", "11.8"), ("590.44.01", "13.1"), ("560.35.03", "12.6"))


def _other_banner(smi_text: str, rng: random.Random) -> str:
    """The H200 banner as another driver prints it: another driver version and another CUDA ceiling, picked at
    random, so a function returning a constant cannot pass."""
    driver, cuda = rng.choice([b for b in _OTHER_BANNERS if b[1] != reference_cuda_ceiling(smi_text)])
    old = probe.parse_smi_header(smi_text)
    text = smi_text.replace(f"CUDA Version: {old['cuda_ceiling']}", f"CUDA Version: {cuda}")
    return text.replace(str(old["driver_version"]), driver)


def _grade_cuda_ceiling(fn: Any) -> str:
    h200 = probe.capture("nvidia-smi")
    sources = [("the H200 capture", h200), ("another driver's banner", _other_banner(h200, random.Random()))]
    live = probe._run(["nvidia-smi"], timeout=30)  # this machine's banner, where nvidia-smi works
    if live and reference_cuda_ceiling(live):
        sources.append(("this machine's nvidia-smi", live))
    for where, text in sources:
        got = run_student(fn, text, call=f"cuda_ceiling(<{where}>)", timeout_s=10)
        if got is None:
            raise Wrong(f"on {where} your function returned None: find the 'CUDA Version: ...' field in the "
                        "banner (a regular expression such as r'CUDA Version:\\s*([\\d.]+)' does it) and return it")
        want = reference_cuda_ceiling(text)
        if _version_of(got, f"on {where}, your result") != parse_version(want):
            raise Wrong(f"on {where} it returned {got!r}, but the banner's 'CUDA Version' field reads {want!r}")
    names = [w for w, _ in sources]
    return f"Graded on {', '.join(names[:-1])} and {names[-1]}."


q2 = CodeExercise(
    name="00.2 the CUDA ceiling from nvidia-smi", var="cuda_ceiling", grade=_grade_cuda_ceiling,
    references=References("find the 'CUDA Version' field in the banner yourself",
                           reference_cuda_ceiling, "lab_utils.course.probe.parse_smi_header"),
    signature="cuda_ceiling(smi_text) -> str",
    hints=[
        "The banner's first line holds three fields: 'NVIDIA-SMI', 'Driver Version' and 'CUDA Version'. Only "
        "the last is the CUDA ceiling; the first two are the driver's own version.",
        "Search for the label, not just 'Version:': re.search(r'CUDA Version:\\s*([\\d.]+)', smi_text).",
        "Return the match as a string (group(1)): '13.0'. Not a float: float('12.10') is 12.1.",
    ],
    solution_text=(
        "import re\n\n"
        "def cuda_ceiling(smi_text: str) -> str:\n"
        '    """The newest CUDA this driver supports: the "CUDA Version" field of nvidia-smi."""\n'
        "    return re.search(r'CUDA Version:\\s*([\\d.]+)', smi_text).group(1)\n"
        "# NVML gives the same number: pynvml.nvmlSystemGetCudaDriverVersion() -> 13000 -> '13.0'."
    ),
)

# --- q3: the GPU inventory: NVML where it runs, the H200 captures elsewhere ---------------------------

INVENTORY_FIELDS = ("index", "name", "memory_total_mib", "driver_version", "cuda_version")


def nvml_unavailable() -> str | None:
    """Why NVML cannot start on this machine, or None when it can."""
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed (pip install nvidia-ml-py), so NVML cannot be used"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return probe._nvml_error_text(err)
    pynvml.nvmlShutdown()
    return None


def reference_nvml_inventory() -> list[dict[str, Any]]:
    """One dict per GPU (``INVENTORY_FIELDS``), read through NVML; NVML is shut down again afterwards."""
    import pynvml

    pynvml.nvmlInit()
    try:
        driver = probe.nvml_text(pynvml.nvmlSystemGetDriverVersion())
        cuda = probe.decode_cuda_version(pynvml.nvmlSystemGetCudaDriverVersion())
        rows = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            rows.append({"index": i, "name": probe.nvml_text(pynvml.nvmlDeviceGetName(h)),
                         "memory_total_mib": pynvml.nvmlDeviceGetMemoryInfo(h).total // 2**20,
                         "driver_version": driver, "cuda_version": cuda})
        return rows
    finally:
        pynvml.nvmlShutdown()


def reference_smi_inventory(query_csv: str, smi_text: str) -> list[dict[str, Any]]:
    """The same inventory from ``nvidia-smi --query-gpu=...,name,driver_version,memory.total,... --format=csv``
    (header with units, or noheader with index first) and the plain ``nvidia-smi`` banner (the CUDA ceiling)."""
    reader = csv.reader(io.StringIO(query_csv), skipinitialspace=True)
    rows = [r for r in reader if r and any(c.strip() for c in r)]
    header = [h.strip().split(" ")[0] for h in rows[0]]
    cuda = reference_cuda_ceiling(smi_text)
    out = []
    for i, row in enumerate(rows[1:]):
        f = dict(zip(header, (c.strip() for c in row), strict=False))
        out.append({"index": int(f["index"]) if "index" in f else i, "name": f["name"],
                    "memory_total_mib": int(f["memory.total"].split()[0]),
                    "driver_version": f["driver_version"], "cuda_version": cuda})
    return out


# (name, memory.total MiB, clocks.max.sm MHz, power.limit W) of data-centre GPUs, as nvidia-smi reports them.
_OTHER_GPUS = (("NVIDIA H100 80GB HBM3", 81559, 1980, 700.0), ("NVIDIA A100-SXM4-80GB", 81920, 1410, 400.0),
               ("NVIDIA L40S", 46068, 2520, 350.0), ("NVIDIA H200", 143771, 1980, 700.0))


def _other_machine(query_csv: str, smi_text: str, rng: random.Random) -> tuple[str, str, str]:
    """(label, query, banner) of another machine, picked at random: 2 to 4 GPUs of one model, another driver
    (``_other_banner``), the capture's columns. A function that returns the H200's rows cannot pass it."""
    banner = _other_banner(smi_text, rng)
    driver = probe.parse_smi_header(banner)["driver_version"]
    name, mib, mhz, watts = rng.choice(_OTHER_GPUS)
    values = {"name": name, "driver_version": driver, "memory.total": f"{mib} MiB", "clocks.max.sm": f"{mhz} MHz",
              "power.limit": f"{watts:.2f} W"}
    header = query_csv.strip().splitlines()[0]
    columns = [h.strip().split(" ")[0] for h in header.split(",")]
    count = rng.randint(2, 4)
    rows = [", ".join(values.get(c, "[N/A]") for c in columns) for _ in range(count)]
    return f"a {count}-GPU query of another machine", "\n".join([header, *rows]) + "\n", banner


_MEMORY_SLIPS = {
    2.0**20: "memory_total_mib is in bytes: NVML's memory .total is bytes; divide by 2**20 for MiB.",
    1 / 1024: "memory_total_mib is in GiB; the field is MiB (as nvidia-smi prints it).",
    2**20 / 1e6: "memory_total_mib is in MB (1e6 bytes); MiB is 2**20 bytes: divide bytes by 2**20.",
    2**20 / 1e9: "memory_total_mib is in GB (1e9 bytes); the field is MiB (2**20 bytes).",
    1024.0: "memory_total_mib is in KiB; the field is MiB: divide by 1024 once more.",
}


def _rows_of(result: Any, call: str) -> list[Mapping[str, Any]]:
    if hasattr(result, "to_dict") and hasattr(result, "columns"):  # a pandas DataFrame is fine too
        result = result.to_dict("records")
    if isinstance(result, Mapping) or not isinstance(result, Sequence) or isinstance(result, (str, bytes)):
        raise Wrong(f"{call} returned a {type(result).__name__}: return a list with one dict per GPU, "
                    f"with the keys {list(INVENTORY_FIELDS)}")
    for row in result:
        if not isinstance(row, Mapping):
            raise Wrong(f"{call} returned a list of {type(row).__name__}: make each GPU a dict with the keys "
                        f"{list(INVENTORY_FIELDS)}")
    return list(result)


def _field_text(row: Mapping[str, Any], ref: Mapping[str, Any], key: str, who: str) -> Any:
    """``row[key]`` (bytes decoded), or ``Wrong`` where it is ``ref[key]`` with spaces around it."""
    value = row[key].decode() if isinstance(row[key], bytes) else row[key]
    if isinstance(value, str) and value != ref[key] and value.strip() == ref[key]:
        raise Wrong(f"{who}'s {key} is {value!r}, with spaces around it: nvidia-smi's CSV puts a space after each "
                    "comma; strip the fields (csv.reader(..., skipinitialspace=True))")
    return value


def _compare_inventory(got: list[Mapping[str, Any]], want: list[dict[str, Any]], call: str, source: str) -> None:
    if len(got) != len(want):
        first = " Does it read only the first row?" if len(got) == 1 and len(want) > 1 else ""
        raise Wrong(f"{call} found {len(got)} GPU(s); {source} lists {len(want)}.{first}")
    for row, ref in zip(got, want, strict=True):
        missing = [k for k in INVENTORY_FIELDS if k not in row]
        if missing:
            raise Wrong(f"{call}: GPU {ref['index']} has no {missing}; each dict needs the keys "
                        f"{list(INVENTORY_FIELDS)}")
        gpu = f"GPU {ref['index']}"
        if integer(row["index"], f"{gpu}'s index") != ref["index"]:
            raise Wrong(f"{call}: the GPU in position {want.index(ref)} has index {row['index']!r}, {source} says "
                        f"{ref['index']} (NVML's indexes start at 0, in nvidia-smi's order)")
        name = _field_text(row, ref, "name", f"{call}: {gpu}")
        if not isinstance(name, str):
            raise Wrong(f"{call}: {gpu}'s name is a {type(name).__name__}; give the name as a string")
        if name != ref["name"]:
            raise Wrong(f"{call}: {gpu}'s name is {name!r}, {source} says {ref['name']!r}")
        mem = row["memory_total_mib"]
        if isinstance(mem, str):
            raise Wrong(f"{call}: {gpu}'s memory_total_mib is the text {mem!r}: return a number of MiB "
                        "(strip the unit: int(text.split()[0]))")
        mem = number(mem, f"{gpu}'s memory_total_mib")
        ratio = mem / ref["memory_total_mib"]
        if abs(ratio - 1) > 0.005:
            slip = match_slip(ratio, _MEMORY_SLIPS, 0.01)
            raise Wrong(f"{call}: {gpu} has memory_total_mib = {mem:g}, {source} says {ref['memory_total_mib']} "
                        f"MiB. {slip or 'Read memory.total (MiB), not used or free memory.'}")
        drv = _field_text(row, ref, "driver_version", f"{call}: {gpu}")
        if not isinstance(drv, str) or drv != ref["driver_version"]:
            swapped = " (that is the CUDA version: the two fields are swapped)" if str(drv) == ref["cuda_version"] \
                else ""
            raise Wrong(f"{call}: {gpu}'s driver_version is {drv!r}, {source} says "
                        f"{ref['driver_version']!r}{swapped}")
        if _version_of(row["cuda_version"], f"{gpu}'s cuda_version") != parse_version(ref["cuda_version"]):
            raise Wrong(f"{call}: {gpu}'s cuda_version is {row['cuda_version']!r}, {source} says "
                        f"{ref['cuda_version']!r} (the 'CUDA Version' field, the driver's ceiling)")


def _grade_smi_inventory(fn: Any) -> str:
    query, banner = probe.capture("query-gpu"), probe.capture("nvidia-smi")
    other = _other_machine(query, banner, random.Random())
    for label, text, smi in (("the H200 query", query, banner), other):
        call = f"smi_inventory(<{label}>, <banner>)"
        got = _rows_of(run_student(fn, text, smi, call=call, timeout_s=10), call)
        _compare_inventory(got, reference_smi_inventory(text, smi), call, "the reference parser")
    return ("Graded on the H200 captures and on another machine drawn at random (several GPUs, another driver) "
            "against the reference parser, because there is no NVML here; `nvml_inventory` was not run.")


def _nvml_initialised() -> bool:
    import pynvml

    try:
        pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError:
        return False
    return True


def _grade_nvml_inventory(fn: Any) -> str:
    import pynvml

    was_open = _nvml_initialised()  # someone else in this process holds NVML open: shutdown can't be checked
    call = "nvml_inventory()"
    result = run_student(fn, call=call, timeout_s=60)
    left_open = not was_open and _nvml_initialised()
    if left_open:
        pynvml.nvmlShutdown()  # clean up after the student's function before judging it
    # the comparison: this machine's inventory as nvidia-smi reports it, else as the reference reads NVML
    query = probe._run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv"], 30)
    banner = probe._run(["nvidia-smi"], 30)
    if query and query.strip() and banner and banner.strip():
        want, source = reference_smi_inventory(query, banner), "`nvidia-smi --query-gpu`"
    else:
        want, source = reference_nvml_inventory(), "the reference NVML inventory (nvidia-smi did not run)"
    _compare_inventory(_rows_of(result, call), want, call, source)
    if left_open:
        raise Wrong("the inventory is right, but NVML is still initialised after your function returned: call "
                    "pynvml.nvmlShutdown() in a `finally:` block, so it runs even when a query raises")
    return f"Graded on this machine's {len(want)} GPU(s) through NVML, against {source}."


# 00.3's two answers, each graded (and guarded) as a code exercise of its own: see InventoryExercise
_nvml_part = CodeExercise(
    "00.3 GPU inventory", "nvml_inventory", _grade_nvml_inventory, signature="nvml_inventory() -> list[dict]",
    references=References("ask NVML (pynvml) for each GPU yourself", reference_nvml_inventory))
_smi_part = CodeExercise(
    "00.3 GPU inventory", "smi_inventory", _grade_smi_inventory,
    signature="smi_inventory(query_csv, smi_text) -> list[dict]",
    references=References("read the CSV yourself (csv.reader)", reference_smi_inventory, probe.parse_smi_csv))


class InventoryExercise(CodeExercise):
    """Grades ``nvml_inventory()`` where NVML starts (compared with nvidia-smi), else ``smi_inventory(query_csv,
    smi_text)`` on the H200 captures (compared with the reference parser); the outcome says which it graded."""

    def check(self, nvml_inventory: Any = None, smi_inventory: Any = None, *, quiet: bool = False) -> Outcome:
        """Grade the inventory this machine can run: ``nvml_inventory`` with NVML, else ``smi_inventory``."""
        reason = nvml_unavailable()
        nvml, smi = _nvml_part, _smi_part
        # The part this machine does not grade is refused too when it only calls a reference implementation.
        refused = nvml.refusal(nvml_inventory) or smi.refusal(smi_inventory)
        if refused is not None:
            out = refused
        elif reason is None:
            out = nvml._outcome(nvml_inventory)
        else:
            out = smi._outcome(smi_inventory)
            if not out.graded:
                out.message += f" (No NVML here: {reason}. So this grades `smi_inventory`, on the H200 captures.)"
        progress.record(self.name, out.status.name, out.message)  # the student's record, as Exercise.check does
        self.attempted = self.attempted or not (is_blank(nvml_inventory) and is_blank(smi_inventory))
        if not quiet:
            print(out)
        return out


q3 = InventoryExercise(
    name="00.3 GPU inventory", var="nvml_inventory / smi_inventory",
    grade=lambda value: None,  # the two graders above do the work; see InventoryExercise.check
    signature="nvml_inventory() -> list[dict], or smi_inventory(query_csv, smi_text) -> list[dict]",
    hints=[
        "With NVML: pynvml.nvmlInit(); then nvmlSystemGetDriverVersion(), nvmlSystemGetCudaDriverVersion() (an "
        "int: 13000 is 13.0), nvmlDeviceGetCount(), and per index nvmlDeviceGetHandleByIndex(i) -> "
        "nvmlDeviceGetName(h), nvmlDeviceGetMemoryInfo(h).total (bytes). nvmlShutdown() in a `finally:`.",
        "From the captures: csv.reader(io.StringIO(query_csv), skipinitialspace=True); the header names the "
        "columns with their units ('memory.total [MiB]'), each value carries the unit too ('143771 MiB'). The "
        "CUDA version is not in the CSV: take it from the banner (your cuda_ceiling).",
        "One dict per GPU: {'index': i, 'name': ..., 'memory_total_mib': int, 'driver_version': '580.159.04', "
        "'cuda_version': '13.0'}. MiB = bytes // 2**20.",
    ],
    solution_text=(
        "def nvml_inventory() -> list[dict]:\n"
        "    import pynvml\n"
        "    pynvml.nvmlInit()\n"
        "    try:\n"
        "        driver = pynvml.nvmlSystemGetDriverVersion()\n"
        "        v = pynvml.nvmlSystemGetCudaDriverVersion()            # 13000\n"
        "        cuda = f'{v // 1000}.{v % 1000 // 10}'                  # '13.0'\n"
        "        gpus = []\n"
        "        for i in range(pynvml.nvmlDeviceGetCount()):\n"
        "            h = pynvml.nvmlDeviceGetHandleByIndex(i)\n"
        "            gpus.append({'index': i, 'name': pynvml.nvmlDeviceGetName(h),\n"
        "                         'memory_total_mib': pynvml.nvmlDeviceGetMemoryInfo(h).total // 2**20,\n"
        "                         'driver_version': driver, 'cuda_version': cuda})\n"
        "        return gpus\n"
        "    finally:\n"
        "        pynvml.nvmlShutdown()\n\n"
        "def smi_inventory(query_csv: str, smi_text: str) -> list[dict]:\n"
        "    rows = list(csv.reader(io.StringIO(query_csv), skipinitialspace=True))\n"
        "    header = [h.split(' ')[0] for h in rows[0]]                # 'memory.total [MiB]' -> 'memory.total'\n"
        "    cuda = cuda_ceiling(smi_text)\n"
        "    gpus = []\n"
        "    for i, row in enumerate(rows[1:]):\n"
        "        f = dict(zip(header, row))\n"
        "        gpus.append({'index': i, 'name': f['name'], 'memory_total_mib': int(f['memory.total'].split()[0]),\n"
        "                     'driver_version': f['driver_version'], 'cuda_version': cuda})\n"
        "    return gpus"
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

# --- q5: the compatibility verdict --------------------------------------------------------------------

VERDICTS = ("compatible", "minor-version compatibility", "forward compatibility needed", "incompatible")
_COMPATIBLE, _MINOR, _FORWARD, _INCOMPATIBLE = VERDICTS


def cuda_verdict(driver_ceiling: str, runtime: str, datacenter_gpu: bool) -> str:
    """Whether a CUDA ``runtime`` (e.g. ``torch.version.cuda``) runs under a driver whose ceiling (nvidia-smi's
    'CUDA Version') is ``driver_ceiling``; one of ``VERDICTS``.

    Drivers are backward compatible: a runtime up to the ceiling runs. A newer runtime of the *same major*
    version runs through CUDA minor-version compatibility (features that need the newer driver, such as PTX
    JIT of newer PTX, can fail). A newer *major* version needs the forward-compatibility libraries
    (``cuda-compat``, carried by NGC images), which work on data-centre GPUs only; elsewhere it cannot run.
    """
    ceiling, rt = parse_version(driver_ceiling), parse_version(runtime)
    if rt <= ceiling:
        return _COMPATIBLE
    if rt[0] == ceiling[0]:
        return _MINOR
    return _FORWARD if datacenter_gpu else _INCOMPATIBLE


# (driver_ceiling, runtime, datacenter_gpu, expected, why). The simple cases come first, so a function wrong
# everywhere hears about the simplest one. "12.10" is hypothetical but legal and catches comparing versions
# as strings ("12.10" < "12.4") or floats (12.10 == 12.1).
VERDICT_CASES: list[tuple[str, str, bool, str, str]] = [
    ("13.0", "12.8", True, _COMPATIBLE, "an older runtime runs on a newer driver (drivers are backward compatible)"),
    ("13.0", "13.0", False, _COMPATIBLE, "a runtime equal to the ceiling is supported"),
    ("13.0", "11.8", False, _COMPATIBLE, "an older major version runs on a newer driver too"),
    ("12.4", "12.8", False, _MINOR, "12.8 is newer than the ceiling 12.4 but of the same major version: CUDA "
                                    "minor-version compatibility runs it, on any GPU"),
    ("13.0", "13.1", True, _MINOR, "13.1 is newer than 13.0 within major version 13: minor-version compatibility"),
    ("12.4", "12.10", True, _MINOR, "12.10 is a newer release than 12.4 (minor 10 > minor 4), same major"),
    ("12.10", "12.9", False, _COMPATIBLE, "12.9 is an older release than 12.10 (minor 9 < minor 10)"),
    ("12.1", "12.10", False, _MINOR, "12.10 is a newer release than 12.1 (minor 10 > minor 1), same major"),
    ("12.4", "13.0", True, _FORWARD, "a newer major version needs the forward-compatibility libraries, which a "
                                     "data-centre GPU can use"),
    ("12.4", "13.0", False, _INCOMPATIBLE, "a newer major version on a GPU that is not a data-centre GPU: forward "
                                           "compatibility is not available there"),
    ("12.8", "13.2", False, _INCOMPATIBLE, "a newer major version, no data-centre GPU"),
    ("11.8", "12.1", True, _FORWARD, "a newer major version on a data-centre GPU: forward compatibility"),
]

_KEYS: dict[str, tuple[Callable[[str], Any], str]] = {
    "tuple": (parse_version, ""),
    "string": (lambda v: v, "Compared as strings, '12.10' < '12.4' (character by character, '1' < '4'). "),
    "float": (float, "As floats, 12.10 == 12.1 (so it sorts before 12.4, and equals 12.1). "),
}


# rule -> (its verdict past the ceiling from (same major version, data-centre GPU), what is wrong with it)
_RULES: dict[str, tuple[Callable[[bool, bool], str], str]] = {
    "right": (lambda same_major, dc: _MINOR if same_major else (_FORWARD if dc else _INCOMPATIBLE), ""),
    "no minor-version": (lambda same_major, dc: _FORWARD if dc else _INCOMPATIBLE,
                         "A newer runtime of the same major version is not a case for forward compatibility: "
                         "CUDA minor-version compatibility runs it on the older driver (12.8 under a 12.4 "
                         "driver), only features that need the newer driver can fail."),
    "always forward": (lambda same_major, dc: _MINOR if same_major else _FORWARD,
                       "Forward compatibility (the cuda-compat libraries) works on data-centre GPUs only: on "
                       "another GPU a runtime of a newer major version is incompatible."),
    "never forward": (lambda same_major, dc: _MINOR if same_major else _INCOMPATIBLE,
                      "On a data-centre GPU a newer major version can run with the forward-compatibility "
                      "libraries (NGC images carry them): 'forward compatibility needed', not incompatible."),
    "minor everywhere": (lambda same_major, dc: _MINOR,
                         "Minor-version compatibility holds within one major version only: 13.0 under a 12.4 "
                         "driver needs forward compatibility (data-centre GPUs) or is incompatible."),
}


def _rule(past: Callable[[bool, bool], str], key: Callable[[str], Any]) -> Callable[[str, str, bool], str]:
    def verdict(ceiling: str, runtime: str, dc: bool) -> str:
        if key(runtime) <= key(ceiling):
            return _COMPATIBLE
        return past(runtime.split(".")[0] == ceiling.split(".")[0], dc)

    return verdict


_RANDOM_VERDICTS = 8


def _grade_random_verdicts(fn: Any, rng: random.Random) -> None:
    """Versions the student cannot predict, against ``cuda_verdict``: a table of answers cannot pass."""
    def pick() -> str:
        return f"{rng.randint(11, 14)}.{rng.choice([0, 1, 2, 4, 6, 8, 9, 10, 12])}"

    for _ in range(_RANDOM_VERDICTS):
        ceiling, runtime, dc = pick(), pick(), rng.random() < 0.5
        call = f"cuda_verdict({ceiling!r}, {runtime!r}, datacenter_gpu={dc})"
        result = run_student(fn, ceiling, runtime, dc, call=call, timeout_s=10)
        expected = cuda_verdict(ceiling, runtime, dc)
        if choice(result, VERDICTS) != expected:
            raise Wrong(f"{call} returned {result!r}, expected {expected!r}: every case of the table was right, but "
                        "this one (drawn at random) is not. Apply the rules to the versions given, not to a list "
                        "of known cases.")


def _grade_verdict(fn: Any) -> str:
    got = []
    for ceiling, runtime, dc, _, _ in VERDICT_CASES:
        call = f"cuda_verdict({ceiling!r}, {runtime!r}, datacenter_gpu={dc})"
        result = run_student(fn, ceiling, runtime, dc, call=call, timeout_s=10)
        verdict = choice(result, VERDICTS)
        if verdict is None:
            raise Wrong(f"{call} returned {result!r}: return one of {list(VERDICTS)} (the names in VERDICTS)")
        got.append(verdict)
    wrong = [(case, g) for case, g in zip(VERDICT_CASES, got, strict=True) if g != case[3]]
    if not wrong:
        _grade_random_verdicts(fn, random.Random())
        return f"All {len(VERDICT_CASES)} cases agree with the rules, and {_RANDOM_VERDICTS} more drawn at random."
    (ceiling, runtime, dc, expected, why), verdict = wrong[0]
    first = (f"cuda_verdict({ceiling!r}, {runtime!r}, datacenter_gpu={dc}) returned {verdict!r}, expected "
             f"{expected!r}: {why}.")
    cases = [(c, r, d) for c, r, d, _, _ in VERDICT_CASES]
    for key_name, (key, key_why) in _KEYS.items():
        for rule, (past, rule_why) in _RULES.items():
            if key_name == "tuple" and rule == "right":
                continue
            if [_rule(past, key)(*case) for case in cases] == got:
                fix = "Compare (major, minor) as integers: tuple(int(p) for p in v.split('.')[:2]). " \
                    if key_name != "tuple" else ""
                raise Wrong(f"{first} {key_why}{fix}{rule_why}".strip())
    raise Wrong(f"{first} ({len(wrong)} of {len(VERDICT_CASES)} cases differ.)")


q5 = CodeExercise(
    name="00.5 the compatibility verdict", var="cuda_verdict", grade=_grade_verdict,
    references=References("apply the compatibility rules yourself", cuda_verdict),
    signature="cuda_verdict(driver_ceiling, runtime, datacenter_gpu) -> str",
    hints=[
        "Three questions in order: is the runtime at most the ceiling? If not, is it the same major version? If "
        "not, is this a data-centre GPU (where the forward-compatibility libraries work)?",
        "Compare versions as (major, minor) integer tuples: as strings '12.10' < '12.4', as floats 12.10 == 12.1. "
        "tuple(int(p) for p in v.split('.')[:2]).",
        "runtime <= ceiling: 'compatible'; same major: 'minor-version compatibility'; newer major: 'forward "
        "compatibility needed' on a data-centre GPU, else 'incompatible'.",
    ],
    solution_text=(
        "def cuda_verdict(driver_ceiling: str, runtime: str, datacenter_gpu: bool) -> str:\n"
        "    def key(v: str) -> tuple[int, int]:\n"
        "        major, minor = (v.split('.') + ['0'])[:2]\n"
        "        return int(major), int(minor)\n"
        "    ceiling, rt = key(driver_ceiling), key(runtime)\n"
        "    if rt <= ceiling:\n"
        "        return 'compatible'                      # drivers are backward compatible\n"
        "    if rt[0] == ceiling[0]:\n"
        "        return 'minor-version compatibility'     # runs; features needing a newer driver may fail\n"
        "    return 'forward compatibility needed' if datacenter_gpu else 'incompatible'"
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
