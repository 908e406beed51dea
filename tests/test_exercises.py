"""Every exercise check against a right, a wrong and a blank answer; the specific messages; hints and
solutions; and the simulated asynchronous device used by lab 01's timing exercise."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from _exercise_harness import check, exercises_of, hint_and_solution_tests, standard_tests

from lab_utils.exercises import lab00, lab01
from lab_utils.exercises.framework import Exercise, Status

# --- answers ---------------------------------------------------------------------------------------


def runtime_ok_right(driver_ceiling: str, runtime: str) -> bool:
    def key(v: str) -> tuple[int, int]:
        major, minor = (v.split(".") + ["0"])[:2]
        return int(major), int(minor)

    return key(runtime) <= key(driver_ceiling)


def runtime_ok_strings(driver_ceiling: str, runtime: str) -> bool:
    return runtime <= driver_ceiling  # the bug: compares character by character


def runtime_ok_floats(driver_ceiling: str, runtime: str) -> bool:
    return float(runtime) <= float(driver_ceiling)  # the bug: 12.10 == 12.1


def runtime_ok_major_only(driver_ceiling: str, runtime: str) -> bool:
    return int(runtime.split(".")[0]) <= int(driver_ceiling.split(".")[0])


def broken_time_ms():
    namespace: dict = {}
    exec(lab01.BROKEN_SNIPPET, namespace)
    return namespace["time_ms"]


def time_ms_right(run, sync, reps):
    run()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        run()
    sync()
    return (time.perf_counter() - t0) * 1000 / reps


def time_ms_no_warmup(run, sync, reps):
    t0 = time.perf_counter()
    for _ in range(reps):
        run()
    sync()
    return (time.perf_counter() - t0) * 1000 / reps


def time_ms_seconds(run, sync, reps):
    return time_ms_right(run, sync, reps) / 1000


def time_ms_total(run, sync, reps):
    return time_ms_right(run, sync, reps) * reps


LAYERS_RIGHT = {
    "libcuda.so": "driver", "nvidia-smi": "driver", "libcudart.so": "cuda runtime",
    "cuBLAS": "cuda-x library", "NCCL": "CUDA-X library", "PyTorch": "framework",
    "Triton Inference Server": "serving",
}

# (exercise, right answers, wrong answers)
CASES = [
    (lab00.q1, ["13.0", 13.0, 13, "13"], ["580.159.04", "12.8", 12.4, [13, 0]]),
    (lab00.q2, [runtime_ok_right], [runtime_ok_strings, runtime_ok_major_only, "13.0"]),
    (lab00.q3, [18, 18.0], [2, "NV18", 18.5, 900]),
    (lab00.q4, [143771 / 1024, 140.4, 141], [143771, 150.75, 143.771, 120]),
    (lab00.q5, [7], [8, 4, 6.5, "seven"]),
    (lab00.q6, [LAYERS_RIGHT], [{**LAYERS_RIGHT, "NCCL": "framework"}, {"PyTorch": "framework"}, "driver"]),
    (lab01.q1, [2 * 8192**3, 1.0995e12], [8192**3, 1.0995, 2e12, "lots"]),
    (lab01.q2, [time_ms_right, lab01.reference_time_ms], [broken_time_ms(), time_ms_no_warmup, 20.0]),
    (lab01.q3, [2 / 12, 0.1667, 0.17], [0.25, 2 / 3, 6, 1 / 12]),
    (lab01.q4, ["memory", "Memory-bound", " memory bound "], ["compute", "compute-bound", "io", 0.17]),
    (lab01.q5, [989e12 / 4.8e12, 206, 206.04], [0.206, 206_000, 103, 2.0]),
]


(
    test_right_answers_are_correct,
    test_wrong_answers_are_incorrect_and_show_the_value,
    test_blank_answers_are_not_attempted,
) = standard_tests(CASES)


def test_placeholder_functions_are_not_attempted():
    # What the generated lab leaves for a function exercise: a stub whose body is `...` or `pass`.
    def runtime_ok(driver_ceiling, runtime): ...

    def time_ms(run, sync, reps):
        pass

    assert check(lab00.q2, runtime_ok).status is Status.NOT_ATTEMPTED
    assert check(lab01.q2, time_ms).status is Status.NOT_ATTEMPTED


def test_cases_cover_every_exercise():
    covered = {id(ex) for ex, *_ in CASES}
    assert covered == {id(ex) for ex in exercises_of(lab00) + exercises_of(lab01)}


# --- specific messages -----------------------------------------------------------------------------


def test_lab00_q1_driver_version_named():
    assert "driver version" in check(lab00.q1, "580.159.04").message
    assert "driver version" in check(lab00.q1, 580.159).message


def test_lab00_q1_wrong_kind_names_expected_kind():
    assert "version" in check(lab00.q1, [13, 0]).message


@pytest.mark.parametrize("buggy", [runtime_ok_strings, runtime_ok_floats])
def test_lab00_q2_string_comparison_bug_explained(buggy):
    message = check(lab00.q2, buggy).message
    assert "strings" in message and "'12.10'" in message
    assert "runtime_ok('12.4', '12.10') returned True, expected False" in message


def test_lab00_q2_reports_first_failing_case():
    message = check(lab00.q2, runtime_ok_major_only).message
    assert "runtime_ok('13.0', '13.1')" in message and "minor" in message
    message = check(lab00.q2, lambda ceiling, runtime: True).message
    assert "runtime_ok('12.4', '13.0') returned True" in message


def test_lab00_q2_non_callable_and_non_bool_and_raising():
    out = check(lab00.q2, "13.0")
    assert out.status is Status.INCORRECT and "function" in out.message

    def forgot_return(driver_ceiling, runtime):
        ok = runtime <= driver_ceiling  # noqa: F841 (the mistake under test)

    out = check(lab00.q2, forgot_return)
    assert out.status is Status.INCORRECT and "True or False" in out.message
    out = check(lab00.q2, lambda ceiling, runtime: "yes")
    assert out.status is Status.INCORRECT and "True or False" in out.message
    out = check(lab00.q2, lambda ceiling: True)
    assert out.status is Status.INCORRECT and "raised TypeError" in out.message


def test_lab00_q2_accepts_numpy_bool():
    np = pytest.importorskip("numpy")
    assert check(lab00.q2, lambda c, r: np.bool_(runtime_ok_right(c, r))).correct


def test_lab00_q3_messages():
    assert "NVLinks" in check(lab00.q3, "NV18").message
    assert "GPUs" in check(lab00.q3, 2).message
    assert "whole number" in check(lab00.q3, 18.5).message


def test_lab00_q4_unit_slips():
    assert "MiB" in check(lab00.q4, 143771).message
    assert "GB (1e9 bytes)" in check(lab00.q4, 150.75).message
    assert "1024, not 1000" in check(lab00.q4, 143.771).message
    assert "number" in check(lab00.q4, "a lot").message  # wrong kind names the expected kind
    assert "140" not in check(lab00.q4, 120).message  # the answer is not given away


def test_lab00_q5_memory_slices():
    assert "memory slices" in check(lab00.q5, 8).message


def test_lab00_q6_messages():
    assert "'NCCL'" in check(lab00.q6, {**LAYERS_RIGHT, "NCCL": "framework"}).message
    assert "missing" in check(lab00.q6, {"PyTorch": "framework"}).message
    assert "not a layer" in check(lab00.q6, {**LAYERS_RIGHT, "PyTorch": "app"}).message
    assert "dict" in check(lab00.q6, "driver").message


def test_lab01_q1_factor_two():
    message = check(lab01.q1, 8192**3).message
    assert "factor 2" in message
    assert "TFLOP" in check(lab01.q1, 1.0995).message


def test_lab01_q2_unsynchronized_timing():
    out = check(lab01.q2, broken_time_ms())
    assert out.status is Status.INCORRECT
    assert "synchronize" in out.message or "sync()" in out.message
    assert "launch, not the work" in out.message


def test_lab01_q2_synchronized_after_the_clock():
    def sync_too_late(run, sync, reps):
        t0 = time.perf_counter()
        for _ in range(reps):
            run()
        elapsed = time.perf_counter() - t0
        sync()
        return elapsed * 1000 / reps

    assert "launch, not the work" in check(lab01.q2, sync_too_late).message


def test_lab01_q2_no_warmup():
    out = check(lab01.q2, time_ms_no_warmup)
    assert out.status is Status.INCORRECT and "warm" in out.message.lower()


def test_lab01_q2_seconds_and_total():
    assert "seconds" in check(lab01.q2, time_ms_seconds).message
    assert "divide by reps" in check(lab01.q2, time_ms_total).message


def test_lab01_q2_wrong_kinds():
    assert "function" in check(lab01.q2, 20.0).message
    assert "number" in check(lab01.q2, lambda run, sync, reps: "20 ms").message
    assert "raised" in check(lab01.q2, lambda run, sync: 20.0).message


def test_lab01_q2_is_fast_and_leaves_no_thread():
    t0 = time.perf_counter()
    for fn in (broken_time_ms(), time_ms_right):
        check(lab01.q2, fn)
    assert time.perf_counter() - t0 < 3.0  # each check < 1.5 s
    assert not [t for t in threading.enumerate() if t.name == "AsyncDevice"]


def test_lab01_q3_q4_q5_messages():
    assert "write" in check(lab01.q3, 0.25).message
    assert "bytes" in check(lab01.q3, 2 / 3).message
    assert "ridge" in check(lab01.q4, "compute").message
    assert "one of" in check(lab01.q4, "io").message
    assert "factor 1000" in check(lab01.q5, 0.206).message
    assert "factor 1000" in check(lab01.q5, 206_000).message
    assert "TF32" in check(lab01.q5, 103).message


# --- the simulated device and the reference timer --------------------------------------------------


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
        ms = lab01.reference_time_ms(lambda: dev.launch(0.01), dev.synchronize, reps=3)
    assert 7 < ms < 20
    with pytest.raises(ValueError):
        lab01.reference_time_ms(lambda: None, lambda: None, reps=0)


def test_import_starts_no_thread():
    # A fresh interpreter: importing the exercise modules must start no thread (no work at import).
    code = ("import threading; import lab_utils.exercises.lab00, lab_utils.exercises.lab01; "
            "assert threading.active_count() == 1, threading.enumerate()")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- hints, solutions, completeness ----------------------------------------------------------------


@pytest.mark.parametrize("module", [lab00, lab01], ids=lambda m: m.__name__)
def test_every_exercise_has_hints_and_solution(module):
    exercises = exercises_of(module)
    assert len(exercises) >= 4
    names = sorted(k for k, v in vars(module).items() if isinstance(v, Exercise))
    assert names == [f"q{i}" for i in range(1, len(names) + 1)]
    for exercise in exercises:
        assert 2 <= len(exercise.hints) <= 3, exercise.name
        assert all(h.strip() for h in exercise.hints), exercise.name
        assert exercise.solution_text.strip(), exercise.name



test_hints_step_from_first_to_last, test_solution_prints = hint_and_solution_tests(
    exercises_of(lab00) + exercises_of(lab01)
)


def test_check_prints_outcome(capsys):
    out = lab00.q3.check(18)
    assert out.correct
    assert "[ok]" in capsys.readouterr().out
