"""One timing helper for every lab: warm-up, repetitions, CUDA events on a GPU, statistics.

GPU work is asynchronous: a host clock read right after a launch measures the launch, not the work.
On a CUDA device each repetition is bracketed by CUDA events and the stream is synchronized once at the
end; on the CPU ``time.perf_counter`` brackets each repetition. All times are milliseconds."""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import platform
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lab_utils.args import check_int

# 256 MiB is larger than the L2 of every current data-centre GPU (H100/H200: 50 MiB, B200: 126 MiB).
L2_FLUSH_BYTES = 256 * 2**20

# Environment variables that change what a measurement means; recorded in every header.
_ENV_PREFIXES = ("CUDA_", "NCCL_", "TORCH_", "NVIDIA_", "CUBLAS", "CUBLASLT", "OMP_", "MKL_", "OPENBLAS_")


@dataclass
class Timing:
    """Per-repetition times of one benchmark, in milliseconds, with summary statistics."""

    name: str
    times_ms: np.ndarray
    device: str
    warmup: int
    flush_l2: bool
    header: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def reps(self) -> int:
        return int(self.times_ms.size)

    @property
    def median_ms(self) -> float:
        return float(np.median(self.times_ms))

    @property
    def mean_ms(self) -> float:
        return float(np.mean(self.times_ms))

    @property
    def min_ms(self) -> float:
        return float(np.min(self.times_ms))

    @property
    def p10_ms(self) -> float:
        return float(np.percentile(self.times_ms, 10))

    @property
    def p90_ms(self) -> float:
        return float(np.percentile(self.times_ms, 90))

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: 0.05 means the middle 80 % of repetitions lie within 5 % of the median."""
        return (self.p90_ms - self.p10_ms) / self.median_ms if self.median_ms > 0 else float("nan")

    def tflops(self, flops: float) -> float:
        """Throughput in TFLOP/s (1e12) for ``flops`` floating-point operations per repetition, at the median."""
        return flops / (self.median_ms * 1e-3) / 1e12

    def gbps(self, nbytes: float) -> float:
        """Bandwidth in GB/s (1e9 bytes) for ``nbytes`` moved per repetition, at the median."""
        return nbytes / (self.median_ms * 1e-3) / 1e9

    def summary(self) -> dict[str, Any]:
        """Plain values for a table row."""
        return {"name": self.name, "device": self.device, "reps": self.reps, "median_ms": self.median_ms,
                "mean_ms": self.mean_ms, "min_ms": self.min_ms, "p10_ms": self.p10_ms, "p90_ms": self.p90_ms,
                "spread": self.spread}

    def __str__(self) -> str:
        return (f"{self.name}: median {self.median_ms:.4g} ms (p10 {self.p10_ms:.4g}, p90 {self.p90_ms:.4g}, "
                f"min {self.min_ms:.4g}; {self.reps} reps on {self.device})")


def matmul_flops(m: int, n: int, k: int) -> int:
    """Floating-point operations of C[m,n] = A[m,k] @ B[k,n]: one multiply and one add per term, 2·m·n·k."""
    return 2 * m * n * k


def matmul_bytes(m: int, n: int, k: int, itemsize: int, out_itemsize: int | None = None) -> int:
    """Fewest bytes a matmul moves through memory: read A and B once, write C once."""
    out_itemsize = itemsize if out_itemsize is None else out_itemsize
    return (m * k + k * n) * itemsize + m * n * out_itemsize


def copy_bytes(nbytes: int) -> int:
    """Bytes a copy of ``nbytes`` moves through memory, counting the read and the write (2·nbytes)."""
    return 2 * nbytes


def _resolve_device(device: Any) -> str:
    if device is None or device == "auto":
        try:
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            return "cpu"
    name = str(device)
    if not (name == "cpu" or name.startswith("cuda")):
        raise ValueError(f"benchmark(device={device!r}): use 'cpu', 'cuda', 'cuda:N' or 'auto'")
    return name


def benchmark(fn: Callable[[], Any], *, reps: int = 20, warmup: int = 3, device: Any = "auto", flush_l2: bool = False,
              flush_bytes: int = L2_FLUSH_BYTES, name: str | None = None) -> Timing:
    """Time ``fn()`` ``reps`` times after ``warmup`` untimed calls; returns per-repetition ms.

    On CUDA: a start and an end event around each call, one synchronize after the loop, so the
    host never waits between repetitions. With ``flush_l2`` a buffer of ``flush_bytes`` is
    overwritten before each repetition, outside the timed region, so every repetition starts
    with a cold cache (kernel-level numbers). On the CPU the same flush evicts the last-level cache."""
    if not callable(fn):
        raise TypeError(f"benchmark(fn=...): fn must be callable, got {type(fn).__name__} {fn!r}; "
                        "pass the work itself, for example benchmark(lambda: a @ b)")
    check_int(reps, "reps", "benchmark", what="the number of timed runs")
    check_int(warmup, "warmup", "benchmark", minimum=0, what="untimed runs first")
    dev = _resolve_device(device)
    label = name or getattr(fn, "__name__", "fn")
    if dev.startswith("cuda"):
        times = _time_cuda(fn, reps, warmup, dev, flush_l2, flush_bytes)
    else:
        times = _time_cpu(fn, reps, warmup, flush_l2, flush_bytes)
    return Timing(label, times, dev, warmup, flush_l2, run_header(dev))


def _time_cuda(fn: Callable[[], Any], reps: int, warmup: int, dev: str, flush: bool, nbytes: int) -> np.ndarray:
    import torch

    with torch.cuda.device(torch.device(dev)):
        buf = torch.empty(nbytes // 4, dtype=torch.float32, device=dev) if flush else None
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            if buf is not None:
                buf.fill_(float(i))  # a write, so the lines are evicted rather than left clean
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return np.array([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)], dtype=np.float64)


def _time_cpu(fn: Callable[[], Any], reps: int, warmup: int, flush: bool, nbytes: int) -> np.ndarray:
    buf = np.empty(nbytes // 8, dtype=np.float64) if flush else None
    for _ in range(warmup):
        fn()
    times = np.empty(reps, dtype=np.float64)
    for i in range(reps):
        if buf is not None:
            buf.fill(float(i))
        t0 = time.perf_counter()
        fn()
        times[i] = (time.perf_counter() - t0) * 1e3
    return times


def run_header(device: str = "auto") -> dict[str, Any]:
    """What a number depends on: device, driver, library versions, threads and relevant environment."""
    dev = _resolve_device(device)
    head: dict[str, Any] = {"time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": platform.node(),
                            "python": platform.python_version(), "cpu": cpu_model(), "cpu_threads": os.cpu_count(),
                            "device": "cpu", "numpy": np.__version__}
    try:
        import torch

        head["torch"] = torch.__version__
        head["torch_threads"] = torch.get_num_threads()
        head["cuda_runtime"] = torch.version.cuda
        if dev.startswith("cuda"):
            idx = torch.device(dev).index or 0
            head["device"] = torch.cuda.get_device_name(idx)
            head["compute_capability"] = "{}.{}".format(*torch.cuda.get_device_capability(idx))
            head["cudnn"] = torch.backends.cudnn.version()
            head["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            head["driver"] = _driver_version()
    except ImportError:
        head["torch"] = None
    head["env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)}
    return head


@functools.lru_cache(maxsize=1)  # one NVML open per process, not one per measurement
def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else v
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML here: the header says so rather than failing the measurement
        return None


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux)."""
    # /proc, not psutil: psutil does not give the CPU's model name
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers and Slurm narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def host_ms(fn: Callable[[], Any], dev: str, reps: int, wait: bool) -> float:
    """Median host-clock ms of ``fn()`` over ``reps``, each started on an empty queue; ``wait``: synchronize
    before reading the clock (without it a GPU run times the launch only)."""
    times = np.empty(reps)
    for i in range(reps):
        sync(dev)  # outside the timed region
        t0 = time.perf_counter()
        fn()
        if wait:
            sync(dev)
        times[i] = (time.perf_counter() - t0) * 1e3
    sync(dev)
    return float(np.median(times))


def sync(device: str) -> None:
    """Wait for the device's queued work: ``torch.cuda.synchronize`` on a CUDA device, nothing on the CPU."""
    if str(device).startswith("cuda"):
        import torch  # only CUDA devices get here, and they imply torch

        torch.cuda.synchronize(device)


def cuda_graph(fn: Callable[[], Any], warmup: int = 3) -> tuple[Any, Any]:
    """``fn`` captured in a ``torch.cuda.CUDAGraph`` after ``warmup`` calls on a side stream, as the torch docs require
    (lazy initialisation must not happen during capture): ``(graph, what the captured call returned)``. The capture
    records ``fn``'s kernels, it does not run them; ``graph.replay()`` does, on the memory of the capture."""
    import torch  # only CUDA devices get here, and they imply torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


class Ticks:
    """A ``progress`` hook driven by events instead of a loop: ``step()`` advances it by one, ``close()`` ends it.

    The hook wraps an iterable and counts an item when its loop comes back for the next one; so the bar is primed
    with one item, each ``step()`` takes the next, and ``close()`` ends the loop. ``progress`` None: no display."""

    def __init__(self, progress: Callable[..., Iterable[Any]] | None, total: int | None, desc: str):
        self._it: Iterator[Any] | None = None
        if progress is not None:
            self._it = iter(progress(itertools.count(), total=total, desc=desc))  # ends on close(), not on a count
            next(self._it, None)

    def step(self, _what: str = "") -> None:
        if self._it is not None:
            next(self._it, None)

    def close(self) -> None:
        it, self._it = self._it, None
        if it is not None and hasattr(it, "close"):
            it.close()  # a generator's: tqdm's bar ends, the headless hook prints its line
