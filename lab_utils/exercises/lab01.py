"""Lab 01 exercises: CUDA and cuBLAS timing, run on this machine's device (the GPU, else the CPU) against the
reference implementations. Units: ms, TFLOP/s = 1e12 FLOP/s, GB/s = 1e9 bytes/s.

Design notes: docs/internals.md#lab_utilsexerciseslab01py
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
from lab_utils.course import specs
from lab_utils.exercises.framework import (
    CodeExercise,
    Exercise,
    References,
    Wrong,
    close_to,
    fastest_ratio,
    items,
    match_slip,
    number,
    one_of,
    per_call_wrong,
    run_student,
    source_as,
)
from lab_utils.gpu.bench import resolve_device

__all__ = [
    "q1", "q2", "q3", "q4", "q5", "q6", "q7",
    "AsyncDevice", "BROKEN_SNIPPET", "H200_RIDGE",
    "reference_time_ms", "reference_matmul_tflops", "reference_copy_gbps", "reference_replay_with_graph",
    "graph_unavailable", "grading_device",
]


def grading_device() -> str:
    """Where the code exercises run: ``"cuda"`` when torch can use a GPU, else ``"cpu"`` (the lab's own
    ``resolve_device("auto")``, so the check and the lab's measurements pick the same device)."""
    return resolve_device("auto")


def _chip(device: str) -> str:
    return "GPU" if device.startswith("cuda") else "CPU"


@contextlib.contextmanager
def _one_cpu_thread(device: str) -> Iterator[None]:
    # Two BLAS threads on a shared 2-core machine stall each other whenever one loses its core: one thread
    # makes the student's timing and the reference's comparable. The GPU is left alone.
    if device != "cpu":
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
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

    @property
    def alive(self) -> bool:
        """Whether the worker thread is still running."""
        return self._thread.is_alive()

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


BROKEN_SNIPPET = '''\
import time

def time_ms(fn, iters, warmup, sync):
    """Milliseconds per call of fn(). (Broken: what does it really measure?)"""
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1000 / iters
'''


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
    mm, label = (lambda: a @ b), f"{n}x{n} {str(dtype).removeprefix('torch.')} matmul on the {_chip(device)}"
    where = f"on a real {label}"
    mine: list[float] = []
    refs: list[float] = []
    with _one_cpu_thread(device):
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

# --- the instrumented timer handed to q2 and q3 -----------------------------------------------------------


def _rng_state(device: str) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.startswith("cuda"):
        states.append(torch.cuda.get_rng_state(device))
    return states


class _Timer:
    """The reference timer, as the student's function receives it: ``timer(fn) -> ms`` (median per call).

    It records what it saw: whether ``fn`` drew random numbers (it creates its inputs on every call), what
    ``fn`` returned, and the milliseconds it handed back.
    """

    def __init__(self, device: str, iters: int, warmup: int) -> None:
        self.device, self.iters, self.warmup = device, iters, warmup
        self.calls: list[dict[str, Any]] = []

    def __call__(self, fn: Any) -> float:
        if not callable(fn):
            raise Wrong(f"timer(...) takes the function to time, e.g. timer(lambda: a @ b); you passed a "
                        f"{type(fn).__name__} (the result of calling it?)")
        before = _rng_state(self.device)
        out = fn()
        drew = any(not torch.equal(x, y) for x, y in zip(before, _rng_state(self.device), strict=True))
        ms = timing.benchmark(fn, reps=self.iters, warmup=self.warmup, device=self.device).median_ms
        self.calls.append({"ms": ms, "random": drew, "out": out, "fn": fn})
        return ms


def _timed_call(timer: _Timer, what: str) -> dict[str, Any]:
    if not timer.calls:
        raise Wrong(f"your function never called timer(...): time {what} with it, e.g. ms = timer(lambda: ...)")
    last = timer.calls[-1]
    if last["random"]:
        raise Wrong("the function you timed draws random numbers: it creates its inputs (torch.randn) on every "
                    "call, so the timing includes allocation and random-number generation. Create the tensors "
                    f"once, before, and time only {what}.")
    return last


def _judge_rate(value: Any, timer: _Timer, expected_of: Callable[[float], float], slips: dict[float, str],
                unit: str, call: str) -> float:
    got = number(value, f"{call}'s result")
    candidates = [expected_of(c["ms"]) for c in timer.calls]  # the rate from any time the timer handed back
    if any(math.isclose(got, e, rel_tol=0.01) for e in candidates):
        return got
    expected = candidates[-1]
    ratio = got / expected
    slip = match_slip(ratio, slips, 0.02)
    if slip:
        raise Wrong(f"{call} returned {got:.4g} {unit}; from the {timer.calls[-1]['ms']:.4g} ms your timer "
                    f"measured it is {expected:.4g} {unit}: {slip}")
    raise Wrong(f"{call} returned {got:.4g} {unit}, {ratio:.3g}x what the {timer.calls[-1]['ms']:.4g} ms your timer "
                f"measured gives ({expected:.4g} {unit}).")


def _ratio_to_reference(timed: dict[str, Any], reference: Callable[[], Any], device: str, reps: int,
                        band: tuple[float, float]) -> float:
    """Time of what the student timed / time of the reference operation, fastest against fastest."""
    def ms(fn: Callable[[], Any]) -> Callable[[], float]:
        return lambda: timing.benchmark(fn, reps=reps, warmup=1, device=device).median_ms

    return fastest_ratio(ms(timed["fn"]), ms(reference), band, first=timed["ms"])


# --- q2: TFLOP/s from your timing ---------------------------------------------------------------------------


def reference_matmul_tflops(n: int, device: str, timer: Callable[[Callable[[], Any]], float]) -> float:
    """TFLOP/s of an n×n×n float32 matmul: inputs made once, only ``a @ b`` timed, 2·n³ FLOPs."""
    a = torch.randn(n, n, device=device)  # inputs made once: random, never zeros
    b = torch.randn(n, n, device=device)
    ms = timer(lambda: a @ b)  # only the matmul is timed
    return 2 * n**3 / (ms * 1e-3) / 1e12  # 2·n³ FLOPs per matmul


def _grade_matmul_tflops(fn: Any) -> str:
    device = grading_device()
    n = 4096 if device == "cuda" else 256
    call = f"matmul_tflops({n}, {device!r}, timer)"
    timer = _Timer(device, iters=5, warmup=2)
    with _one_cpu_thread(device):
        got = run_student(fn, n, device, timer, call=call, timeout_s=120)
        last = _timed_call(timer, "a @ b")
        out = last["out"]
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (n, n):
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise Wrong(f"the function you timed returned {shape}, not the {n}x{n} product: time lambda: a @ b")
        first = out.reshape(-1)[0]
        if bool(torch.all(out == first)):  # zeros or ones in, a constant out: no data to multiply
            what = "all zeros" if float(first) == 0 else f"{float(first):g} in every element"
            raise Wrong(f"the product you timed is {what}: inputs from torch.zeros, torch.ones or torch.full (or no "
                        "matmul at all) measure no real work. A GPU multiplies zeros faster than real data (they draw "
                        "less power: 894 against 788 TFLOP/s bf16 on an H200), so the rate would flatter it. Make "
                        "the inputs with torch.randn, once, and time lambda: a @ b.")
        a = torch.randn(n, n, device=device)
        b = torch.randn(n, n, device=device)
        ratio = _ratio_to_reference(last, lambda: a @ b, device, reps=5, band=(0.2, 5))
    if ratio < 0.2:
        raise Wrong(f"what you timed ran {1 / ratio:.0f}x faster than a {n}x{n}x{n} float32 matmul here: is it "
                    "a * b (elementwise: n² multiplies) rather than a @ b, or inputs smaller or in lower precision "
                    "than n x n float32 (torch.randn's default)?")
    if ratio > 5:
        raise Wrong(f"what you timed ran {ratio:.0f}x slower than a {n}x{n}x{n} float32 matmul here: there is "
                    "more than the matmul in the timed function (a conversion, a copy to the CPU, .item()?)")
    slips = {
        0.5: "factor 2 missing: an n×n×n matmul does n³ multiply-adds, each 2 FLOPs (a multiply and an add): "
             "2·n³ FLOPs.",
        1e3: "that is GFLOP/s (1e9): divide FLOP/s by 1e12 for TFLOP/s.",
        1e12: "that is FLOP/s: divide by 1e12 for TFLOP/s.",
        1e-3: "milliseconds used as seconds: the timer returns ms, so seconds = ms / 1000 (or * 1e-3).",
        1 / n: "the FLOP count is 2·n² (one row times one column?); a matmul is 2·n³.",
        0.5 / n: "the FLOP count is n²; an n×n×n matmul is 2·n³ FLOPs.",
    }
    tflops = _judge_rate(got, timer, lambda ms: 2 * n**3 / (ms * 1e-3) / 1e12, slips, "TFLOP/s", call)
    return f"{tflops:.3g} TFLOP/s from {last['ms']:.3g} ms for a {n}x{n}x{n} float32 matmul on the {_chip(device)}."


q2 = CodeExercise(
    name="01.2 TFLOP/s from your timing", var="matmul_tflops", grade=_grade_matmul_tflops,
    references=References("make the inputs, time a @ b with `timer` and count the FLOPs yourself",
                           reference_matmul_tflops),
    signature="matmul_tflops(n, device, timer) -> float",
    hints=[
        "Make two random n×n float32 tensors on `device` first, outside the timing; then give `timer` a function "
        "that does only the multiply (a lambda around a @ b). It returns ms per call.",
        "C[m,n] = A[m,k]·B[k,n] is m·n·k multiply-adds, and a multiply-add is 2 FLOPs: 2·n³ FLOPs for n×n×n.",
        "Units: ms to seconds (x 1e-3); FLOPs over seconds is FLOP/s, and 1 TFLOP/s is 1e12 FLOP/s.",
    ],
    solution_text=source_as(reference_matmul_tflops, "matmul_tflops(n, device, timer)"),
)

# --- q3: device-to-device copy bandwidth -------------------------------------------------------------------


def reference_copy_gbps(nbytes: int, device: str, timer: Callable[[Callable[[], Any]], float]) -> float:
    """GB/s of copying ``nbytes`` on ``device`` (dst.copy_(src)), counting the read and the write: 2·nbytes."""
    src = torch.randn(nbytes // 4, device=device)  # float32: 4 bytes per element
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9  # read + write: 2 x nbytes moved


def _grade_copy_gbps(fn: Any) -> str:
    device = grading_device()
    nbytes = 2**30 if device == "cuda" else 32 * 2**20  # well above the caches either way
    label = f"{nbytes // 2**20} MiB"
    call = f"copy_gbps({nbytes}, {device!r}, timer)"
    timer = _Timer(device, iters=3, warmup=1)
    with _one_cpu_thread(device):
        got = run_student(fn, nbytes, device, timer, call=call, timeout_s=120)
        last = _timed_call(timer, "dst.copy_(src)")
        out = last["out"]
        if isinstance(out, torch.Tensor):
            size = out.numel() * out.element_size()
            if size == 4 * nbytes:
                raise Wrong(f"the tensor you copied holds {size} bytes, 4x nbytes: torch.empty(nbytes) of float32 "
                            "has 4 bytes per element. Use nbytes // 4 float32 elements (or dtype=torch.uint8).")
            if size != nbytes:
                raise Wrong(f"the tensor you copied holds {size} bytes, not nbytes = {nbytes}: size the buffers so "
                            "that they hold nbytes bytes (nbytes // 4 float32 elements)")
        src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(3)
        dst = torch.empty_like(src)
        ratio = _ratio_to_reference(last, lambda: dst.copy_(src), device, reps=3, band=(1 / 3, 3))
    if ratio > 3:
        raise Wrong(f"what you timed took {ratio:.1f}x as long as copying {label} here: does the timed function "
                    "allocate (clone(), torch.empty, torch.randn) or copy more than nbytes?")
    if ratio < 1 / 3:
        raise Wrong(f"what you timed took {ratio:.2f}x the time of copying {label} here: are the buffers smaller "
                    "than nbytes (nbytes is bytes; a float32 element is 4 of them)?")
    gib = 2**30 / 1e9
    slips = {
        0.5: "a copy moves every byte twice: it reads nbytes from src and writes nbytes to dst, so 2 × nbytes "
             "cross the memory bus. You counted nbytes once (the factor-of-2 mistake).",
        1 / gib: "that is GiB/s (2**30 bytes); bandwidth is quoted in GB/s, 1e9 bytes.",
        0.5 / gib: "GiB/s and the bytes counted once: a copy moves 2 × nbytes, and GB/s means 1e9 bytes per second.",
        1e3: "that is MB/s (1e6): divide bytes per second by 1e9 for GB/s.",
        1e-3: "milliseconds used as seconds: the timer returns ms, so seconds = ms / 1000.",
        2.0: "counted 4 × nbytes: a copy reads nbytes and writes nbytes, 2 × nbytes in all.",
    }
    gbps = _judge_rate(got, timer, lambda ms: 2 * nbytes / (ms * 1e-3) / 1e9, slips, "GB/s", call)
    return f"{gbps:.4g} GB/s from {last['ms']:.3g} ms for {label} on the {_chip(device)} (read + write counted)."


q3 = CodeExercise(
    name="01.3 copy bandwidth", var="copy_gbps", grade=_grade_copy_gbps,
    references=References("make the buffers, time the copy with `timer` and count the bytes yourself",
                           reference_copy_gbps),
    signature="copy_gbps(nbytes, device, timer) -> float",
    hints=[
        "Make src (random) and dst (empty, same shape) once, each holding nbytes bytes: nbytes // 4 float32 "
        "elements. Time only the copy: give `timer` a function that calls dst.copy_(src) (ms per call).",
        "A copy reads every byte of src and writes every byte of dst: it moves 2 × nbytes through memory.",
        "Units: ms to seconds (x 1e-3); bytes over seconds is bytes/s, and 1 GB/s is 1e9 bytes/s, as bandwidth "
        "is quoted.",
    ],
    solution_text=source_as(reference_copy_gbps, "copy_gbps(nbytes, device, timer)"),
)

# --- q4/q5/q6: arithmetic intensity, the ridge, which roof ---------------------------------------------

_SAXPY_INTENSITY = 2 / 12  # FLOP/byte: a multiply and an add per element; read x, read y, write y (fp32)
H200_RIDGE = specs.ridge_point(specs.H200_SXM.bf16_tflops, specs.H200_SXM.hbm_tbps)  # FLOP/byte, ~206 (datasheet)

q4 = Exercise(
    name="01.4 arithmetic intensity of saxpy", var="saxpy_intensity",
    grade=close_to(
        _SAXPY_INTENSITY, rel=0.05, reveal=False,
        why="Intensity = FLOPs / bytes moved to and from memory, per element of y = a*x + y in fp32.",
        slips={
            1.5: "the write counts too: y is read and written back, so 3 fp32 values move per element.",
            0.5: "half: a*x + y is 2 FLOPs per element (a multiply and an add), and fp32 is 4 bytes, not 8.",
            4.0: "count bytes, not elements: each fp32 value is 4 bytes.",
            36.0: "inverted: intensity is FLOPs per byte, not bytes per FLOP.",
        },
    ),
    hints=[
        "Per element: how many FLOPs does a*x + y take, and how many values move between memory and "
        "the chip (reads and writes)?",
        "2 FLOPs (multiply, add). x and y are read, y is written: 3 values of fp32, 4 bytes each.",
        "Intensity is FLOPs over bytes, both per element: the FLOPs of one element over the bytes it moves.",
    ],
    solution_text="saxpy_intensity = 2 / (3 * 4)   # 0.167 FLOP/byte: 2 FLOPs; read x, read y, write y, 4 bytes each",
)

q5 = Exercise(
    name="01.5 roofline ridge of the H200", var="ridge_flop_per_byte",
    grade=close_to(
        H200_RIDGE, rel=0.02, reveal=False,
        why="Ridge = peak FLOP/s / bandwidth in bytes/s, for dense bf16 on the H200 datasheet.",
        slips={
            **dict.fromkeys((1e-3, 1e3), "a units slip (factor 1000): TFLOP/s is 1e12 FLOP/s and TB/s is 1e12 "
                                         "bytes/s, so divide 989 by 4.8, or 989e12 by 4.8e12."),
            1 / H200_RIDGE**2: "inverted: the ridge is FLOP/s divided by bytes/s (FLOP per byte).",
            0.5: "half: that is the TF32 peak (494.5 TFLOP/s); the question asks for dense bf16 (989).",
            2.0: "double: 1979 TFLOP/s is the sparse bf16 (or dense FP8) figure; use dense bf16 (989).",
            67 / 989: "that is the FP32 ridge without tensor cores (67 TFLOP/s); the question asks for bf16.",
        },
    ),
    hints=[
        "The ridge point is where a roofline's slanted (bandwidth) and flat (compute) parts meet: "
        "peak FLOP/s / bandwidth in bytes/s.",
        "H200 datasheet: 989 TFLOP/s dense bf16 (tensor cores), 4.8 TB/s HBM3e.",
        "Divide the two in base units (FLOP/s over bytes/s: tera is 1e12 for both); the result is in FLOP/byte.",
    ],
    solution_text="ridge_flop_per_byte = 989e12 / 4.8e12   # ~206 FLOP/byte: ops below it are memory-bound",
)


# Whole answers that mean the same as each choice (a roofline's two roofs go by several names).
_BOUND_SYNONYMS = {
    "memory": ["memory-bound", "memory bandwidth", "memory-bandwidth-bound", "bandwidth", "bandwidth-bound",
               "HBM-bound", "memory limited", "bandwidth limited"],
    "compute": ["compute-bound", "math", "math-bound", "FLOP-bound", "FLOPs-bound", "compute limited",
                "arithmetic-bound"],
}


q6 = Exercise(
    name="01.6 saxpy: memory- or compute-bound", var="saxpy_bound",
    grade=one_of("memory", ["memory", "compute"], synonyms=_BOUND_SYNONYMS,
                 why=f"saxpy's ~0.17 FLOP/byte is far below the H200's ridge point (~{H200_RIDGE:.0f} FLOP/byte): "
                     "the chip waits on memory, not on arithmetic."),
    hints=[
        "Compare the op's arithmetic intensity (01.4) with the GPU's ridge point: peak FLOP/s divided by "
        "memory bandwidth.",
        f"The H200's ridge is about {H200_RIDGE:.0f} FLOP/byte; below it, the op cannot use the arithmetic "
        "the chip has.",
        "0.17 FLOP/byte is more than a thousand times below the ridge: answer \"memory\" or \"compute\".",
    ],
    solution_text='saxpy_bound = "memory"   # 0.17 FLOP/byte << ~206 FLOP/byte: time = bytes / bandwidth',
)

# --- q7: a CUDA graph ------------------------------------------------------------------------------------


def graph_unavailable() -> str | None:
    """Why CUDA graphs cannot run here (with the H200 reference's numbers), or None on a CUDA GPU."""
    if torch.cuda.is_available():
        return None
    ref = specs.h200_measured("01")
    eager, graph = ref.get("launch_eager"), ref.get("launch_cuda_graph")
    seen = (f" On the H200 reference run, 1000 small kernels cost {eager:.2f} µs each launched one by one and "
            f"{graph:.2f} µs each replayed from a graph ({eager / graph:.1f}x)." if eager and graph else "")
    why = "this torch is a CPU-only build" if torch.version.cuda is None else "torch sees no CUDA GPU"
    return (f"CUDA graphs record and replay CUDA kernels, so they need an NVIDIA GPU; {why} (the CPU tier), "
            f"so this check cannot run here.{seen}")


def reference_replay_with_graph(chain: Callable[[torch.Tensor], torch.Tensor], static_x: torch.Tensor,
                                xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``[chain(x) for x in xs]``, computed by capturing ``chain(static_x)`` once in a CUDA graph and replaying it."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            chain(static_x)  # warm-up on a side stream: lazy initialisation stays out of the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = chain(static_x)  # recorded, not run
    outs = []
    for x in xs:
        static_x.copy_(x)  # new data into the captured input's memory
        g.replay()  # every kernel of the chain, one launch
        outs.append(static_y.clone())  # the next replay overwrites static_y
    return outs


_GRAPH_KERNELS, _GRAPH_INPUTS, _GRAPH_NUMEL = 100, 32, 4096


def _grade_replay_with_graph(fn: Any) -> str:
    # Runs only where graph_unavailable() says None: q7's applicable= marks the check not applicable before grading.
    counts = {"captured": 0, "eager": 0}

    def body(x: torch.Tensor) -> torch.Tensor:
        y = x
        for _ in range(_GRAPH_KERNELS):  # 2 small kernels each: launch-bound when run eagerly
            y = y * 0.999 + 0.001
        return y

    def chain(x: torch.Tensor) -> torch.Tensor:
        counts["captured" if torch.cuda.is_current_stream_capturing() else "eager"] += 1
        return body(x)

    gen = torch.Generator(device="cuda").manual_seed(1)
    static_x = torch.randn(_GRAPH_NUMEL, device="cuda", generator=gen)
    captured_input = body(static_x.clone())
    xs = [torch.randn(_GRAPH_NUMEL, device="cuda", generator=gen) for _ in range(_GRAPH_INPUTS)]
    want = [body(x) for x in xs]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    got = run_student(fn, chain, static_x, xs, call="replay_with_graph(chain, static_x, xs)", timeout_s=120)
    torch.cuda.synchronize()
    student_ms = (time.perf_counter() - t0) * 1e3
    got = items(got, len(xs), "replay_with_graph", f"a list of {len(xs)} tensors, chain(x) for each x in xs, in order")
    if not all(isinstance(t, torch.Tensor) for t in got):
        raise Wrong(f"replay_with_graph returned a list of {len(xs)}, not all tensors: chain(x) for each x in xs")
    if counts["captured"] == 0:
        raise Wrong("chain was never captured into a graph: create g = torch.cuda.CUDAGraph() and run chain(static_x) "
                    "inside `with torch.cuda.graph(g):`, then g.replay() for each input")
    if counts["captured"] > 1:
        raise Wrong(f"chain was captured {counts['captured']} times: capture it once, then replay that graph for "
                    "every input (capturing costs as much as running eagerly)")
    if counts["eager"] >= len(xs):
        raise Wrong(f"chain ran eagerly {counts['eager']} times for {len(xs)} inputs: the outputs must come from "
                    "g.replay(), not from calling chain(x)")
    same_memory = len({t.data_ptr() for t in got}) == 1
    for i, (t, w) in enumerate(zip(got, want, strict=True)):
        if t.shape == w.shape and torch.allclose(t, w, rtol=1e-5, atol=1e-6):
            continue
        if all(torch.allclose(o, captured_input, rtol=1e-5, atol=1e-6) for o in got):
            raise Wrong("every output is chain() of the tensor static_x held at capture time: a graph replays on "
                        "the memory it captured, so copy each input into it (static_x.copy_(x)) before g.replay()")
        if same_memory or all(torch.allclose(o, want[-1], rtol=1e-5, atol=1e-6) for o in got):
            raise Wrong("all your outputs are the last input's result: each replay writes into the same output "
                        "tensor, so keep a copy after each replay (outs.append(static_y.clone()))")
        err = float((t.float() - w.float()).abs().max()) if t.shape == w.shape else math.inf
        raise Wrong(f"output {i} differs from chain(xs[{i}]) (largest difference {err:.3g}, shape "
                    f"{tuple(t.shape)})")
    return f"{len(xs)} inputs through one captured graph of {2 * _GRAPH_KERNELS} kernels in {student_ms:.1f} ms."


q7 = CodeExercise(
    name="01.7 capture and replay a CUDA graph", var="replay_with_graph", grade=_grade_replay_with_graph,
    references=References("capture the chain in a CUDA graph and replay it yourself", reference_replay_with_graph),
    signature="replay_with_graph(chain, static_x, xs) -> list[Tensor]", applicable=graph_unavailable,
    hints=[
        "A graph records the kernels of one call, on fixed memory: capture chain(static_x) once, inside "
        "`with torch.cuda.graph(g):` (g = torch.cuda.CUDAGraph()); keep what it returns (static_y).",
        "Replaying reads static_x's memory and writes static_y's: for each x, static_x.copy_(x), then g.replay(), "
        "then keep static_y.clone() (the next replay overwrites it).",
        "Warm up first, on a side stream, so lazy initialisation is not captured: a torch.cuda.Stream() that waits "
        "for the current stream, chain(static_x) a few times inside `with torch.cuda.stream(...)`, then the current "
        "stream waits for the side stream (wait_stream both ways).",
    ],
    solution_text=source_as(reference_replay_with_graph, "replay_with_graph(chain, static_x, xs)"),
)
