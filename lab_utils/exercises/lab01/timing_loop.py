"""Lab 01's 01.1, the timing loop, graded on asynchronous work of known length (GPU sleep kernels, or the simulated
``AsyncDevice``) and on a real matmul against the reference timer; and the device every code exercise of the lab
runs on (``grading_device``). Units: ms.
"""

from __future__ import annotations

import contextlib
import functools
import math
import queue
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lab_utils import timing
from lab_utils.exercises.framework import (
    CodeExercise,
    References,
    Wrong,
    number,
    per_call_wrong,
    run_student,
    source_as,
)
from lab_utils.gpu.bench import resolve_device


def grading_device() -> str:
    """Where the code exercises run: ``"cuda"`` when torch can use a GPU, else ``"cpu"`` (the lab's own
    ``resolve_device("auto")``, so the check and the lab's measurements pick the same device)."""
    return resolve_device("auto")


def chip(device: str) -> str:
    return "GPU" if device.startswith("cuda") else "CPU"


@contextlib.contextmanager
def one_cpu_thread(device: str) -> Iterator[None]:
    # Two BLAS threads on a shared 2-core machine stall each other whenever one loses its core: one thread
    # makes the student's timing and the reference's comparable. On a GPU the count stays as it is.
    saved = torch.get_num_threads()
    torch.set_num_threads(1 if device == "cpu" else saved)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


# --- q1: the timing loop ------------------------------------------------------------------------------


class AsyncDevice:
    """A simulated GPU: ``launch(work_s)`` queues work and returns at once; a worker thread runs it.

    The first piece of work also pays ``init_s`` seconds of one-time initialisation (as CUDA's lazy
    context and module loading do). ``synchronize()`` waits until all launched work is done.
    ``work_s`` records how long each launched piece of work really took on the worker (seconds,
    initialisation excluded), so a grader can judge against what ran, not what was asked for.
    Use it as a context manager, or call ``shutdown()``: no thread is left behind.
    """

    def __init__(self, init_s: float = 0.15) -> None:
        self.init_s = init_s
        self.work_s: list[float] = []
        self._queue: queue.SimpleQueue[float | None] = queue.SimpleQueue()
        self._done = threading.Condition()
        self._pending = 0  # launched and not finished
        self._stopping = False
        self._initialised = False  # touched by the worker only
        self._thread = threading.Thread(target=self._work, name="AsyncDevice", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            if not self._stopping:  # on shutdown, queued work is dropped, so shutdown is quick
                if not self._initialised:
                    time.sleep(self.init_s)
                    self._initialised = True
                t0 = time.perf_counter()
                time.sleep(item)
                self.work_s.append(time.perf_counter() - t0)
            with self._done:
                self._pending -= 1
                self._done.notify_all()

    def launch(self, work_s: float) -> None:
        """Queue ``work_s`` seconds of work and return immediately, like a kernel launch."""
        if self._stopping:
            raise RuntimeError("AsyncDevice is shut down; create a new one")
        if work_s < 0:
            raise ValueError(f"work_s must be >= 0 seconds, got {work_s}")
        with self._done:
            self._pending += 1
        self._queue.put(float(work_s))

    def synchronize(self, timeout_s: float = 60.0) -> None:
        """Block until every launched piece of work has finished (like ``torch.cuda.synchronize()``)."""
        with self._done:
            if not self._done.wait_for(lambda: self._pending == 0, timeout=timeout_s):
                raise TimeoutError(f"AsyncDevice: work still pending after {timeout_s} s")

    @property
    def pending(self) -> int:
        """Launched pieces of work not finished yet."""
        with self._done:
            return self._pending

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Drop queued work and stop the worker thread; safe to call twice."""
        if not self._stopping:
            self._stopping = True
            self._queue.put(None)
        self._thread.join(timeout_s)

    def __enter__(self) -> AsyncDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def reference_time_ms(fn: Callable[[], Any], iters: int, warmup: int, sync: Callable[[], Any]) -> float:
    """Milliseconds per call of ``fn()``, where ``fn`` may only launch work and ``sync()`` waits for it.

    ``warmup`` untimed calls absorb one-time costs (lazy initialisation, caches); synchronizing before
    starting and before stopping the host clock makes it measure the work, not the launches.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    for _ in range(warmup):  # one-time costs (CUDA context, cuBLAS handle) outside the timing
        fn()
    sync()  # ...and finished before the clock starts
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()  # wait for the work, not just the launches
    return (time.perf_counter() - t0) * 1000 / iters


# The work per call is drawn at random for every check, twice, the second 2.2-2.6x the first: a function that
# returns a constant cannot fall within the tolerance (±30%) of both. The one-time cost is 8x one call's work, so
# forgetting the warm-up gives 1 + 8/5 = 2.6x at 5 calls, far outside the tolerance, whatever the draw.
_WORK_S = (0.012, 0.02)  # the first length, seconds: long against thread wake-ups on a loaded machine
_WORK_STEP = (2.2, 2.6)  # the second length / the first
_INIT_PER_WORK = 8.0
_ITERS_SIM = 5
_TOL = 0.3  # relative, on work whose duration is known
_GPU_WORK_MS = (3.0, 5.0)  # the first length on a GPU, milliseconds


def _work_lengths(low_high: tuple[float, float], rng: random.Random) -> tuple[float, float]:
    first = rng.uniform(*low_high)
    return first, first * rng.uniform(*_WORK_STEP)


def _judge_runs(runs: list[tuple[float, float, int | bool]], where: str) -> str:
    """Judge (ms, expected ms, work pending) of the two work lengths: a fixed result first, then each run."""
    (first, want1, _), (second, want2, _) = runs
    if first == second:  # the same float for work of two lengths: nothing was measured
        raise Wrong(f"{where}: {first:.3g} ms for calls of {want1:.3g} ms and the same for calls of {want2:.3g} ms: "
                    "the result does not follow the work. Measure it (the clock around the calls), don't return "
                    "a fixed number.")
    # A seconds slip scales with the work (2.2-2.6x longer work, 2.2-2.6x the result); a clock read before the work
    # ends measures launches, which do not: on a loaded machine the launches alone can come near 1/1000 of the work.
    scales = (second / first) / (want2 / want1) > 0.7 if first > 0 else False
    for ms, expected_ms, pending in runs:
        _judge_known_work(ms, expected_ms, pending, _ITERS_SIM, where, scales=scales)
    return " and ".join(f"{ms:.3g} ms for {expected_ms:.3g} ms of work" for ms, expected_ms, _ in runs)


def _judge_known_work(ms: float, expected_ms: float, pending: int | bool, iters: int, where: str,
                      scales: bool = True) -> None:
    ratio = ms / expected_ms
    if 1 - _TOL <= ratio <= 1 + _TOL:
        return
    if ratio < 1 - _TOL:
        if not pending and scales and 1 - _TOL <= ratio * 1e3 <= 3:
            raise Wrong(f"{where}: {ms:.3g} looks like seconds per call; return milliseconds (multiply by 1000)")
        still = " (work was still running when your function returned)" if pending else ""
        raise Wrong(f"{where}: {ms:.3g} ms is far less than the work takes ({expected_ms:.3g} ms): you timed the "
                    f"launch, not the work{still}. The clock stopped before the device finished: call sync() "
                    "before reading the clock (or time with CUDA events).")
    # Above the band: the total of the calls (near iters x) or the first call's one-time initialisation inside the
    # timed region (near 1 + _INIT_PER_WORK / iters x), whichever is nearer on a log scale: a loaded machine
    # stretches each call's wake-ups, which can push a total out of a fixed band around iters.
    if abs(math.log(ratio / iters)) < abs(math.log(ratio / (1 + _INIT_PER_WORK / iters))):
        raise Wrong(f"{where}: {ms:.3g} ms looks like the total of all {iters} calls; return the time per call "
                    "(divide by iters)")
    raise Wrong(f"{where}: {ms:.3g} ms is far more than one call's work ({expected_ms:.3g} ms): your timed region "
                "includes the device's one-time initialisation. Warm up first: `warmup` untimed calls of fn(), "
                "then sync(), then start the clock.")


def _grade_on_simulated_device(fn: Any) -> str:
    where = "on the simulated asynchronous device"
    lengths = _work_lengths(_WORK_S, random.Random())
    runs: list[tuple[float, float, int | bool]] = []
    for work in lengths:
        with AsyncDevice(init_s=_INIT_PER_WORK * work) as dev:
            got = run_student(fn, lambda w=work: dev.launch(w), _ITERS_SIM, 1, dev.synchronize,
                              call=f"time_ms(launch, iters={_ITERS_SIM}, warmup=1, sync)", timeout_s=30)
            pending = dev.pending  # work still running when the function returned: it never synchronized
            ran_s = list(dev.work_s)  # how long the work really took here (sleep overshoots on a loaded machine)
        expected_ms = 1e3 * (statistics.median(ran_s) if ran_s else work)
        runs.append((number(got, f"{where}, time_ms's result"), expected_ms, pending))
    return f"simulated device: {_judge_runs(runs, where)}"


def _grade_on_gpu_kernels(fn: Any) -> str:
    # Real asynchronous work of known length: torch.cuda._sleep spins a GPU kernel for a number of clock cycles.
    where = "on GPU kernels of known length"
    cycles = 10_000_000
    per_ms = cycles / timing.benchmark(lambda: torch.cuda._sleep(cycles), reps=3, warmup=1, device="cuda").median_ms
    lengths = _work_lengths(_GPU_WORK_MS, random.Random())
    runs: list[tuple[float, float, int | bool]] = []
    for work_ms in lengths:
        work, init = int(work_ms * per_ms), int(_INIT_PER_WORK * work_ms * per_ms)
        expected_ms = timing.benchmark(lambda w=work: torch.cuda._sleep(w), reps=3, warmup=1, device="cuda").median_ms
        first = [True]

        def launch(work: int = work, init: int = init, first: list[bool] = first) -> None:
            if first[0]:  # the first call is slow, as a first CUDA call is (context, module loading, cuBLAS handle)
                first[0] = False
                torch.cuda._sleep(init)
            torch.cuda._sleep(work)

        torch.cuda.synchronize()
        got = run_student(fn, launch, _ITERS_SIM, 1, torch.cuda.synchronize,
                          call=f"time_ms(launch, iters={_ITERS_SIM}, warmup=1, sync)", timeout_s=60)
        pending = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        runs.append((number(got, f"{where}, time_ms's result"), expected_ms, pending))
    return f"GPU sleep kernels: {_judge_runs(runs, where)}"


_ITERS_MM, _WARMUP_MM = 8, 16  # timing the warm-up too gives 3x, the total 8x: both far outside the band
_BAND = (0.5, 2.0)  # student / reference on a real matmul
_TRIES = 8
_SYNC_FIX = ("Call sync() (torch.cuda.synchronize) before reading the clock, or time with CUDA events and read "
             "elapsed_time after end.synchronize().")


def _grade_on_matmul(fn: Any) -> str:
    device = grading_device()
    n, dtype = (8192, torch.bfloat16) if device == "cuda" else (384, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm, label = (lambda: a @ b), f"{n}x{n} {str(dtype).removeprefix('torch.')} matmul on the {chip(device)}"
    where = f"on a real {label}"
    mine: list[float] = []
    refs: list[float] = []
    with one_cpu_thread(device):
        # The reference is the exercise's own reference implementation on the same matmul, so both sides see
        # the same kind of noise (a mean over iters calls). Noise only ever adds time (another process takes
        # the core), so the fastest of several tries is the best estimate on either side; a try costs ~50 ms
        # on the CPU, and a wrong answer (a factor of 3, 8 or 1000) stays outside the band whatever the noise.
        sync = functools.partial(timing.sync, device)
        for _ in range(_TRIES):
            refs.append(reference_time_ms(mm, _ITERS_MM, _WARMUP_MM, sync))
            got = run_student(fn, mm, _ITERS_MM, _WARMUP_MM, sync,
                              call=f"time_ms(matmul, iters={_ITERS_MM}, warmup={_WARMUP_MM}, sync)", timeout_s=120)
            pending = device == "cuda" and not torch.cuda.current_stream().query()  # still working: no sync
            mine.append(number(got, f"{where}, time_ms's result"))
            refs.append(reference_time_ms(mm, _ITERS_MM, _WARMUP_MM, sync))
            ms, ref = min(mine), min(refs)
            if pending:
                raise Wrong(f"{where}: {mine[-1]:.3g} ms, {ref / mine[-1]:.0f}x faster than the reference timer's "
                            f"{ref:.3g} ms, and the GPU was still working when your function returned: the clock "
                            f"stopped before the GPU finished. {_SYNC_FIX}")
            if _BAND[0] <= ms / ref <= _BAND[1]:
                return f"{label}: {ms:.3g} ms against the reference timer's {ref:.3g} ms"
    raise per_call_wrong(where, ms, ref, _ITERS_MM, _WARMUP_MM, reference="the reference timer",
                         tries=f" (fastest of {_TRIES} tries each)", gpu_fix=_SYNC_FIX if device == "cuda" else "")


def _grade_time_ms(fn: Any) -> str:
    first = _grade_on_gpu_kernels(fn) if grading_device() == "cuda" else _grade_on_simulated_device(fn)
    second = _grade_on_matmul(fn)
    return f"Graded on {first}; and on a {second}."


q1 = CodeExercise(
    name="01.1 the timing loop", var="time_ms", grade=_grade_time_ms,
    references=References("write the timing loop yourself", reference_time_ms),
    signature="time_ms(fn, iters, warmup, sync) -> float",
    hints=[
        "fn() returns as soon as its work is queued, long before it is done (on a GPU, and on the simulated "
        "device the check uses without one). What does the host clock measure if nothing waits for the work?",
        "Two fixes: `warmup` untimed calls first, then sync(), so one-time costs stay out; and sync() after the "
        "timed loop, before reading the clock, so you measure the work, not its launches.",
        "The shape: the warm-up calls, sync(), read time.perf_counter(); the timed calls, sync(), read the clock "
        "again; the elapsed seconds over iters, in ms. (On a GPU, CUDA events around the loop work too.)",
    ],
    solution_text="import time\n\n" + source_as(reference_time_ms, "time_ms(fn, iters, warmup, sync)") + (
        "# On a GPU, CUDA events: start.record(); loop; end.record(); end.synchronize();\n"
        "# start.elapsed_time(end) / iters (lab_utils.timing.benchmark does this per call)."),
)

