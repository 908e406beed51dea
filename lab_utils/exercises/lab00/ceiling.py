"""Lab 00, exercise 00.2: the CUDA ceiling from nvidia-smi's banner; the version helpers the lab's checks share."""

from __future__ import annotations

import random
import re
from typing import Any

from lab_utils.course import probe
from lab_utils.course.programs import run_text
from lab_utils.exercises.framework import CodeExercise, References, Wrong, run_student, version

LAB = "lab_utils.exercises.lab00"  # the references' public names: a refusal names what the student imported

# --- versions ------------------------------------------------------------------------------------

def _version_of(value: Any, what: str) -> tuple[int, int]:
    """A student's CUDA version as (major, minor) (``framework.version``); ``Wrong`` naming the usual confusions."""
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    if isinstance(text, str):
        text = text.strip()
        if re.fullmatch(r"\d{3}(\.\d+)+", text):  # R5xx drivers: 535.x, 550.x, 580.159.04
            raise Wrong(f"{what} is {text!r}: that is the driver version (the 'Driver Version' field). The CUDA "
                        "version is the 'CUDA Version' field beside it: the newest CUDA this driver supports")
        if "cuda" in text.lower():
            raise Wrong(f"{what} is {text!r}: give only the number, e.g. '13.0'")
    return version(text, what)



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
    live = run_text(["nvidia-smi"], timeout=30)  # this machine's banner, where nvidia-smi works
    if live and reference_cuda_ceiling(live):
        sources.append(("this machine's nvidia-smi", live))
    for where, text in sources:
        got = run_student(fn, text, call=f"cuda_ceiling(<{where}>)", timeout_s=10)
        if got is None:
            raise Wrong(f"on {where} your function returned None: find the 'CUDA Version: ...' field in the "
                        "banner (a regular expression such as r'CUDA Version:\\s*([\\d.]+)' does it) and return it")
        want = reference_cuda_ceiling(text)
        if _version_of(got, f"on {where}, your result") != version(want):
            raise Wrong(f"on {where} it returned {got!r}, but the banner's 'CUDA Version' field reads {want!r}")
    names = [w for w, _ in sources]
    return f"Graded on {', '.join(names[:-1])} and {names[-1]}."


q2 = CodeExercise(
    name="00.2 the CUDA ceiling from nvidia-smi", var="cuda_ceiling", grade=_grade_cuda_ceiling,
    references=References("find the 'CUDA Version' field in the banner yourself",
                           f"{LAB}.reference_cuda_ceiling", "lab_utils.course.probe.parse_smi_header"),
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
