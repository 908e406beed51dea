"""Facts the course teaches, pinned where they are taught: the notebooks' text, the exercises' hints and messages
and the quiz bank (English and Chinese). A claim retired as false must not come back in any of them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lab_utils.exercises import lab09, quiz

ROOT = Path(__file__).resolve().parents[1]
BANK = quiz.load_bank()


def _course_text(*paths: str) -> dict[str, str]:
    """Tracked text files under ``paths`` (notebooks as their cells' source), by path."""
    files = subprocess.run(["git", "ls-files", *paths], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    out = {}
    for name in files:
        path = ROOT / name
        if not path.is_file() or path.suffix not in {".py", ".ipynb", ".yaml", ".md"}:
            continue
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".ipynb":
            text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"])
        out[name] = " ".join(text.split())  # a claim may be wrapped over lines
    return out


TAUGHT = ("solutions", "lab_utils", "docs", "README.md")


def _claims(retired: list[str]) -> list[str]:
    """Where any retired claim still appears, as 'path: claim' (this file, which names them, excepted)."""
    return [f"{name}: {claim!r}" for name, text in _course_text(*TAUGHT).items()
            for claim in retired if claim in text]


# --- 1. memory capacity counts powers of two, bandwidth powers of ten ---------------------------------------------

def test_capacity_is_not_taught_as_decimal_gigabytes():
    retired = ["is decimal too", "is a decimal figure too", "也是十进制数值", "datasheets in GB (10^9 bytes)",
               "as datasheets write GB", "the datasheet's 141 GB); 2**30", "141e9 bytes = 131.3 GiB)"]
    assert _claims(retired) == []


def test_quiz_h200_memory_explains_both_units_in_both_languages():
    q = BANK.get("s1-h200-memory-gib")
    assert q.answer["value"] == 140.4
    assert "powers of two" in q.explanation["en"] and "powers of ten" in q.explanation["en"]
    assert "2 的幂" in q.explanation["zh"] and "10 的幂" in q.explanation["zh"]


def test_lab09_h200_memory_is_what_nvidia_smi_reports_in_1e9_bytes():
    assert lab09.H200_MEM_GB == pytest.approx(143771 * 2**20 / 1e9, abs=0.05)  # 150.8, not the datasheet's "141"


# --- 3. trtexec reports GPU compute time by default ------------------------------------------------------------

def test_trtexec_flags_are_not_taught_as_needed_for_gpu_compute_time():
    retired = ["--noDataTransfers` to report GPU compute time", "TensorRT 10 still needs them"]
    assert _claims(retired) == []
    text = _course_text("solutions/03_tensorrt.ipynb")["solutions/03_tensorrt.ipynb"]
    assert "reports the GPU Compute Time by default" in text and "change what is measured" in text


# --- 6. Triton Inference Server is now NVIDIA Dynamo-Triton -------------------------------------------------------

@pytest.mark.parametrize("lab", ["04_triton", "05_monitoring", "07_service"])
def test_triton_labs_name_dynamo_triton_where_triton_is_introduced(lab):
    cells = json.loads((ROOT / "solutions" / f"{lab}.ipynb").read_text(encoding="utf-8"))["cells"]
    intro = " ".join("".join(cells[0]["source"]).split())
    assert "Triton Inference Server, now **NVIDIA Dynamo-Triton**, part of NVIDIA Dynamo" in intro \
        or "Triton Inference Server is now **NVIDIA Dynamo-Triton**, part of NVIDIA Dynamo" in intro


# --- 7. the stack is a picture of what builds on what, not a chain of calls -----------------------------------------

def test_stack_is_not_taught_as_each_layer_talking_only_to_the_one_below():
    assert _claims(["Each layer only talks to the one below", "Each layer builds on the one below",
                    "每一层都建立在下一层之上"]) == []
    q = BANK.get("s1-layers-bottom-to-top")
    assert "driver API directly" in q.explanation["en"] and "host's" in q.explanation["en"]
    assert "驱动 API" in q.explanation["zh"] and "宿主机" in q.explanation["zh"]
    intro = _course_text("solutions/00_environment.ipynb")["solutions/00_environment.ipynb"]
    assert "the driver (the kernel module and `libcuda.so`) is the host's" in intro


# --- 2. tritonclient's HTTP tensors are binary by default ----------------------------------------------------------

def test_binary_data_is_not_taught_as_needed():
    assert _claims(["travels as JSON numbers unless asked otherwise", "pass `binary_data=True`, or the tensors"]) == []
    from lab_utils.exercises import lab04

    assert "binary_data=True)" not in lab04.q4.solution_text  # the student's request keeps the default
    assert "by default" in lab04.q4.hints[1] and "binary_data=False" in lab04.q4.hints[1]


# --- 5. DDP has no overlap argument --------------------------------------------------------------------------------

def test_ddp_overlap_is_not_taught_as_an_argument():
    assert _claims(["`overlap=False` is plain", "`overlap=False` variant", "and no overlap:"]) == []
