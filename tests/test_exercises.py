"""Labs 00 and 01: every exercise check against right answers (and right answers written differently), a blank
and plausible wrong answers; the specific messages; the code-exercise machinery (running the student's function,
its own traceback line, time limits, not applicable on this tier); hints and solutions; the simulated device."""

from __future__ import annotations

import csv
import io
import random
import re
import stat
import subprocess
import sys
import threading
import time
import types

import pytest
import torch
from _exercise_harness import check, exercises_of, hint_and_solution_tests, standard_tests
from _retry import tried

from lab_utils.course import probe
from lab_utils.exercises import framework, lab00, lab01
from lab_utils.exercises.framework import (
    CodeExercise,
    Exercise,
    NotApplicable,
    Status,
    Wrong,
    is_blank,
    run_student,
    student_frame,
)

HAS_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
needs_no_gpu = pytest.mark.skipif(HAS_CUDA, reason="checks the CPU tier")

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
    if lab00.parse_version(runtime) <= lab00.parse_version(driver_ceiling):
        return "compatible"
    return "forward compatibility needed" if datacenter_gpu else "incompatible"


def verdict_ignores_gpu(driver_ceiling, runtime, datacenter_gpu):
    if lab00.parse_version(runtime) <= lab00.parse_version(driver_ceiling):
        return "compatible"
    if runtime.split(".")[0] == driver_ceiling.split(".")[0]:
        return "minor-version compatibility"
    return "forward compatibility needed"


def verdict_bool(driver_ceiling, runtime, datacenter_gpu):
    return lab00.parse_version(runtime) <= lab00.parse_version(driver_ceiling)


# --- lab 01 answers --------------------------------------------------------------------------------------


def broken_time_ms():
    namespace: dict = {}
    exec(lab01.BROKEN_SNIPPET, namespace)
    return namespace["time_ms"]


def time_ms_right(fn, iters, warmup, sync):
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) * 1000 / iters


def time_ms_ns(fn, iters, warmup, sync):  # written differently: nanosecond clock, a list of per-call times
    i = 0
    while i < warmup:
        fn()
        i += 1
    sync()
    laps = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        sync()
        laps.append(time.perf_counter_ns() - t0)
    return sum(laps) / len(laps) / 1e6


def time_ms_no_warmup(fn, iters, warmup, sync):
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) * 1000 / iters


def time_ms_sync_too_late(fn, iters, warmup, sync):
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - t0
    sync()
    return elapsed * 1000 / iters


def time_ms_seconds(fn, iters, warmup, sync):
    return time_ms_right(fn, iters, warmup, sync) / 1000


def time_ms_total(fn, iters, warmup, sync):
    return time_ms_right(fn, iters, warmup, sync) * iters


def time_ms_warmup_timed(fn, iters, warmup, sync):
    sync()
    t0 = time.perf_counter()
    for _ in range(warmup + iters):
        fn()
    sync()
    return (time.perf_counter() - t0) * 1000 / iters


def time_ms_constant(fn, iters, warmup, sync):  # the simulated work's length, returned without measuring
    return 20.0


def tflops_right(n, device, timer):
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    ms = timer(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def tflops_zeros(n, device, timer):  # a product of zeros: on a GPU faster than real data (less power)
    a = torch.zeros(n, n, device=device)
    b = torch.zeros(n, n, device=device)
    ms = timer(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def tflops_ones(n, device, timer):
    a = torch.ones(n, n, device=device)
    ms = timer(lambda: a @ a)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def tflops_times_no_work(n, device, timer):  # times making a tensor of zeros, no matmul
    ms = timer(lambda: torch.zeros(n, n, device=device))
    return 2 * n**3 / (ms * 1e-3) / 1e12


def tflops_matmul_fn(n, device, timer):  # written differently: torch.matmul into an out tensor, seconds first
    a, b = torch.randn(2, n, n, device=device).unbind(0)
    c = torch.empty(n, n, device=device)
    seconds = timer(lambda: torch.matmul(a, b, out=c)) / 1000
    return 2.0 * n * n * n / seconds * 1e-12


def tflops_factor2(n, device, timer):
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    return n**3 / (timer(lambda: a @ b) * 1e-3) / 1e12


def tflops_alloc_inside(n, device, timer):
    ms = timer(lambda: torch.randn(n, n, device=device) @ torch.randn(n, n, device=device))
    return 2 * n**3 / (ms * 1e-3) / 1e12


def tflops_gflops(n, device, timer):
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    return 2 * n**3 / (timer(lambda: a @ b) * 1e-3) / 1e9


def tflops_ms_as_s(n, device, timer):
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    return 2 * n**3 / timer(lambda: a @ b) / 1e12


def tflops_elementwise(n, device, timer):
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    return 2 * n**3 / (timer(lambda: a * b) * 1e-3) / 1e12


def gbps_right(nbytes, device, timer):
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def gbps_bytes(nbytes, device, timer):  # written differently: byte tensors, bytes per second first
    src = torch.full((nbytes,), 7, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    bytes_per_s = (src.nbytes + dst.nbytes) / (timer(lambda: dst.copy_(src)) / 1e3)
    return bytes_per_s / 1e9


def gbps_once(nbytes, device, timer):
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return nbytes / (timer(lambda: dst.copy_(src)) * 1e-3) / 1e9


def gbps_gib(nbytes, device, timer):
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (timer(lambda: dst.copy_(src)) * 1e-3) / 2**30


def gbps_elements(nbytes, device, timer):
    src = torch.randn(nbytes, device=device)  # nbytes float32 elements: 4 x nbytes bytes
    dst = torch.empty_like(src)
    return 2 * nbytes / (timer(lambda: dst.copy_(src)) * 1e-3) / 1e9


def gbps_clone(nbytes, device, timer):
    src = torch.randn(nbytes // 4, device=device)
    return 2 * nbytes / (timer(lambda: torch.randn(nbytes // 4, device=device).copy_(src)) * 1e-3) / 1e9


def gbps_no_timer(nbytes, device, timer):
    return 10.0


# (exercise, right answers, wrong answers). lab00.q3 (two functions) and lab01.q7 (GPU only) have their own tests.
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
    (lab01.q1, [time_ms_right, time_ms_ns, lab01.reference_time_ms],
     [broken_time_ms(), time_ms_no_warmup, time_ms_sync_too_late, time_ms_seconds, time_ms_total, time_ms_constant,
      20.0]),
    (lab01.q2, [tflops_right, tflops_matmul_fn, lab01.reference_matmul_tflops],
     [tflops_factor2, tflops_alloc_inside, tflops_gflops, tflops_ms_as_s, tflops_elementwise, tflops_zeros,
      tflops_ones, tflops_times_no_work]),
    (lab01.q3, [gbps_right, gbps_bytes, lab01.reference_copy_gbps],
     [gbps_once, gbps_gib, gbps_elements, gbps_clone, gbps_no_timer]),
    (lab01.q4, [2 / 12, 0.1667, 0.17], [0.25, 2 / 3, 6, 1 / 12]),
    (lab01.q5, [989e12 / 4.8e12, 206, 206.04], [0.206, 206_000, 103, 2.0]),
    (lab01.q6, ["memory", "Memory-bound", " memory bound ", "bandwidth-bound", "memory_bandwidth"],
     ["compute", "compute-bound", "FLOP-bound", "io", "memory or compute", "not memory-bound", 0.17]),
]


(
    test_right_answers_are_correct,
    test_wrong_answers_are_incorrect_and_show_the_value,
    test_blank_answers_are_not_attempted,
) = standard_tests(CASES)


def test_placeholder_functions_are_not_attempted():
    # What the generated lab leaves for a function exercise: a stub whose body is `...` or `pass`, perhaps
    # with a docstring and a comment.
    def cuda_verdict(driver_ceiling, runtime, datacenter_gpu): ...

    def matmul_tflops(n, device, timer):
        pass

    def cuda_ceiling(smi_text: str) -> str:
        """The newest CUDA this driver supports."""
        ...  # YOUR CODE HERE

    assert check(lab00.q5, cuda_verdict).status is Status.NOT_ATTEMPTED
    assert check(lab01.q2, matmul_tflops).status is Status.NOT_ATTEMPTED
    assert check(lab00.q2, cuda_ceiling).status is Status.NOT_ATTEMPTED
    assert check(lab00.q2, lambda text: None).status is Status.NOT_ATTEMPTED  # a lambda returning None is a stub too


def test_cases_cover_every_exercise():
    covered = {id(ex) for ex, *_ in CASES} | {id(lab00.q3), id(lab01.q7)}
    assert covered == {id(ex) for ex in exercises_of(lab00) + exercises_of(lab01)}


@pytest.mark.parametrize("module", [lab00, lab01], ids=lambda m: m.__name__)
def test_at_least_half_of_the_exercises_run_code(module):
    exercises = exercises_of(module)
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
    monkeypatch.setattr(lab00, "nvml_unavailable", lambda: "no NVIDIA driver here (test)")


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


# --- lab 01: specific messages ---------------------------------------------------------------------------


def test_lab01_q1_unsynchronized_timing():
    for fn in (broken_time_ms(), time_ms_sync_too_late):
        out = check(lab01.q1, fn)
        assert out.status is Status.INCORRECT
        assert "sync()" in out.message and "launch, not the work" in out.message
        assert "clock stopped before the device finished" in out.message


def test_lab01_q1_warmup_seconds_total():
    assert "Warm up first" in check(lab01.q1, time_ms_no_warmup).message
    assert "Warm up first" in check(lab01.q1, time_ms_warmup_timed).message
    assert "seconds" in check(lab01.q1, time_ms_seconds).message
    assert "divide by iters" in check(lab01.q1, time_ms_total).message


def test_lab01_q1_wrong_kinds_and_crashes():
    assert "expected a function `time_ms(fn, iters, warmup, sync) -> float`" in check(lab01.q1, 20.0).message
    assert "number" in check(lab01.q1, lambda fn, iters, warmup, sync: "20 ms").message
    assert "raised TypeError" in check(lab01.q1, lambda fn, iters, warmup: 20.0).message

    def divides_by_zero(fn, iters, warmup, sync):
        count = 0
        return 1000 / count

    message = check(lab01.q1, divides_by_zero).message
    assert "raised ZeroDivisionError" in message and "`divides_by_zero`: `return 1000 / count`" in message


def test_lab01_q1_correct_message_says_what_was_graded():
    message = check(lab01.q1, time_ms_right).message
    assert ("simulated device" in message or "GPU sleep kernels" in message) and "reference timer" in message


def test_lab01_q1_on_the_real_matmul_catches_what_the_simulation_cannot_see():
    # Graded directly on the real matmul: the mistakes come out as factors far outside the noise band of a quiet
    # machine. Beside other test workers on two cores one measurement can land inside it, so each verdict gets
    # three tries (a real timing, not a simulated one: the check's own noise band is what is under test)
    def verdict(fn, done):
        """The grading of ``fn`` on the matmul, tried until ``done(outcome)`` or three times: the last outcome."""
        def grade():
            try:
                return lab01._grade_on_matmul(fn)
            except Wrong as err:
                return err
        return tried(grade, done)

    for fn, says in [(time_ms_total, "divide by iters"), (time_ms_seconds, "seconds"),
                     (time_ms_warmup_timed, "warm-up calls are inside your timed region")]:
        out = verdict(fn, lambda o, says=says: isinstance(o, Wrong) and says in str(o))
        assert isinstance(out, Wrong) and says in str(out), out
    right = verdict(time_ms_right, lambda o: isinstance(o, str))
    assert isinstance(right, str) and "reference timer" in right, right


def time_ms_events(fn, iters, warmup, sync):  # the GPU way: CUDA events around the loop
    for _ in range(warmup):
        fn()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


@needs_gpu
def test_lab01_q1_on_a_gpu_accepts_events_and_catches_the_missing_sync():
    for right in (time_ms_events, time_ms_right):
        out = check(lab01.q1, right)
        assert out.correct and "GPU sleep kernels" in out.message, out.message
    out = check(lab01.q1, broken_time_ms())
    assert "GPU kernels of known length" in out.message and "launch, not the work" in out.message
    assert "Warm up first" in check(lab01.q1, time_ms_no_warmup).message
    with pytest.raises(Wrong, match="GPU was still working"):
        lab01._grade_on_matmul(broken_time_ms())  # returned with the work still queued
    with pytest.raises(Wrong, match="faster than the reference timer's .* the clock stopped before the GPU finished"):
        lab01._grade_on_matmul(time_ms_sync_too_late)  # waited, but after reading the clock


def test_lab01_q1_is_fast_and_leaves_no_thread():
    t0 = time.perf_counter()
    for fn in (broken_time_ms(), time_ms_right):
        check(lab01.q1, fn)
    assert time.perf_counter() - t0 < 6.0
    assert not [t for t in threading.enumerate() if t.name == "AsyncDevice"]


def test_lab01_q1_restores_the_thread_count():
    before = torch.get_num_threads()
    check(lab01.q1, time_ms_right)
    assert torch.get_num_threads() == before


def test_lab01_q2_messages():
    assert "factor 2" in check(lab01.q2, tflops_factor2).message
    assert "creates its inputs" in check(lab01.q2, tflops_alloc_inside).message
    assert "GFLOP/s" in check(lab01.q2, tflops_gflops).message
    assert "milliseconds used as seconds" in check(lab01.q2, tflops_ms_as_s).message
    assert "elementwise" in check(lab01.q2, tflops_elementwise).message
    assert "the product you timed is all zeros" in check(lab01.q2, tflops_zeros).message
    assert "is all zeros" in check(lab01.q2, tflops_times_no_work).message  # said before "ran Nx faster"
    message = check(lab01.q2, tflops_ones).message
    assert "in every element" in message and "torch.randn" in message
    assert "never called timer" in check(lab01.q2, lambda n, device, timer: 1.0).message
    assert "takes the function to time" in check(lab01.q2, lambda n, device, timer: timer(3.0)).message
    message = check(lab01.q2, tflops_right).message
    assert "TFLOP/s from" in message and "float32 matmul" in message


def test_lab01_q3_messages():
    message = check(lab01.q3, gbps_once).message
    assert "factor-of-2 mistake" in message and "2 × nbytes" in message
    assert "GiB/s" in check(lab01.q3, gbps_gib).message
    assert "4x nbytes" in check(lab01.q3, gbps_elements).message
    assert "creates its inputs" in check(lab01.q3, gbps_clone).message
    assert "never called timer" in check(lab01.q3, gbps_no_timer).message
    assert "read + write counted" in check(lab01.q3, gbps_right).message


def test_lab01_q4_q5_q6_messages():
    assert "write" in check(lab01.q4, 0.25).message
    assert "bytes" in check(lab01.q4, 2 / 3).message
    assert "factor 1000" in check(lab01.q5, 0.206).message
    assert "factor 1000" in check(lab01.q5, 206_000).message
    assert "TF32" in check(lab01.q5, 103).message
    assert "ridge" in check(lab01.q6, "compute").message
    assert "one of" in check(lab01.q6, "io").message


# --- lab 01: the CUDA graph ------------------------------------------------------------------------------


def graph_no_copy(chain, static_x, xs):  # replays on the captured input
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = chain(static_x)
    outs = []
    for _ in xs:
        g.replay()
        outs.append(static_y.clone())
    return outs


def graph_no_clone(chain, static_x, xs):  # every output is the same static tensor
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = chain(static_x)
    outs = []
    for x in xs:
        static_x.copy_(x)
        g.replay()
        outs.append(static_y)
    return outs


def graph_eager(chain, static_x, xs):
    return [chain(x) for x in xs]


def graph_recapture(chain, static_x, xs):
    outs = []
    for x in xs:
        static_x.copy_(x)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = chain(static_x)
        g.replay()
        outs.append(y.clone())
    return outs


def graph_without_side_stream(chain, static_x, xs):  # written differently: no warm-up, a list comprehension
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain(static_x)

    def run(x):
        static_x.copy_(x)
        g.replay()
        return out.clone()

    return [run(x) for x in xs]


@needs_no_gpu
@pytest.mark.parametrize("answer", [lab01.reference_replay_with_graph, graph_eager, None, ..., 3])
def test_lab01_q7_is_not_applicable_on_the_cpu_tier(answer):
    out = check(lab01.q7, answer)
    assert out.status is Status.NOT_APPLICABLE and not out.graded and not out.correct
    assert str(out).startswith("[n/a] 01.7") and "not applicable on this tier" in str(out)
    assert "need an NVIDIA GPU" in out.message and "H200 reference run" in out.message and "µs" in out.message
    assert ("still blank" in out.message) == (answer is None or answer is ...)


@needs_gpu
def test_lab01_q7_on_a_gpu():
    for right in (lab01.reference_replay_with_graph, graph_without_side_stream):
        out = check(lab01.q7, right)
        assert out.correct, out.message
    for wrong, says in [(graph_no_copy, "static_x.copy_(x)"), (graph_no_clone, "clone()"),
                        (graph_eager, "never captured"), (graph_recapture, "captured 32 times")]:
        out = check(lab01.q7, wrong)
        assert out.status is Status.INCORRECT and says in out.message, (wrong, out.message)
    assert check(lab01.q7, None).status is Status.NOT_ATTEMPTED


# --- the framework's code-exercise machinery --------------------------------------------------------------


def test_run_student_returns_the_result_and_checks_its_kind():
    assert run_student(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(Wrong, match=r"f\(\) returned None \(NoneType\) \(does it end with `return \.\.\.`\?\); "
                                    "expected a number"):
        run_student(lambda: None, call="f()", returns=(int, float), returns_text="a number")
    with pytest.raises(Wrong, match="returned True"):
        run_student(lambda: True, call="f()", returns=(int, float), returns_text="a number")


def test_run_student_shows_the_students_line_not_ours():
    def students(x):
        y = x - x
        return x / y  # the line to show

    with pytest.raises(Wrong) as info:
        run_student(students, 1.0, what="ratio")
    message = str(info.value)
    assert message.startswith("ratio(1.0) raised ZeroDivisionError: float division by zero")
    assert "line" in message and "of `students`: `return x / y  # the line to show`" in message
    assert "lab_utils" not in message and "framework.py" not in message


def test_run_student_through_a_library_names_the_students_call():
    def students():
        return torch.ones(2) @ torch.ones(3)  # raises inside torch

    with pytest.raises(Wrong) as info:
        run_student(students, call="students()")
    assert "raised RuntimeError" in str(info.value) and "torch.ones(2) @ torch.ones(3)" in str(info.value)


def spin_forever():
    n = 0
    while True:
        n += 1


def test_run_student_time_limit_in_the_main_thread():
    t0 = time.perf_counter()
    with pytest.raises(Wrong) as info:
        run_student(spin_forever, call="spin_forever()", timeout_s=0.3)
    assert time.perf_counter() - t0 < 5
    message = str(info.value)
    assert "did not return within 0.3 s" in message and "of `spin_forever`" in message


def test_run_student_time_limit_restores_an_outer_timer():
    import signal

    fired = []
    old = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30)
        assert run_student(lambda: 7, timeout_s=1) == 7
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25 < remaining <= 30 and signal.getsignal(signal.SIGALRM) is not None and not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_run_student_time_limit_in_another_thread():
    box = {}

    def grade():
        try:
            run_student(spin_forever, call="spin_forever()", timeout_s=0.3)
        except Wrong as why:
            box["why"] = str(why)

    t = threading.Thread(target=grade)
    t.start()
    t.join(10)
    assert "did not return within 0.3 s" in box["why"] and "spin_forever" in box["why"]
    deadline = time.monotonic() + 5
    while any(th.name.startswith("student") for th in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [th for th in threading.enumerate() if th.name.startswith("student")]  # interrupted, gone


def test_run_student_lets_the_graders_own_verdicts_through():
    def calls_back(report):
        report()

    def reject():
        raise Wrong("the grader's own message")

    with pytest.raises(Wrong, match="^the grader's own message$"):
        run_student(calls_back, reject)


def test_student_frame_reads_a_remote_traceback():
    # What lab_utils.distributed.spawn.WorkerError.remote_traceback carries from a rank.
    text = (
        "Traceback (most recent call last):\n"
        f'  File "{lab01.__file__}", line 190, in _worker\n'
        "    result = fn(ctx, **kwargs)\n"
        '  File "/tmp/ipykernel_1234/2764.py", line 4, in allreduce_worker\n'
        "    dist.all_reduce(buf, op=dist.ReduceOp.SUM)\n"
        '  File "/usr/lib/python3/site-packages/torch/distributed/c10d_logger.py", line 81, in wrapper\n'
        "    return func(*args, **kwargs)\n"
        "RuntimeError: Connection closed by peer\n"
    )
    frame = student_frame(text)
    assert frame is not None and frame.lineno == 4 and frame.function == "allreduce_worker"
    assert str(frame) == "line 4 of `allreduce_worker`: `dist.all_reduce(buf, op=dist.ReduceOp.SUM)`"
    assert student_frame("no traceback here") is None


def test_is_blank():
    def stub_with_doc(x):
        """Docstring."""
        ...

    def real(x):
        return x

    assert is_blank(None) and is_blank(...) and is_blank(stub_with_doc) and is_blank(lambda: None)
    assert not is_blank(real) and not is_blank(0) and not is_blank("") and not is_blank(print)


def test_not_applicable_from_a_grader_and_from_applicable():
    def grade(value):
        raise NotApplicable("needs two GPUs; this machine has one")

    out = Exercise("x.1", "answer", grade).check(5, quiet=True)
    assert out.status is Status.NOT_APPLICABLE and str(out) == (
        "[n/a] x.1: not applicable on this tier. needs two GPUs; this machine has one")
    ex = CodeExercise("x.2", "fn", lambda fn: fn(), signature="fn()", applicable=lambda: "no GPU here.")
    assert ex.check(lambda: 1, quiet=True).message == "no GPU here. Your `fn` was not run."
    ex = CodeExercise("x.3", "fn", lambda fn: None, signature="fn()", applicable=lambda: None)
    assert ex.check(lambda: 1, quiet=True).correct


def test_accepted_is_the_last_correct_answer_and_none_otherwise():
    def grade(v):
        if v != 3:
            raise Wrong("not 3")

    ex = Exercise("x.5", "v", grade)
    assert ex.accepted is None
    ex.check(None, quiet=True)  # blank
    assert ex.accepted is None
    ex.check(3, quiet=True)
    assert ex.accepted == 3
    ex.check(4, quiet=True)  # a later wrong answer withdraws it: a later cell must not run an answer now refused
    assert ex.accepted is None


def test_a_grader_note_is_added_to_correct():
    ex = Exercise("x.4", "v", lambda v: "measured 3 ms.")
    assert ex.check(1, quiet=True).message == "`v` = 1. measured 3 ms."


# --- the simulated device and the reference timer ------------------------------------------------------


def test_async_device_launch_returns_before_work_is_done():
    with lab01.AsyncDevice(init_s=0.0) as dev:
        t0 = time.perf_counter()
        dev.launch(0.05)
        assert time.perf_counter() - t0 < 0.02
        assert dev.pending == 1
        dev.synchronize()
        assert dev.pending == 0
        assert time.perf_counter() - t0 >= 0.05
        assert len(dev.work_s) == 1 and dev.work_s[0] >= 0.05


def test_async_device_first_launch_pays_init():
    with lab01.AsyncDevice(init_s=0.05) as dev:
        t0 = time.perf_counter()
        dev.launch(0.0)
        dev.synchronize()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        dev.launch(0.0)
        dev.synchronize()
        assert first >= 0.05 > time.perf_counter() - t0


def test_async_device_leaves_no_thread_alive():
    before = threading.active_count()
    with lab01.AsyncDevice() as dev:
        assert dev.alive
        for _ in range(20):
            dev.launch(0.05)  # 1 s of queued work is dropped on shutdown
        t0 = time.perf_counter()
    assert time.perf_counter() - t0 < 1.0
    assert not dev.alive
    assert threading.active_count() == before
    dev.shutdown()  # safe twice
    with pytest.raises(RuntimeError):
        dev.launch(0.01)


def test_reference_time_ms_measures_the_work():
    with lab01.AsyncDevice(init_s=0.1) as dev:
        ms = lab01.reference_time_ms(lambda: dev.launch(0.01), 3, 1, dev.synchronize)
    assert 7 < ms < 20
    with pytest.raises(ValueError):
        lab01.reference_time_ms(lambda: None, 0, 0, lambda: None)


def test_import_starts_no_thread():
    # A fresh interpreter: importing the exercise modules must start no thread (no work at import).
    code = ("import threading; import lab_utils.exercises.lab00, lab_utils.exercises.lab01; "
            "assert threading.active_count() == 1, threading.enumerate()")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


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
        text = lab00._other_banner(h200, random.Random(seed))
        header = probe.parse_smi_header(text)
        assert header["cuda_ceiling"] != "13.0" and header["driver_version"] != "580.159.04"
        assert "580.159.04" not in text and text.count("CUDA Version:") == 1
        seen.add(header["cuda_ceiling"])
    assert len(seen) >= 3


def test_lab00_versions_written_differently_are_one_version():
    assert lab00._version_of("13.0.0", "v") == lab00._version_of(13000, "v") == lab00._version_of(b"13.0", "v")
    assert lab00._version_of(12040, "v") == (12, 4) and lab00._version_of(" 12.10 ", "v") == (12, 10)
    with pytest.raises(Wrong, match="driver version"):
        lab00._version_of("580.159.04", "v")
    with pytest.raises(Wrong, match="12.10"):
        lab00._version_of(13.0, "v")


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
    lab00._grade_random_verdicts(verdict_packaging, random.Random(0))  # a right answer passes any draw


def test_lab00_q3_a_fixed_inventory_fails_on_another_machine(no_nvml):
    h200 = smi_right(probe.capture("query-gpu"), probe.capture("nvidia-smi"))
    out = lab00.q3.check(None, lambda query_csv, smi_text: [dict(row) for row in h200], quiet=True)
    assert out.status is Status.INCORRECT and "another machine" in out.message, out.message
    labels = set()
    for seed in range(20):
        label, query, banner = lab00._other_machine(probe.capture("query-gpu"), probe.capture("nvidia-smi"),
                                                    random.Random(seed))
        rows = lab00.reference_smi_inventory(query, banner)
        assert 2 <= len(rows) <= 4 and rows[0]["driver_version"] != "580.159.04"
        assert smi_right(query, banner) == rows
        labels.add((rows[0]["name"], len(rows)))
    assert len(labels) >= 4


def test_lab01_q1_a_constant_fails_whatever_it_is():
    out = check(lab01.q1, time_ms_constant)
    assert out.status is Status.INCORRECT and "fixed number" in out.message, out.message
    for constant in (15.0, 20.0, 35.0, 50.0):
        assert not check(lab01.q1, lambda fn, iters, warmup, sync, c=constant: c).correct


def test_lab01_q1_work_lengths_are_drawn_far_enough_apart():
    firsts = set()
    for seed in range(50):
        first, second = lab01._work_lengths(lab01._WORK_S, random.Random(seed))
        assert lab01._WORK_S[0] <= first <= lab01._WORK_S[1]
        # No number is within the tolerance of both lengths.
        assert second * (1 - lab01._TOL) > first * (1 + lab01._TOL)
        firsts.add(round(first, 6))
    assert len(firsts) > 40


def test_lab01_grading_device_is_the_labs_own_resolver():
    from lab_utils.gpu.bench import resolve_device

    assert lab01.grading_device() == resolve_device("auto")


def test_lab01_q6_synonyms_name_the_same_roof():
    assert "ridge point" in check(lab01.q6, "compute-bound").message
    assert "one of" in check(lab01.q6, "memory or compute").message


def test_normalizers():
    assert framework.version("13") == framework.version("v13.0") == (13, 0)
    with pytest.raises(Wrong, match="major.minor"):
        framework.version("thirteen")
    with pytest.raises(Wrong, match="string"):
        framework.version(True)
    assert framework.fraction("85%") == pytest.approx(0.85) and framework.fraction(" 85 % ") == pytest.approx(0.85)
    assert framework.fraction("0.85") == framework.fraction(0.85) == 0.85
    with pytest.raises(Wrong, match="fraction"):
        framework.fraction("most")
    assert framework.choice(" Memory_Bound ", ["memory bound", "compute"]) == "memory bound"
    assert framework.choice("bandwidth-bound", ["memory"], {"memory": ["bandwidth bound"]}) == "memory"
    assert framework.choice("it is memory bound", ["memory bound"]) is None  # a whole answer, not a word in one
    assert framework.choice(3, ["memory"]) is None


def test_students_frames_and_shipping_share_one_library_test():
    from lab_utils.distributed import ranks

    assert framework.is_library_file is ranks.is_library_file
    assert not framework._is_students(framework.__file__) and not framework._is_students(threading.__file__)
    assert framework._is_students("<ipython-input-3>") and not framework._is_students("<frozen runpy>")
    assert framework._is_students(__file__)


def test_lab00_imports_no_torch():
    # Lab 00 is where a machine without torch is diagnosed: its checks must import without it.
    code = "import sys, lab_utils.exercises.lab00; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


# --- hints, solutions, completeness ----------------------------------------------------------------


@pytest.mark.parametrize("module", [lab00, lab01], ids=lambda m: m.__name__)
def test_every_exercise_has_hints_and_solution(module):
    exercises = exercises_of(module)
    assert len(exercises) >= 4
    names = sorted(k for k, v in vars(module).items() if isinstance(v, Exercise))
    assert names == [f"q{i}" for i in range(1, len(names) + 1)]
    for i, exercise in enumerate(exercises, 1):
        assert exercise.name.startswith(f"{module.__name__[-2:]}.{i} "), exercise.name  # numbered in order
        assert 2 <= len(exercise.hints) <= 3, exercise.name
        assert all(h.strip() for h in exercise.hints), exercise.name
        assert exercise.solution_text.strip(), exercise.name


test_hints_step_from_first_to_last, test_solution_prints = hint_and_solution_tests(
    exercises_of(lab00) + exercises_of(lab01)
)


def test_check_prints_outcome(capsys):
    out = lab00.q6.check(18)
    assert out.correct
    assert "[ok]" in capsys.readouterr().out


def test_a_hint_or_solution_ending_a_cell_is_shown_once(capsys):
    # hint() prints and returns its text; IPython shows a cell's last value too, so a plain str came out twice.
    from IPython.core.formatters import DisplayFormatter

    ex = Exercise("00.9 demo", "answer", lambda v: None, hints=["the first step"], solution_text="answer = 1")
    for show in (ex.hint, ex.solution):
        shown = show()
        assert isinstance(shown, str) and capsys.readouterr().out == shown + "\n"  # printed once, still returned
        assert DisplayFormatter().format(shown) == ({}, {})  # and not shown again as the cell's value


@pytest.mark.parametrize(("text", "want"), [
    ("the model's output is named 'OUTPUT__0'.", "The model's output is named 'OUTPUT__0'."),
    ("is the client the one for this endpoint?", "Is the client the one for this endpoint?"),
    ("a step", "A step"),
    ("load_model's config= takes JSON text", "load_model's config= takes JSON text"),
    ("x is float32 and the model's INPUT__0 is TYPE_FP32", "x is float32 and the model's INPUT__0 is TYPE_FP32"),
    ("config= takes the configuration as JSON", "config= takes the configuration as JSON"),
    ("`logger = trt.Logger(...)`", "`logger = trt.Logger(...)`"),
])
def test_a_message_starting_with_a_code_name_keeps_its_case(text, want):
    assert framework.sentence(text) == want


def test_lab04_hints_keep_code_names_as_written():
    from lab_utils.exercises import lab04

    hint = lab04._hint("bad argument type for config", lab04._DEPLOY_HINTS)
    assert hint.startswith(" load_model's config= takes JSON text"), hint
    assert lab04._hint("unknown output 'y'", lab04._CLIENT_HINTS).startswith(" The model's output")
