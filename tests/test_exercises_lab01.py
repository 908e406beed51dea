"""Lab 01: every exercise check against right answers (and right answers written differently), a blank and
plausible wrong answers; the specific messages; the CUDA graph; the simulated device and the reference timer;
hints and solutions."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from _exercise_harness import check, exercises_of, hint_and_solution_tests, standard_tests
from _retry import tried

from lab_utils.exercises import lab01
from lab_utils.exercises.framework import (
    CodeExercise,
    Status,
    Wrong,
)
from lab_utils.exercises.lab01 import timing_loop

HAS_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
needs_no_gpu = pytest.mark.skipif(HAS_CUDA, reason="checks the CPU tier")


# --- lab 01 answers --------------------------------------------------------------------------------------


def time_ms_broken(fn, iters, warmup, sync):  # the notebook's starting code: no warm-up, no sync
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1000 / iters


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


_OUTCOMES: dict[tuple[str, object], object] = {}


def graded(exercise, value):
    """The check's outcome for ``value``, computed once per session: the right/wrong tests and the message tests read
    the same outcome (a timing check runs real work for seconds)."""
    key = (exercise.name, value)
    if key not in _OUTCOMES:
        _OUTCOMES[key] = check(exercise, value)
    return _OUTCOMES[key]


# (exercise, right answers, wrong answers). lab01.q7 (GPU only) has its own tests.
CASES = [
    (lab01.q1, [time_ms_right, time_ms_ns, lab01.reference_time_ms],
     [time_ms_broken, time_ms_no_warmup, time_ms_sync_too_late, time_ms_seconds, time_ms_total, time_ms_constant,
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
) = standard_tests(CASES, graded)


def test_cases_cover_every_exercise():
    covered = {id(ex) for ex, *_ in CASES} | {id(lab01.q7)}
    assert covered == {id(ex) for ex in exercises_of(lab01)}


def test_at_least_half_of_the_exercises_run_code():
    exercises = exercises_of(lab01)
    code = [e for e in exercises if isinstance(e, CodeExercise)]
    assert 2 * len(code) >= len(exercises), [e.name for e in code]


# --- lab 01: specific messages ---------------------------------------------------------------------------


def test_lab01_q1_unsynchronized_timing():
    for fn in (time_ms_broken, time_ms_sync_too_late):
        out = graded(lab01.q1, fn)
        assert out.status is Status.INCORRECT
        assert "sync()" in out.message and "launch, not the work" in out.message
        assert "clock stopped before the device finished" in out.message


def test_lab01_q1_warmup_seconds_total():
    assert "Warm up first" in graded(lab01.q1, time_ms_no_warmup).message
    assert "Warm up first" in graded(lab01.q1, time_ms_warmup_timed).message
    assert "seconds" in graded(lab01.q1, time_ms_seconds).message
    assert "divide by iters" in graded(lab01.q1, time_ms_total).message


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
    message = graded(lab01.q1, time_ms_right).message
    assert ("simulated device" in message or "GPU sleep kernels" in message) and "reference timer" in message


def test_lab01_q1_on_the_real_matmul_catches_what_the_simulation_cannot_see():
    # Graded directly on the real matmul: the mistakes come out as factors far outside the noise band of a quiet
    # machine. Beside other test workers on two cores one measurement can land inside it, so each verdict gets
    # three tries (a real timing, not a simulated one: the check's own noise band is what is under test)
    def verdict(fn, done):
        """The grading of ``fn`` on the matmul, tried until ``done(outcome)`` or three times: the last outcome."""
        def grade():
            try:
                return timing_loop._grade_on_matmul(fn)
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
    out = check(lab01.q1, time_ms_broken)
    assert "GPU kernels of known length" in out.message and "launch, not the work" in out.message
    assert "Warm up first" in check(lab01.q1, time_ms_no_warmup).message
    with pytest.raises(Wrong, match="GPU was still working"):
        timing_loop._grade_on_matmul(time_ms_broken)  # returned with the work still queued
    with pytest.raises(Wrong, match="faster than the reference timer's .* the clock stopped before the GPU finished"):
        timing_loop._grade_on_matmul(time_ms_sync_too_late)  # waited, but after reading the clock


def test_lab01_q1_is_fast_and_leaves_no_thread():
    t0 = time.perf_counter()
    for fn in (time_ms_broken, time_ms_right):
        check(lab01.q1, fn)
    assert time.perf_counter() - t0 < 6.0
    assert not [t for t in threading.enumerate() if t.name == "AsyncDevice"]


def test_lab01_q1_restores_the_thread_count():
    before = torch.get_num_threads()
    check(lab01.q1, time_ms_right)
    assert torch.get_num_threads() == before


def test_lab01_q2_messages():
    assert "factor 2" in graded(lab01.q2, tflops_factor2).message
    assert "creates its inputs" in graded(lab01.q2, tflops_alloc_inside).message
    assert "GFLOP/s" in graded(lab01.q2, tflops_gflops).message
    assert "milliseconds used as seconds" in graded(lab01.q2, tflops_ms_as_s).message
    assert "elementwise" in graded(lab01.q2, tflops_elementwise).message
    assert "the product you timed is all zeros" in graded(lab01.q2, tflops_zeros).message
    assert "is all zeros" in graded(lab01.q2, tflops_times_no_work).message  # said before "ran Nx faster"
    message = graded(lab01.q2, tflops_ones).message
    assert "in every element" in message and "torch.randn" in message
    assert "never called timer" in check(lab01.q2, lambda n, device, timer: 1.0).message
    assert "takes the function to time" in check(lab01.q2, lambda n, device, timer: timer(3.0)).message
    message = graded(lab01.q2, tflops_right).message
    assert "TFLOP/s from" in message and "float32 matmul" in message


def test_lab01_q3_messages():
    message = graded(lab01.q3, gbps_once).message
    assert "factor-of-2 mistake" in message and "2 × nbytes" in message
    assert "GiB/s" in graded(lab01.q3, gbps_gib).message
    assert "4x nbytes" in graded(lab01.q3, gbps_elements).message
    assert "creates its inputs" in graded(lab01.q3, gbps_clone).message
    assert "never called timer" in check(lab01.q3, gbps_no_timer).message
    assert "read + write counted" in graded(lab01.q3, gbps_right).message


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
        assert dev._thread.is_alive()
        for _ in range(20):
            dev.launch(0.05)  # 1 s of queued work is dropped on shutdown
        t0 = time.perf_counter()
    assert time.perf_counter() - t0 < 1.0
    assert not dev._thread.is_alive()
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


# --- honest checkers: a constant cannot pass ----------------------------------------------------------------


def test_lab01_q1_a_constant_fails_whatever_it_is():
    out = graded(lab01.q1, time_ms_constant)
    assert out.status is Status.INCORRECT and "fixed number" in out.message, out.message
    for constant in (15.0, 20.0, 35.0, 50.0):
        assert not check(lab01.q1, lambda fn, iters, warmup, sync, c=constant: c).correct


def test_lab01_q1_work_lengths_are_drawn_far_enough_apart():
    firsts = set()
    for seed in range(50):
        first, second = timing_loop._work_lengths(timing_loop._WORK_S, random.Random(seed))
        assert timing_loop._WORK_S[0] <= first <= timing_loop._WORK_S[1]
        # No number is within the tolerance of both lengths.
        assert second * (1 - timing_loop._TOL) > first * (1 + timing_loop._TOL)
        firsts.add(round(first, 6))
    assert len(firsts) > 40


def test_lab01_grading_device_is_the_labs_own_resolver():
    from lab_utils.gpu.bench import resolve_device

    assert lab01.grading_device() == resolve_device("auto")


def test_lab01_q6_synonyms_name_the_same_roof():
    assert "ridge point" in check(lab01.q6, "compute-bound").message
    assert "one of" in check(lab01.q6, "memory or compute").message


# --- hints, solutions, completeness ----------------------------------------------------------------


def test_every_exercise_has_hints_and_solution():
    exercises = exercises_of(lab01)
    assert len(exercises) >= 4
    for exercise in exercises:
        assert 2 <= len(exercise.hints) <= 3, exercise.name
        assert all(h.strip() for h in exercise.hints), exercise.name
        assert exercise.solution_text.strip(), exercise.name


test_hints_step_from_first_to_last, test_solution_prints = hint_and_solution_tests(exercises_of(lab01))
