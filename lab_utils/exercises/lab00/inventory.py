"""Lab 00, exercise 00.3: the GPU inventory, through NVML where it runs, else from the H200 captures."""

from __future__ import annotations

import csv
import io
import random
from collections.abc import Mapping, Sequence
from typing import Any

from lab_utils.course import probe, progress
from lab_utils.course.gpus import nvml_start
from lab_utils.course.programs import run_text
from lab_utils.exercises.framework import (
    CodeExercise,
    Outcome,
    References,
    Wrong,
    integer,
    is_blank,
    match_slip,
    number,
    run_student,
    version,
)
from lab_utils.exercises.lab00.ceiling import LAB, _other_banner, _version_of, reference_cuda_ceiling

INVENTORY_FIELDS = ("index", "name", "memory_total_mib", "driver_version", "cuda_version")


def nvml_unavailable() -> str | None:
    """Why NVML cannot start on this machine, or None when it can."""
    if (why := nvml_start()) is None:
        import pynvml

        pynvml.nvmlShutdown()
    return why


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
        if _version_of(row["cuda_version"], f"{gpu}'s cuda_version") != version(ref["cuda_version"]):
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
    query = run_text(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv"], 30)
    banner = run_text(["nvidia-smi"], 30)
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
    references=References("ask NVML (pynvml) for each GPU yourself", f"{LAB}.reference_nvml_inventory"))
_smi_part = CodeExercise(
    "00.3 GPU inventory", "smi_inventory", _grade_smi_inventory,
    signature="smi_inventory(query_csv, smi_text) -> list[dict]",
    references=References("read the CSV yourself (csv.reader)", f"{LAB}.reference_smi_inventory",
                           "lab_utils.course.probe.parse_smi_csv"))


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
