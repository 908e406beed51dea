"""Lab 01 exercises: CUDA and cuBLAS timing.

``AsyncDevice`` simulates the one property of a GPU that timing code must respect: a launch returns
before the work is done. It is real concurrency (a worker thread), not a printed pretend value, so a
student's timing function is judged on what it actually measures, on any machine.
"""

from __future__ import annotations

import queue
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from lab_utils.exercises.framework import Exercise, Wrong, close_to, number, one_of

__all__ = [
    "q1", "q2", "q3", "q4", "q5",
    "AsyncDevice", "BROKEN_SNIPPET", "reference_time_ms", "H200_RIDGE",
]

# --- q1: FLOPs of a matmul ----------------------------------------------------------------------------

M = N = K = 8192
_MATMUL_FLOPS = 2 * M * N * K  # 1.0995e12: each of m*n outputs needs k multiply-adds of 2 FLOPs

q1 = Exercise(
    name="01.1 FLOPs of an 8192^3 matmul",
    var="matmul_flops",
    grade=close_to(
        _MATMUL_FLOPS,
        rel=0.01,
        reveal=False,
        why="Count the operations for C[m,n] = A[m,k] @ B[k,n] with m = n = k = 8192.",
        slips={
            0.5: "factor 2 missing: m·n·k counts multiply-adds, and each is 2 FLOPs (a multiply and an add).",
            1e-12: "that is in TFLOP; give the count of FLOPs (1 TFLOP = 1e12 FLOPs).",
            1e-9: "that is in GFLOP; give the count of FLOPs (1 GFLOP = 1e9 FLOPs).",
            1 / K: "k is missing: each of the m·n outputs is a dot product of length k.",
        },
    ),
    hints=[
        "C has m·n elements; each is a dot product of a row of A and a column of B, of length k.",
        "A dot product of length k takes k multiplies and k adds (k multiply-adds).",
        "FLOPs = 2·m·n·k; with m = n = k = 8192, that is about 1.1e12.",
    ],
    solution_text=(
        "m = n = k = 8192\n"
        "matmul_flops = 2 * m * n * k   # 1.0995e12 FLOPs; lab_utils.timing.matmul_flops(m, n, k) agrees"
    ),
)

# --- q2: repair a broken timing snippet ---------------------------------------------------------------


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

def time_ms(run, sync, reps):
    """Milliseconds per call of run(). (Broken: what does it really measure?)"""
    t0 = time.perf_counter()
    for _ in range(reps):
        run()
    return (time.perf_counter() - t0) * 1000 / reps
'''


def reference_time_ms(run: Callable[[], Any], sync: Callable[[], Any], reps: int, warmup: int = 1) -> float:
    """Milliseconds per call of ``run()``, where ``run`` only launches work and ``sync`` waits for it.

    Warm-up calls absorb one-time costs (lazy initialisation, caches); synchronizing before starting
    and before stopping the host clock makes it measure the work, not the launches.
    """
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    for _ in range(warmup):
        run()
    sync()  # the warm-up must be finished before the clock starts
    t0 = time.perf_counter()
    for _ in range(reps):
        run()
    sync()  # wait for the work itself, not just its launches
    return (time.perf_counter() - t0) * 1e3 / reps


_WORK_S = 0.02  # per call: long against thread wake-ups on a loaded machine, short for a quick check
_INIT_S = 0.15  # one-time cost: at 5 reps it adds 30 ms per call, far outside the tolerance
_REPS = 5
_TOL = 0.3  # relative


def _grade_time_ms(fn: Any) -> None:
    if not callable(fn):
        raise Wrong(f"expected a function time_ms(run, sync, reps) -> float, got a {type(fn).__name__}")
    with AsyncDevice(init_s=_INIT_S) as dev:
        try:
            got = fn(lambda: dev.launch(_WORK_S), dev.synchronize, _REPS)
        except Exception as err:
            raise Wrong(f"time_ms(run, sync, reps={_REPS}) raised {type(err).__name__}: {err}") from None
        queued = dev.pending  # work still running when the function returned: it never synchronized
        # Judge against how long the work really took here (sleep overshoots on a loaded machine).
        ran_s = list(dev.work_s)
        expected_ms = 1e3 * (statistics.median(ran_s) if ran_s else _WORK_S)
    ms = number(got, "time_ms's result")
    ratio = ms / expected_ms
    if 1 - _TOL <= ratio <= 1 + _TOL:
        return
    if ratio < 1 - _TOL:
        if not queued and 1 - _TOL <= ratio * 1e3 <= 3:
            raise Wrong("that looks like seconds per call; return milliseconds (multiply by 1000)")
        still = f" ({queued} launches were still running when your function returned)" if queued else ""
        raise Wrong(f"{ms:.3g} ms is far less than the work takes: you timed the launch, not the work"
                    f"{still}. Call sync() to wait for the work before reading the clock.")
    if abs(ratio / _REPS - 1) <= _TOL:
        raise Wrong(f"{ms:.3g} ms looks like the total of all {_REPS} calls; return the time per call "
                    "(divide by reps)")
    raise Wrong(f"{ms:.3g} ms is far more than one call's work: your timed region includes the device's "
                "one-time initialisation. Warm up first: one untimed run(), then sync(), then start the "
                "clock.")


q2 = Exercise(
    name="01.2 repair the timing snippet",
    var="time_ms",
    grade=_grade_time_ms,
    hints=[
        "Run BROKEN_SNIPPET against AsyncDevice and compare with the work you launched: run() returns "
        "as soon as the work is queued, long before it is done.",
        "Two fixes: call sync() before reading the clock at the end, so you measure the work; and make "
        "one untimed call first (then sync()), so one-time initialisation stays out of the timing.",
        "warm-up run(); sync(); t0 = perf_counter(); reps x run(); sync(); return (perf_counter() - t0) "
        "* 1000 / reps.",
    ],
    solution_text=(
        "import time\n\n"
        "def time_ms(run, sync, reps):\n"
        '    """Milliseconds per call of run(); run() only launches work, sync() waits for it."""\n'
        "    run()                      # warm-up: pays lazy initialisation outside the timing\n"
        "    sync()                     # ...and is finished before the clock starts\n"
        "    t0 = time.perf_counter()\n"
        "    for _ in range(reps):\n"
        "        run()\n"
        "    sync()                     # wait for the work, not just the launches\n"
        "    return (time.perf_counter() - t0) * 1000 / reps\n"
        "# On a GPU: torch.cuda.synchronize() as sync, or CUDA events (lab_utils.timing.benchmark)."
    ),
)

# --- q3/q4: arithmetic intensity of saxpy ---------------------------------------------------------

_SAXPY_INTENSITY = 2 / 12  # FLOP/byte: a multiply and an add per element; read x, read y, write y (fp32)
H200_RIDGE = 989e12 / 4.8e12  # FLOP/byte: dense bf16 peak / HBM3e bandwidth (datasheet), ~206

q3 = Exercise(
    name="01.3 arithmetic intensity of saxpy",
    var="saxpy_intensity",
    grade=close_to(
        _SAXPY_INTENSITY,
        rel=0.05,
        reveal=False,
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
        "saxpy_intensity = 2 / (3 * 4) FLOP/byte.",
    ],
    solution_text=(
        "saxpy_intensity = 2 / (3 * 4)   # 0.167 FLOP/byte: 2 FLOPs; read x, read y, write y, 4 bytes each"
    ),
)


def _grade_bound(value: Any) -> None:
    # "memory-bound" and "memory bound" mean the same as "memory".
    if isinstance(value, str):
        value = value.strip().lower().removesuffix("bound").strip(" -_")
    one_of("memory", ["memory", "compute"],
           why=f"saxpy's ~0.17 FLOP/byte is far below the H200's ridge point (~{H200_RIDGE:.0f} FLOP/byte): "
               "the chip waits on memory, not on arithmetic.")(value)


q4 = Exercise(
    name="01.4 saxpy: memory- or compute-bound",
    var="saxpy_bound",
    grade=_grade_bound,
    hints=[
        "Compare the op's arithmetic intensity (q3) with the GPU's ridge point: peak FLOP/s divided by "
        "memory bandwidth.",
        f"The H200's ridge is about {H200_RIDGE:.0f} FLOP/byte; below it, the op cannot use the arithmetic "
        "the chip has.",
        "0.17 FLOP/byte is more than a thousand times below the ridge: answer \"memory\" or \"compute\".",
    ],
    solution_text=(
        'saxpy_bound = "memory"   # 0.17 FLOP/byte << ~206 FLOP/byte: time = bytes / bandwidth'
    ),
)

# --- q5: the H200's ridge point -------------------------------------------------------------------

q5 = Exercise(
    name="01.5 roofline ridge of the H200",
    var="ridge_flop_per_byte",
    grade=close_to(
        H200_RIDGE,
        rel=0.02,
        reveal=False,
        why="Ridge = peak FLOP/s / bandwidth in bytes/s, for dense bf16 on the H200 datasheet.",
        slips={
            1e-3: "a units slip (factor 1000): TFLOP/s is 1e12 FLOP/s and TB/s is 1e12 bytes/s, so divide "
                  "989 by 4.8, or 989e12 by 4.8e12.",
            1e3: "a units slip (factor 1000): TFLOP/s is 1e12 FLOP/s and TB/s is 1e12 bytes/s, so divide "
                 "989 by 4.8, or 989e12 by 4.8e12.",
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
        "ridge_flop_per_byte = 989e12 / 4.8e12.",
    ],
    solution_text=(
        "ridge_flop_per_byte = 989e12 / 4.8e12   # ~206 FLOP/byte: ops below it are memory-bound"
    ),
)
