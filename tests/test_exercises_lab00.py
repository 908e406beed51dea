"""Lab 00: every exercise check against right answers (and right answers written differently), a blank and
plausible wrong answers; the specific messages; the inventory from the captures and through a stand-in NVML; hints
and solutions."""

from __future__ import annotations

import csv
import io
import random
import re
import stat
import subprocess
import sys
import types

import pytest
from _exercise_harness import check, exercises_of, hint_and_solution_tests, standard_tests

from lab_utils.course import probe
from lab_utils.exercises import lab00
from lab_utils.exercises.framework import (
    CodeExercise,
    Status,
    Wrong,
    version,
)
from lab_utils.exercises.lab00.ceiling import _version_of as version_of

# --- lab 00 answers --------------------------------------------------------------------------------------

LAYERS_RIGHT = {
    "libcuda.so": "driver", "nvidia-smi": "driver", "libcudart.so": "cuda runtime",
    "cuBLAS": "cuda-x library", "NCCL": "CUDA-X library", "PyTorch": "framework",
    "Triton Inference Server": "serving",
}


def ceiling_right(smi_text):
    return re.search(r"CUDA Version:\s*([\d.]+)", smi_text).group(1)


def ceiling_split(smi_text):  # written differently: no regular expression
    line = next(ln for ln in smi_text.splitlines() if "CUDA Version" in ln)
    return line.split("CUDA Version:")[1].split()[0]


def ceiling_driver(smi_text):  # the first "Version:" on the line is the driver's
    return re.search(r"Version:\s*(\S+)", smi_text).group(1)


def ceiling_three_parts(smi_text):  # written differently: "13.0.0" means 13.0
    return ceiling_right(smi_text) + ".0"


def ceiling_nvml_int(smi_text):  # written differently: NVML's integer form, 13000 for 13.0
    major, minor = ceiling_right(smi_text).split(".")
    return 1000 * int(major) + 10 * int(minor)


def ceiling_constant(smi_text):  # the H200's answer, whatever the banner says
    return "13.0"


def ceiling_float(smi_text):
    return float(ceiling_right(smi_text))


def ceiling_no_return(smi_text):
    ceiling_right(smi_text)


def ceiling_raises(smi_text):
    return smi_text.split("CUDA Version: ")[2]  # IndexError


def verdict_right(driver_ceiling, runtime, datacenter_gpu):
    def key(v):
        major, minor = (v.split(".") + ["0"])[:2]
        return int(major), int(minor)

    if key(runtime) <= key(driver_ceiling):
        return "compatible"
    if key(runtime)[0] == key(driver_ceiling)[0]:
        return "minor-version compatibility"
    return "forward compatibility needed" if datacenter_gpu else "incompatible"


def verdict_packaging(driver_ceiling, runtime, datacenter_gpu):  # written differently: packaging, other case
    from packaging.version import Version

    ceiling, rt = Version(driver_ceiling), Version(runtime)
    if rt > ceiling and rt.major == ceiling.major:
        return "Minor version compatibility"
    if rt > ceiling:
        return "INCOMPATIBLE" if not datacenter_gpu else "forward-compatibility needed"
    return "Compatible"


def verdict_strings(driver_ceiling, runtime, datacenter_gpu):
    if runtime <= driver_ceiling:  # the bug: compares character by character
        return "compatible"
    if runtime.split(".")[0] == driver_ceiling.split(".")[0]:
        return "minor-version compatibility"
    return "forward compatibility needed" if datacenter_gpu else "incompatible"


def verdict_floats(driver_ceiling, runtime, datacenter_gpu):
    if float(runtime) <= float(driver_ceiling):  # the bug: 12.10 == 12.1
        return "compatible"
    if runtime.split(".")[0] == driver_ceiling.split(".")[0]:
        return "minor-version compatibility"
    return "forward compatibility needed" if datacenter_gpu else "incompatible"


def verdict_no_minor_version(driver_ceiling, runtime, datacenter_gpu):  # the lab's old rule
    if version(runtime) <= version(driver_ceiling):
        return "compatible"
    return "forward compatibility needed" if datacenter_gpu else "incompatible"


def verdict_ignores_gpu(driver_ceiling, runtime, datacenter_gpu):
    if version(runtime) <= version(driver_ceiling):
        return "compatible"
    if runtime.split(".")[0] == driver_ceiling.split(".")[0]:
        return "minor-version compatibility"
    return "forward compatibility needed"


def verdict_bool(driver_ceiling, runtime, datacenter_gpu):
    return version(runtime) <= version(driver_ceiling)


# (exercise, right answers, wrong answers). lab00.q3 (two functions) has its own tests.
CASES = [
    (lab00.q1, [LAYERS_RIGHT, {k.upper(): v.title() for k, v in LAYERS_RIGHT.items()}],
     [{**LAYERS_RIGHT, "NCCL": "framework"}, {**LAYERS_RIGHT, "libcuda.so": "cuda runtime"}, {"PyTorch": "framework"},
      "driver"]),
    (lab00.q2, [ceiling_right, ceiling_split, lab00.reference_cuda_ceiling, ceiling_three_parts, ceiling_nvml_int],
     [ceiling_driver, ceiling_float, ceiling_no_return, ceiling_raises, ceiling_constant, "13.0"]),
    (lab00.q4, [143771 / 1024, 140.4, 141, "140.4"], [143771, 150.75, 143.771, 120]),
    (lab00.q5, [verdict_right, verdict_packaging, lab00.cuda_verdict],
     [verdict_strings, verdict_floats, verdict_no_minor_version, verdict_ignores_gpu, verdict_bool, "compatible"]),
    (lab00.q6, [18, 18.0, "18"], [2, "NV18", 18.5, 900]),
]


(
    test_right_answers_are_correct,
    test_wrong_answers_are_incorrect_and_show_the_value,
    test_blank_answers_are_not_attempted,
) = standard_tests(CASES)


def test_cases_cover_every_exercise():
    covered = {id(ex) for ex, *_ in CASES} | {id(lab00.q3)}
    assert covered == {id(ex) for ex in exercises_of(lab00)}


def test_at_least_half_of_the_exercises_run_code():
    exercises = exercises_of(lab00)
    code = [e for e in exercises if isinstance(e, CodeExercise)]
    assert 2 * len(code) >= len(exercises), [e.name for e in code]


# --- lab 00: specific messages ---------------------------------------------------------------------------


def test_lab00_q2_messages():
    assert "driver version" in check(lab00.q2, ceiling_driver).message
    assert "12.10" in check(lab00.q2, ceiling_float).message  # why a float is wrong
    assert "returned None" in check(lab00.q2, ceiling_no_return).message
    out = check(lab00.q2, ceiling_raises).message
    assert "raised IndexError" in out and "`ceiling_raises`" in out and 'split("CUDA Version: ")[2]' in out
    assert "expected a function `cuda_ceiling(smi_text) -> str`" in check(lab00.q2, "13.0").message
    assert "Graded on the H200 capture" in check(lab00.q2, ceiling_right).message


@pytest.mark.parametrize("buggy", [verdict_strings, verdict_floats])
def test_lab00_q5_comparing_versions_as_text_or_floats_is_explained(buggy):
    message = check(lab00.q5, buggy).message
    assert "cuda_verdict('12.4', '12.10', datacenter_gpu=True) returned 'compatible'" in message
    assert ("as strings" in message) if buggy is verdict_strings else ("As floats" in message)
    assert "tuple(int(p)" in message


def test_lab00_q5_rule_mistakes_are_named():
    message = check(lab00.q5, verdict_no_minor_version).message
    assert "minor-version compatibility" in message and "same major version" in message
    assert "data-centre GPUs only" in check(lab00.q5, verdict_ignores_gpu).message
    message = check(lab00.q5, lambda c, r, dc: "compatible" if r <= c else "minor-version compatibility").message
    assert "returned" in message
    assert "VERDICTS" in check(lab00.q5, verdict_bool).message


def test_lab00_q5_raising_and_wrong_arity_show_the_students_line():
    def verdict_crashes(driver_ceiling, runtime, datacenter_gpu):
        major = int(runtime.split(".")[2])  # IndexError: "13.0" has two parts
        return str(major)

    message = check(lab00.q5, verdict_crashes).message
    assert "raised IndexError" in message and "`verdict_crashes`" in message
    assert "runtime.split" in message and "lab_utils" not in message
    message = check(lab00.q5, lambda ceiling, runtime: "compatible").message
    assert "raised TypeError" in message


def test_verdict_agrees_with_the_rules_table():
    for ceiling, runtime, dc, expected, _ in lab00.VERDICT_CASES:
        assert lab00.cuda_verdict(ceiling, runtime, dc) == expected


def test_lab00_q4_unit_slips_and_the_datasheet_figure():
    assert "MiB" in check(lab00.q4, 143771).message
    message = check(lab00.q4, 150.75).message
    assert "GB (1e9 bytes)" in message and "GiB" in message and "140" not in message
    # the datasheet's "141 GB" read as 141e9 bytes is the wrong reading: capacity counts powers of two
    message = check(lab00.q4, 131.3).message
    assert "powers of two" in message and "about 141 GiB" in message and "not have" in message
    assert check(lab00.q4, 140.4).status is Status.CORRECT and check(lab00.q4, "140.4 GiB").status is Status.CORRECT
    assert "1024, not 1000" in check(lab00.q4, 143.771).message
    assert "number" in check(lab00.q4, "a lot").message  # wrong kind names the expected kind
    assert "140" not in check(lab00.q4, 120).message  # the answer is not given away
    assert "binary figure" in lab00.q4.hints[-1] and "powers of two" in lab00.q4.hints[-1]
    assert "binary figure" in lab00.q4.solution_text and "not 141e9 bytes" in lab00.q4.solution_text


def test_lab00_q6_and_q1_messages():
    assert "NVLinks" in check(lab00.q6, "NV18").message
    assert "GPUs" in check(lab00.q6, 2).message
    assert "whole number" in check(lab00.q6, 18.5).message
    assert "'NCCL'" in check(lab00.q1, {**LAYERS_RIGHT, "NCCL": "framework"}).message
    assert "missing" in check(lab00.q1, {"PyTorch": "framework"}).message
    assert "not a layer" in check(lab00.q1, {**LAYERS_RIGHT, "PyTorch": "app"}).message


# --- lab 00: the inventory, from the captures (no NVML) and through NVML (a stand-in NVML and nvidia-smi) ---


def smi_right(query_csv, smi_text):
    rows = list(csv.reader(io.StringIO(query_csv), skipinitialspace=True))
    header = [h.split(" ")[0] for h in rows[0]]
    out = []
    for i, row in enumerate(rows[1:]):
        f = dict(zip(header, row, strict=True))
        out.append({"index": i, "name": f["name"], "memory_total_mib": int(f["memory.total"].split()[0]),
                    "driver_version": f["driver_version"], "cuda_version": ceiling_right(smi_text)})
    return out


def smi_pandas(query_csv, smi_text):  # written differently: a DataFrame, other key order, float MiB
    import pandas as pd

    df = pd.read_csv(io.StringIO(query_csv), skipinitialspace=True)
    return pd.DataFrame({
        "cuda_version": ceiling_split(smi_text), "driver_version": df["driver_version"],
        "memory_total_mib": df["memory.total [MiB]"].str.removesuffix(" MiB").astype(float),
        "name": df["name"], "index": range(len(df)),
    })


def smi_first_row_only(query_csv, smi_text):
    return smi_right(query_csv, smi_text)[:1]


def smi_unit_left_in(query_csv, smi_text):
    return [{**row, "memory_total_mib": f"{row['memory_total_mib']} MiB"} for row in smi_right(query_csv, smi_text)]


def smi_spaces(query_csv, smi_text):
    rows = list(csv.reader(io.StringIO(query_csv)))  # no skipinitialspace: " 580.159.04"
    header = [h.strip().split(" ")[0] for h in rows[0]]
    return [{"index": i, "name": row[0], "memory_total_mib": int(row[2].split()[0]),
             "driver_version": dict(zip(header, row, strict=True))["driver_version"],
             "cuda_version": ceiling_right(smi_text)} for i, row in enumerate(rows[1:])]


def smi_driver_as_cuda(query_csv, smi_text):
    return [{**row, "cuda_version": row["driver_version"]} for row in smi_right(query_csv, smi_text)]


@pytest.fixture()
def no_nvml(monkeypatch):
    monkeypatch.setattr(lab00.inventory, "nvml_unavailable", lambda: "no NVIDIA driver here (test)")


def test_lab00_q3_from_the_captures(no_nvml):
    for right in (smi_right, smi_pandas):
        out = lab00.q3.check(None, right, quiet=True)
        assert out.status is Status.CORRECT, out.message
        assert "H200 captures" in out.message and "`nvml_inventory` was not run" in out.message
    out = lab00.q3.check(None, None, quiet=True)
    assert out.status is Status.NOT_ATTEMPTED and "smi_inventory" in out.message and "No NVML here" in out.message
    for wrong, says in [
        (smi_first_row_only, "only the first row"),
        (smi_unit_left_in, "strip the unit"),
        (smi_spaces, "spaces around it"),
        (smi_driver_as_cuda, "driver version"),
        (lambda q, s: {"name": "NVIDIA H200"}, "one dict per GPU"),
        (lambda q, s: [{"name": "NVIDIA H200"}], "has no ['index', 'memory_total_mib'"),
        ("smi_inventory", "expected a function"),
    ]:
        out = lab00.q3.check(None, wrong, quiet=True)
        assert out.status is Status.INCORRECT, (wrong, out.message)
        assert says in out.message, (says, out.message)
        assert "`smi_inventory`" in out.message


class FakeNVML(types.ModuleType):
    """Just enough of pynvml for the inventory: one H200 box with two GPUs; init is reference counted."""

    class NVMLError(Exception):
        pass

    def __init__(self, gpus: int = 2):
        super().__init__("pynvml")
        self.refs, self.gpus = 0, gpus

    def _need(self):
        if not self.refs:
            raise self.NVMLError("Uninitialized")

    def nvmlInit(self):
        self.refs += 1

    def nvmlShutdown(self):
        self._need()
        self.refs -= 1

    def nvmlSystemGetDriverVersion(self):
        self._need()
        return "580.159.04"

    def nvmlSystemGetCudaDriverVersion(self):
        self._need()
        return 13000

    def nvmlDeviceGetCount(self):
        self._need()
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, i):
        self._need()
        return i

    def nvmlDeviceGetName(self, h):
        return "NVIDIA H200"

    def nvmlDeviceGetMemoryInfo(self, h):
        total = 143771 * 2**20
        return types.SimpleNamespace(total=total, used=512 * 2**20, free=total - 512 * 2**20)


def nvml_right():
    import pynvml

    pynvml.nvmlInit()
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        v = pynvml.nvmlSystemGetCudaDriverVersion()
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            gpus.append({"index": i, "name": pynvml.nvmlDeviceGetName(h),
                         "memory_total_mib": pynvml.nvmlDeviceGetMemoryInfo(h).total // 2**20,
                         "driver_version": driver, "cuda_version": f"{v // 1000}.{v % 1000 // 10}"})
        return gpus
    finally:
        pynvml.nvmlShutdown()


def nvml_pandas():  # written differently: a DataFrame, float MiB, the version decoded with divmod
    import pandas as pd
    import pynvml

    pynvml.nvmlInit()
    try:
        major, rest = divmod(pynvml.nvmlSystemGetCudaDriverVersion(), 1000)
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        return pd.DataFrame({
            "name": [pynvml.nvmlDeviceGetName(h) for h in handles],
            "memory_total_mib": [pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**20 for h in handles],
            "index": range(len(handles)), "driver_version": pynvml.nvmlSystemGetDriverVersion(),
            "cuda_version": f"{major}.{rest // 10}",
        })
    finally:
        pynvml.nvmlShutdown()


def nvml_no_shutdown():
    import pynvml

    pynvml.nvmlInit()
    return [{"index": i, "name": pynvml.nvmlDeviceGetName(i), "driver_version": pynvml.nvmlSystemGetDriverVersion(),
             "memory_total_mib": pynvml.nvmlDeviceGetMemoryInfo(i).total / 2**20,  # float MiB is fine
             "cuda_version": "13.0"} for i in range(pynvml.nvmlDeviceGetCount())]


def nvml_variant(**change):
    def inventory():
        rows = nvml_right()
        import pynvml

        pynvml.nvmlInit()
        try:
            for row in rows:
                for key, fn in change.items():
                    row[key] = fn(pynvml, row)
        finally:
            pynvml.nvmlShutdown()
        return rows

    return inventory


@pytest.fixture()
def fake_nvml(monkeypatch, tmp_path):
    """A stand-in pynvml and nvidia-smi describing two H200s (the checks' NVML path, without a GPU)."""
    fake = FakeNVML(gpus=2)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    query = ("index, name, memory.total [MiB], driver_version\n"
             "0, NVIDIA H200, 143771 MiB, 580.159.04\n1, NVIDIA H200, 143771 MiB, 580.159.04\n")
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\n"
                      'case "$1" in\n'
                      f"  --query-gpu=*) cat <<'X'\n{query}X\n;;\n"
                      f"  *) cat <<'X'\n{probe.capture('nvidia-smi')}X\n;;\n"
                      "esac\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    return fake


def test_lab00_q3_through_nvml(fake_nvml):
    assert lab00.q3.check(nvml_pandas, None, quiet=True).correct
    # Written differently: the CUDA version as NVML gives it (13000 is 13.0).
    assert lab00.q3.check(nvml_variant(cuda_version=lambda nv, r: nv.nvmlSystemGetCudaDriverVersion()), None,
                          quiet=True).correct
    out = lab00.q3.check(nvml_right, None, quiet=True)
    assert out.status is Status.CORRECT, out.message
    assert "through NVML" in out.message and "nvidia-smi --query-gpu" in out.message and "2 GPU(s)" in out.message
    assert fake_nvml.refs == 0
    out = lab00.q3.check(None, smi_right, quiet=True)  # with NVML here, the NVML inventory is the one graded
    assert out.status is Status.NOT_ATTEMPTED and "nvml_inventory" in out.message
    for wrong, says in [
        (nvml_no_shutdown, "nvmlShutdown() in a `finally:`"),
        (nvml_variant(memory_total_mib=lambda nv, r: nv.nvmlDeviceGetMemoryInfo(r["index"]).total), "bytes"),
        (nvml_variant(cuda_version=lambda nv, r: nv.nvmlSystemGetCudaDriverVersion() / 1000), "as a string"),
        (nvml_variant(memory_total_mib=lambda nv, r: nv.nvmlDeviceGetMemoryInfo(r["index"]).used // 2**20),
         "not used or free memory"),
        (lambda: nvml_right()[:1], "found 1 GPU(s)"),
    ]:
        out = lab00.q3.check(wrong, None, quiet=True)
        assert out.status is Status.INCORRECT, (wrong, out.message)
        assert says in out.message, (says, out.message)
        assert fake_nvml.refs == 0  # the check shut down what the student left open


def test_lab00_q2_also_reads_this_machines_nvidia_smi(fake_nvml):
    message = check(lab00.q2, ceiling_right).message
    assert "the H200 capture, another driver's banner and this machine's nvidia-smi" in message


def test_nvml_unavailable_says_why_here():
    if lab00.nvml_unavailable() is None:
        pytest.skip("NVML works here")
    assert "NVML" in lab00.nvml_unavailable() or "nvidia-ml-py" in lab00.nvml_unavailable()


# --- honest checkers: a constant cannot pass, one answer written several ways means one thing ----------------


def test_lab00_q2_a_constant_fails_on_another_drivers_banner():
    for constant in (ceiling_constant, lambda smi_text: "13.0"):
        out = check(lab00.q2, constant)
        assert out.status is Status.INCORRECT and "another driver's banner" in out.message, out.message
    assert "another driver's banner" in check(lab00.q2, ceiling_right).message


def test_lab00_other_banner_changes_both_versions_at_random():
    h200 = probe.capture("nvidia-smi")
    seen = set()
    for seed in range(20):
        text = lab00.ceiling._other_banner(h200, random.Random(seed))
        header = probe.parse_smi_header(text)
        assert header["cuda_ceiling"] != "13.0" and header["driver_version"] != "580.159.04"
        assert "580.159.04" not in text and text.count("CUDA Version:") == 1
        seen.add(header["cuda_ceiling"])
    assert len(seen) >= 3


def test_lab00_versions_written_differently_are_one_version():
    assert version_of("13.0.0", "v") == version_of(13000, "v") == version_of(b"13.0", "v")
    assert version_of(12040, "v") == (12, 4) and version_of(" 12.10 ", "v") == (12, 10)
    with pytest.raises(Wrong, match="driver version"):
        version_of("580.159.04", "v")
    with pytest.raises(Wrong, match="12.10"):
        version_of(13.0, "v")


def test_lab00_q3_accepts_the_cuda_version_as_nvml_gives_it(no_nvml):
    def smi_nvml_int(query_csv, smi_text):
        return [{**row, "cuda_version": ceiling_nvml_int(smi_text)} for row in smi_right(query_csv, smi_text)]

    def smi_three_parts(query_csv, smi_text):
        return [{**row, "cuda_version": ceiling_three_parts(smi_text)} for row in smi_right(query_csv, smi_text)]

    for right in (smi_nvml_int, smi_three_parts):
        out = lab00.q3.check(None, right, quiet=True)
        assert out.status is Status.CORRECT, out.message


def test_lab00_q5_a_table_of_the_known_cases_fails_on_random_ones():
    table = {(c, r, dc): expected for c, r, dc, expected, _ in lab00.VERDICT_CASES}

    def verdict_table(driver_ceiling, runtime, datacenter_gpu):
        return table.get((driver_ceiling, runtime, datacenter_gpu), "incompatible")

    out = check(lab00.q5, verdict_table)
    assert out.status is Status.INCORRECT and "drawn at random" in out.message, out.message
    assert "8 more drawn at random" in check(lab00.q5, verdict_right).message
    lab00.verdict._grade_random_verdicts(verdict_packaging, random.Random(0))  # a right answer passes any draw


def test_lab00_q3_a_fixed_inventory_fails_on_another_machine(no_nvml):
    h200 = smi_right(probe.capture("query-gpu"), probe.capture("nvidia-smi"))
    out = lab00.q3.check(None, lambda query_csv, smi_text: [dict(row) for row in h200], quiet=True)
    assert out.status is Status.INCORRECT and "another machine" in out.message, out.message
    labels = set()
    for seed in range(20):
        label, query, banner = lab00.inventory._other_machine(probe.capture("query-gpu"), probe.capture("nvidia-smi"),
                                                    random.Random(seed))
        rows = lab00.reference_smi_inventory(query, banner)
        assert 2 <= len(rows) <= 4 and rows[0]["driver_version"] != "580.159.04"
        assert smi_right(query, banner) == rows
        labels.add((rows[0]["name"], len(rows)))
    assert len(labels) >= 4


def test_lab00_imports_no_torch():
    # Lab 00 is where a machine without torch is diagnosed: its checks must import without it.
    code = "import sys, lab_utils.exercises.lab00; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


# --- hints, solutions, completeness ----------------------------------------------------------------


def test_every_exercise_has_hints_and_solution():
    exercises = exercises_of(lab00)
    assert len(exercises) >= 4
    for exercise in exercises:
        assert 2 <= len(exercise.hints) <= 3, exercise.name
        assert all(h.strip() for h in exercise.hints), exercise.name
        assert exercise.solution_text.strip(), exercise.name


test_hints_step_from_first_to_last, test_solution_prints = hint_and_solution_tests(exercises_of(lab00))
