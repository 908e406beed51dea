"""Lab 01 experiments: asynchronous launches, matmul throughput, memory bandwidth, launch overhead.

Every function runs on a CUDA GPU and on the CPU. On the CPU it measures the same idea with the CPU's
own machinery (CPU BLAS, DRAM bandwidth, per-op dispatch), never a made-up value; rows a CPU cannot
measure are returned with ``status``/``available`` saying so and a ``reason``. All timing goes through
``lab_utils.timing.benchmark`` except where a function's purpose is to show a different clock.

Units are in column names: ``_ms`` milliseconds, ``_us`` microseconds, ``tflops`` TFLOP/s (1e12),
``gbps`` GB/s (1e9 B/s), ``tbps`` TB/s (1e12 B/s), ``intensity_flop_per_byte`` FLOP per byte.
Importing this module imports torch and does no other work."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from lab_utils.args import check_int, check_ints
from lab_utils.course.specs import GpuPeaks, peaks_for
from lab_utils.plotting import format_bytes
from lab_utils.timing import Timing, benchmark, copy_bytes, cpu_model, cuda_graph, host_ms, matmul_bytes, matmul_flops

DTYPES = ("fp32", "tf32", "fp16", "bf16", "fp8")
ITEMSIZE = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1}  # bytes per input element (fp8 matmuls write bf16)

REASON_TF32_CPU = "needs an NVIDIA GPU with tensor cores (compute capability >= 8.0); the CPU has no TF32"
REASON_FP8_CPU = "needs compute capability >= 8.9 (an NVIDIA Ada, Hopper or newer GPU); this is the CPU"

MIB = 2**20
GIB = 2**30


def resolve_device(device: str | None = "auto", where: str = "device") -> str:
    """'cpu', 'cuda' or 'cuda:N' as a string; 'auto' (or None) picks the GPU when there is one.

    Asking for a GPU that is not there is an error, not a silent fall-back to the CPU."""
    if device is None or device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if (name := str(device)) == "cpu":
        return name
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            why = ("this torch is a CPU-only build (torch.version.cuda is None)" if torch.version.cuda is None
                   else "no NVIDIA GPU is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)")
            raise ValueError(
                f"{where}={device!r}: torch.cuda.is_available() is False: {why}. Pass device='cpu' or 'auto'.")
        index = torch.device(name).index
        if index is not None and index >= torch.cuda.device_count():
            raise ValueError(f"{where}={device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible; "
                             f"use 'cuda:0' .. 'cuda:{torch.cuda.device_count() - 1}'")
        return name
    raise ValueError(f"{where}={device!r}: use 'cpu', 'cuda', 'cuda:N' or 'auto'")


def _is_cuda(dev: str) -> bool:
    return dev.startswith("cuda")


def device_name(dev: str) -> str:
    """The name torch reports for a CUDA device, or the CPU model."""
    return torch.cuda.get_device_name(dev) if _is_cuda(dev) else cpu_model()


def device_peaks(dev: str) -> GpuPeaks | None:
    """Datasheet peaks of the device (``None`` for the CPU and for GPUs not in ``lab_utils.course.specs``)."""
    return peaks_for(device_name(dev)) if _is_cuda(dev) else None


def _check_reps(reps: Any, warmup: Any, where: str) -> tuple[int, int]:
    return check_int(reps, "reps", where), check_int(warmup, "warmup", where, minimum=0)


def _timing_row(t: Timing) -> dict[str, float]:
    """The columns every measured row carries, in ms (``spread``: (p90 - p10) / median)."""
    return {"median_ms": t.median_ms, "p10_ms": t.p10_ms, "p90_ms": t.p90_ms, "spread": t.spread}


def _default(value: Any, dev: str, gpu: Any, cpu: Any) -> Any:
    # Sizes that fill a GPU would take minutes on a laptop CPU (bf16 there is ~1 GFLOP/s).
    return value if value is not None else (gpu if _is_cuda(dev) else cpu)


def _check_dtypes(dtypes: Any, where: str) -> list[str]:
    dtypes = [dtypes] if isinstance(dtypes, str) else list(dtypes)
    if (bad := [d for d in dtypes if d not in DTYPES]) or not dtypes:
        raise ValueError(f"{where}(dtypes={dtypes!r}): unknown dtype {bad}; valid dtypes are {list(DTYPES)}")
    return dtypes


# --- TF32 -----------------------------------------------------------------------------------------


def _precision_state(torch: Any) -> dict[str, str]:
    # torch >= 2.9 sets TF32 per backend (``torch.backends.cuda.matmul.fp32_precision``: "tf32" / "ieee"). With that
    # API only its own settings are read: the legacy getters (allow_tf32, get_float32_matmul_precision) refuse to
    # answer once the two APIs disagree.
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        return {"cuda.matmul": torch.backends.cuda.matmul.fp32_precision}
    return {"legacy": torch.get_float32_matmul_precision()}


@contextlib.contextmanager
def tf32_matmul(enabled: bool = True) -> Iterator[None]:
    """TF32 for fp32 matmuls inside the block (or, with ``enabled=False``, full fp32); the previous setting after.

    TF32 rounds fp32 matmul inputs to a 10-bit mantissa so cuBLAS can use the tensor cores. The switch is
    ``torch.backends.cuda.matmul.fp32_precision = "tf32"`` ("ieee" for full fp32; torch >= 2.9); the older
    ``torch.backends.cuda.matmul.allow_tf32`` / ``torch.set_float32_matmul_precision`` are deprecated and are
    used only on a torch without the new switch. The setting is process-wide, so it is never left changed."""
    saved = _precision_state(torch)
    if "cuda.matmul" in saved:
        torch.backends.cuda.matmul.fp32_precision = "tf32" if enabled else "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = bool(enabled)
    try:
        yield
    finally:
        if "cuda.matmul" in saved:
            torch.backends.cuda.matmul.fp32_precision = saved["cuda.matmul"]
        else:
            torch.set_float32_matmul_precision(saved["legacy"])


# --- Matmul cases ---------------------------------------------------------------------------------


def matmul_min_bytes(dtype: str, n: int) -> int:
    """Fewest bytes an n×n×n matmul in ``dtype`` moves: A and B read once, C written once (bf16 for fp8)."""
    return matmul_bytes(n, n, n, ITEMSIZE[dtype], out_itemsize=2 if dtype == "fp8" else None)


@dataclass
class MatmulCase:
    """One square matmul, inputs already on the device; ``fn()`` runs it once (run it under ``tf32``).

    ``inputs`` are (A, B) as passed to the matmul (for fp8, B is a column-major view), for checking."""

    dtype: str
    n: int
    fn: Callable[[], Any]
    flops: int
    min_bytes: int
    tf32: bool
    inputs: tuple[Any, Any]

    @property
    def intensity_flop_per_byte(self) -> float:
        return self.flops / self.min_bytes


def matmul_skip_reason(dtype: str, n: int, dev: str) -> str | None:
    """Why ``dtype`` cannot be measured at size ``n`` on ``dev``; ``None`` when it can."""
    cc = tuple(torch.cuda.get_device_capability(dev)) if _is_cuda(dev) else None
    needs = {"tf32": ((8, 0), "Ampere+", REASON_TF32_CPU), "fp8": ((8, 9), "Ada+", REASON_FP8_CPU)}
    if dtype in needs:
        least, arch, on_cpu = needs[dtype]
        if cc is None:
            return on_cpu
        if cc < least:
            return (f"{dtype.upper()} needs compute capability >= {least[0]}.{least[1]} ({arch}); "
                    f"{device_name(dev)} is {cc[0]}.{cc[1]}")
    if dtype == "fp8":
        if not (hasattr(torch, "float8_e4m3fn") and hasattr(torch, "_scaled_mm")):
            return f"this torch ({torch.__version__}) has no float8_e4m3fn / torch._scaled_mm"
        if n % 16:
            return f"torch._scaled_mm needs sizes that are multiples of 16; n={n}"
    return None


def _one_matmul(where: str, n: Any, dtype: Any, dev: str, default_n: tuple[int, int], hint: str = "") -> MatmulCase:
    """The one matmul an experiment times: ``n`` (default: ``default_n``, GPU then CPU) and ``dtype`` checked; a
    dtype this device cannot run is a ValueError naming ``where`` (then ``hint``)."""
    n = check_int(_default(n, dev, *default_n), "n", where)
    (dtype,) = _check_dtypes([dtype], where)
    if reason := matmul_skip_reason(dtype, n, dev):
        raise ValueError(f"{where}(dtype={dtype!r}): {reason}{hint}")
    return make_matmul(n, dtype, dev)


def make_matmul(n: int, dtype: str, dev: str, fp8_fast_accum: bool = False) -> MatmulCase:
    """Random normal n×n inputs (never zeros: zeros run faster and draw less power) and the call to time."""
    if dtype == "fp8":
        # _scaled_mm wants A row-major [M,K] and B column-major [K,N]: B is the transpose of a row-major
        # [N,K] tensor. Per-tensor scales are float32 scalars on the device; 1.0 keeps the values as drawn
        # (N(0,1) fits e4m3's range, max 448).
        a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn).t()
        scale = torch.ones((), device=dev, dtype=torch.float32)

        def fn() -> Any:
            out = torch._scaled_mm(a, b, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16,
                                   use_fast_accum=fp8_fast_accum)
            return out[0] if isinstance(out, tuple) else out  # torch 2.1-2.4 returned (out, amax)

        return MatmulCase(dtype, n, fn, matmul_flops(n, n, n), matmul_min_bytes(dtype, n), False, (a, b))
    torch_dtype = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    a = torch.randn(n, n, device=dev, dtype=torch_dtype[dtype])
    b = torch.randn(n, n, device=dev, dtype=torch_dtype[dtype])
    return MatmulCase(dtype, n, lambda: a @ b, matmul_flops(n, n, n), matmul_min_bytes(dtype, n), dtype == "tf32",
                      (a, b))


# --- 1. Asynchronous launches ---------------------------------------------------------------------


def async_pitfall(n: int | None = None, device: str | None = "auto", dtype: str = "fp32", reps: int = 20,
                  warmup: int = 3) -> pd.DataFrame:
    """Time one n×n matmul three ways: host clock without synchronize (wrong on a GPU), host clock with synchronize, and
    ``benchmark`` (CUDA events on a GPU).

    On a GPU the first measures only the launch (microseconds) and claims an impossible TFLOP/s. On the CPU a matmul
    returns when it is done, so all three agree; ``async_launch`` says which case this is. Default n: 4096 on a GPU, 512
    on the CPU. Columns: method, median_ms, apparent_tflops, ratio_to_benchmark, async_launch, n, dtype, device."""
    where = "async_pitfall"
    dev = resolve_device(device, f"{where}(device)")
    reps, warmup = _check_reps(reps, warmup, where)
    case = _one_matmul(where, n, dtype, dev, (4096, 512), "; use dtype='fp32'")
    n, dtype = case.n, case.dtype
    rows = []
    with tf32_matmul(case.tf32):
        for _ in range(max(warmup, 1)):
            case.fn()
        no_sync = host_ms(case.fn, dev, reps, wait=False)  # the classic bug: the clock read as the call returns
        with_sync = host_ms(case.fn, dev, reps, wait=True)
        timed = benchmark(case.fn, reps=reps, warmup=warmup, device=dev, name=f"{dtype} matmul {n}")

    ref_ms = timed.median_ms
    for method, ms in (("host clock, no synchronize", no_sync), ("host clock + synchronize", with_sync),
                       ("benchmark (CUDA events)" if _is_cuda(dev) else "benchmark (host clock)", ref_ms)):
        rows.append({"method": method, "median_ms": ms, "apparent_tflops": case.flops / (ms * 1e-3) / 1e12,
                     "ratio_to_benchmark": ms / ref_ms, "async_launch": _is_cuda(dev), "n": n, "dtype": dtype,
                     "device": dev})
    return pd.DataFrame(rows)


def first_call_cost(n: int | None = None, device: str | None = "auto", dtype: str = "fp32",
                    reps: int = 20) -> pd.DataFrame:
    """Wall time of the first matmul on fresh tensors against the steady-state median.

    The first call pays for lazy set-up (cuBLAS handle, module loading, heuristics; the CPU's BLAS pool): run it first
    in a fresh kernel. It is timed with a host clock and synchronize, as part of its cost is host work. Default n: 4096
    on a GPU, 512 on the CPU. Columns: call, latency_ms, x_steady, n, dtype, device, runtime_initialized_before."""
    where = "first_call_cost"
    dev = resolve_device(device, f"{where}(device)")
    reps = check_int(reps, "reps", where)
    # Whether the CUDA context existed before this call (read before anything below creates it). It is
    # created outside the timed region either way, so the first-call number is about the matmul alone.
    initialized = bool(torch.cuda.is_initialized()) if _is_cuda(dev) else None
    case = _one_matmul(where, n, dtype, dev, (4096, 512), "; use dtype='fp32'")
    n, dtype = case.n, case.dtype
    with tf32_matmul(case.tf32):
        first_ms = host_ms(case.fn, dev, 1, wait=True)
        steady = benchmark(case.fn, reps=reps, warmup=2, device=dev, name=f"{dtype} matmul {n}")
    rows = [("first call", first_ms), ("steady state (median)", steady.median_ms)]
    return pd.DataFrame([{"call": call, "latency_ms": ms, "x_steady": ms / steady.median_ms, "n": n, "dtype": dtype,
                          "device": dev, "runtime_initialized_before": initialized} for call, ms in rows])


# --- 2. Matmul throughput -------------------------------------------------------------------------


SWEEP_COLUMNS = ["dtype", "n", "status", "reason", "flops", "min_bytes", "intensity_flop_per_byte", "median_ms",
                 "p10_ms", "p90_ms", "spread", "tflops", "peak_tflops", "pct_of_peak", "device", "device_name"]


def matmul_sweep(sizes: Sequence[int] | None = None, dtypes: Sequence[str] = DTYPES, device: str | None = "auto",
                 reps: int = 10, warmup: int = 3, fp8_fast_accum: bool = False,
                 progress: Callable[..., Any] | None = None) -> pd.DataFrame:
    """Achieved TFLOP/s of square n×n×n matmuls for each dtype and size, at the median of ``reps``.

    ``pct_of_peak``: against the GPU's dense datasheet peak (NaN on the CPU or an unknown GPU). Rows that cannot run
    here come back with ``status='skipped'`` and a ``reason``. Default sizes: 1024..8192 on a GPU, 128..512 on the
    CPU. Columns: ``SWEEP_COLUMNS``. ``progress``: ``lab_utils.widgets.progress``, one step per (dtype, n)."""
    where = "matmul_sweep"
    dev = resolve_device(device, f"{where}(device)")
    sizes = check_ints(_default(sizes, dev, (1024, 2048, 4096, 8192), (128, 256, 512)), "sizes", where)
    dtypes = _check_dtypes(dtypes, where)
    reps, warmup = _check_reps(reps, warmup, where)
    name = device_name(dev)
    peaks = device_peaks(dev)
    rows = []
    cases = [(dtype, n) for dtype in dtypes for n in sizes]
    for dtype, n in progress(cases, total=len(cases), desc="matmul sweep") if progress else cases:
        peak = peaks.tflops(dtype) if peaks else None
        flops, nbytes = matmul_flops(n, n, n), matmul_min_bytes(dtype, n)
        row: dict[str, Any] = {"dtype": dtype, "n": n, "status": "ok", "reason": "", "flops": flops,
                               "min_bytes": nbytes, "intensity_flop_per_byte": flops / nbytes, "median_ms": math.nan,
                               "p10_ms": math.nan, "p90_ms": math.nan, "spread": math.nan, "tflops": math.nan,
                               "peak_tflops": math.nan if peak is None else float(peak), "pct_of_peak": math.nan,
                               "device": dev, "device_name": name}
        if reason := matmul_skip_reason(dtype, n, dev):
            row.update(status="skipped", reason=reason)
            rows.append(row)
            continue
        try:
            case = make_matmul(n, dtype, dev, fp8_fast_accum=fp8_fast_accum)
            with tf32_matmul(case.tf32):  # fp32 rows run with TF32 explicitly off
                t = benchmark(case.fn, reps=reps, warmup=warmup, device=dev, name=f"{dtype} {n}^3")
        except RuntimeError as exc:
            if dtype != "fp8":
                raise
            # _scaled_mm's requirements change between torch releases; say what it said, keep the sweep.
            row.update(status="error", reason=f"torch._scaled_mm failed: {str(exc).splitlines()[0]}")
            rows.append(row)
            continue
        tflops = t.tflops(flops)
        row.update(**_timing_row(t), tflops=tflops, pct_of_peak=100.0 * tflops / peak if peak else math.nan)
        rows.append(row)
        del case
    return pd.DataFrame(rows, columns=SWEEP_COLUMNS)


def bare_matmul_loop(n: int | None = None, dtype: str | None = None, iters: int = 20, device: str | None = "auto",
                     warmup: int = 3) -> float:
    """TFLOP/s of the simplest loop, for comparison with ``benchmark``: mean time over ``iters`` matmuls.

    On a GPU: one event before the loop, one after, one synchronize. On the CPU: a host clock around
    the loop. ``warmup`` untimed calls come first so the first-call cost stays out.
    Defaults: bf16 8192 on a GPU (the reference run's case), fp32 512 on the CPU."""
    where = "bare_matmul_loop"
    dev = resolve_device(device, f"{where}(device)")
    iters = check_int(iters, "iters", where)
    warmup = check_int(warmup, "warmup", where, minimum=0)
    case = _one_matmul(where, n, _default(dtype, dev, "bf16", "fp32"), dev, (8192, 512))
    fn = case.fn
    with tf32_matmul(case.tf32):
        for _ in range(warmup):
            fn()
        if _is_cuda(dev):
            with torch.cuda.device(dev):
                torch.cuda.synchronize()  # the warm-up finished before the first event
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    fn()
                end.record()
                torch.cuda.synchronize()
                total_ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            total_ms = (time.perf_counter() - t0) * 1e3
    return case.flops * iters / (total_ms * 1e-3) / 1e12


# --- 3. Memory bandwidth --------------------------------------------------------------------------


def copy_bandwidth(sizes_bytes: Sequence[int] | None = None, device: str | None = "auto", reps: int = 10,
                   warmup: int = 3) -> pd.DataFrame:
    """Bandwidth of ``dst.copy_(src)`` in GB/s, counting the read and the write (2 × size).

    On a GPU this is HBM bandwidth, device to device; on the CPU it is DRAM bandwidth, provided the sizes
    are well above the last-level cache (the CPU defaults are 64 and 256 MiB). Sizes are rounded down to
    whole float32 elements. Columns: size_bytes, size_mib, bytes_moved, median_ms, p10_ms, p90_ms,
    spread, gbps, peak_gbps, pct_of_peak, device, device_name."""
    where = "copy_bandwidth"
    dev = resolve_device(device, f"{where}(device)")
    sizes_bytes = check_ints(_default(sizes_bytes, dev, (MIB, 16 * MIB, 256 * MIB, 2 * GIB),
                                                (64 * MIB, 256 * MIB)), "sizes_bytes", where)
    reps, warmup = _check_reps(reps, warmup, where)
    peaks = device_peaks(dev)
    peak_gbps = peaks.hbm_tbps * 1e3 if peaks else math.nan
    name = device_name(dev)
    rows = []
    for size in sizes_bytes:
        numel = max(size // 4, 1)
        nbytes = numel * 4
        src = torch.randn(numel, device=dev)
        dst = torch.empty_like(src)
        t = benchmark(lambda d=dst, s=src: d.copy_(s), reps=reps, warmup=warmup, device=dev, name="copy")
        moved = copy_bytes(nbytes)
        gbps = t.gbps(moved)
        rows.append({"size_bytes": nbytes, "size_mib": nbytes / MIB, "bytes_moved": moved, **_timing_row(t),
                     "gbps": gbps, "peak_gbps": peak_gbps, "pct_of_peak": 100.0 * gbps / peak_gbps, "device": dev,
                     "device_name": name})
        del src, dst
    return pd.DataFrame(rows)


HOST_DEVICE_COLUMNS = ["direction", "host_memory", "size_bytes", "median_ms", "p10_ms", "p90_ms", "spread", "gbps",
                       "peak_gbps", "pct_of_peak", "device", "reason"]


def host_device_bandwidth(nbytes: int = GIB, reps: int = 10, device: str | None = "auto",
                          warmup: int = 2) -> pd.DataFrame:
    """Host→device (H2D) and device→host (D2H) copy bandwidth in GB/s, pinned against pageable host memory.

    Pinned (page-locked) memory lets the GPU's copy engine read host memory directly; pageable memory is first staged
    through a pinned buffer by the driver. ``peak_gbps`` is the PCIe link, one direction. With no GPU the frame is empty
    and ``.attrs['reason']`` (and the ``reason`` column) say why. Columns: see ``HOST_DEVICE_COLUMNS``."""
    where = "host_device_bandwidth"
    nbytes = check_int(nbytes, "nbytes", where)
    reps, warmup = _check_reps(reps, warmup, where)
    dev = resolve_device(device, f"{where}(device)")
    if not _is_cuda(dev):
        df = pd.DataFrame(columns=HOST_DEVICE_COLUMNS)
        df.attrs["reason"] = "host<->device copies need a CUDA GPU; this run is on the CPU"
        return df
    peaks = device_peaks(dev)
    peak_gbps = peaks.pcie_gbps_per_dir if peaks else math.nan
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    gpu.fill_(7)  # any non-zero pattern: copy speed does not depend on the values
    rows = []
    for host_memory in ("pinned", "pageable"):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=host_memory == "pinned")
        host.fill_(3)
        pinned = host_memory == "pinned"
        for direction, fn in (("H2D", lambda h=host, p=pinned: gpu.copy_(h, non_blocking=p)),
                              ("D2H", lambda h=host, p=pinned: h.copy_(gpu, non_blocking=p))):
            t = benchmark(fn, reps=reps, warmup=warmup, device=dev, name=f"{direction} {host_memory}")
            gbps = t.gbps(nbytes)
            rows.append({"direction": direction, "host_memory": host_memory, "size_bytes": nbytes, **_timing_row(t),
                         "gbps": gbps, "peak_gbps": peak_gbps, "pct_of_peak": 100.0 * gbps / peak_gbps, "device": dev,
                         "reason": ""})
        del host
    return pd.DataFrame(rows, columns=HOST_DEVICE_COLUMNS)


# --- 4. Launch overhead and CUDA graphs -----------------------------------------------------------


def launch_overhead(n_kernels: int = 1000, numel: int = 1024, device: str | None = "auto", reps: int = 20,
                    warmup: int = 3) -> pd.DataFrame:
    """Cost per tiny kernel: a chain of ``n_kernels`` ``x.add_(1.0)`` on ``numel`` floats, launched one by
    one (eager) and replayed from a captured ``torch.cuda.CUDAGraph``.

    Each tiny kernel does almost no work, so eager time is the host's launch cost; a graph replay
    submits the whole chain at once. On the CPU only the eager row (per-op dispatch) is measured.
    Columns: mode, available, reason, n_kernels, numel, median_ms, us_per_kernel, speedup_vs_eager, device."""
    where = "launch_overhead"
    n_kernels = check_int(n_kernels, "n_kernels", where)
    numel = check_int(numel, "numel", where)
    reps, warmup = _check_reps(reps, warmup, where)
    dev = resolve_device(device, f"{where}(device)")
    x = torch.randn(numel, device=dev)

    def chain() -> None:
        for _ in range(n_kernels):
            x.add_(1.0)

    eager = benchmark(chain, reps=reps, warmup=warmup, device=dev, name=f"eager {n_kernels} x add_")

    def row(mode: str, available: bool, reason: str, median_ms: float, speedup: float) -> dict[str, Any]:
        return {"mode": mode, "available": available, "reason": reason, "n_kernels": n_kernels, "numel": numel,
                "median_ms": median_ms, "us_per_kernel": median_ms * 1e3 / n_kernels, "speedup_vs_eager": speedup,
                "device": dev}

    rows = [row("eager", True, "", eager.median_ms, 1.0)]
    if not _is_cuda(dev):
        why = "CUDA graphs need a CUDA GPU; this run is on the CPU"
        rows.append(row("cuda_graph", False, why, math.nan, math.nan))
        return pd.DataFrame(rows)

    with torch.cuda.device(dev):
        graph, _ = cuda_graph(chain)
        torch.cuda.synchronize()

        # The graph must do the same work: one replay adds n_kernels to every element.
        x.fill_(1.0)
        graph.replay()
        torch.cuda.synchronize()
        expected = 1.0 + n_kernels  # exact in fp32 below 2**24
        if not torch.all(x == expected):
            raise RuntimeError(f"{where}: graph replay gave {x[0].item()} instead of {expected}")

        replay = benchmark(graph.replay, reps=reps, warmup=warmup, device=dev, name=f"graph {n_kernels}")
        del graph
    rows.append(row("cuda_graph", True, "", replay.median_ms, eager.median_ms / replay.median_ms))
    return pd.DataFrame(rows)


# --- 5. Roofline ----------------------------------------------------------------------------------


ROOFLINE_COLUMNS = ["label", "kind", "dtype", "intensity_flop_per_byte", "tflops", "tbps", "device"]


def elementwise_add(numel: int | None = None, device: str | None = "auto", reps: int = 10,
                    warmup: int = 3) -> dict[str, Any]:
    """Measure ``torch.add(x, y, out=z)`` in fp32: 1 FLOP per element over 3 × 4 bytes (two reads, one write).

    Default size: 64 Mi elements on a GPU (768 MiB moved), 8 Mi on the CPU (96 MiB, above the caches).
    Returns a roofline row (see ``ROOFLINE_COLUMNS``) plus median_ms."""
    where = "elementwise_add"
    dev = resolve_device(device, f"{where}(device)")
    numel = check_int(_default(numel, dev, 64 * 2**20, 8 * 2**20), "numel", where)
    x = torch.randn(numel, device=dev)
    y = torch.randn(numel, device=dev)
    z = torch.empty_like(x)
    t = benchmark(lambda: torch.add(x, y, out=z), reps=reps, warmup=warmup, device=dev, name=f"add {numel}")
    nbytes = 3 * numel * x.element_size()
    return {"label": f"add fp32 {format_bytes(numel * 4)}", "kind": "elementwise", "dtype": "fp32",
            "intensity_flop_per_byte": numel / nbytes, "tflops": t.tflops(numel), "tbps": t.gbps(nbytes) / 1e3,
            "device": dev, "median_ms": t.median_ms}


def roofline_points(sweep: pd.DataFrame | None = None, copies: pd.DataFrame | None = None, device: str | None = "auto",
                    elementwise_numel: int | None = None, reps: int = 10) -> pd.DataFrame:
    """Measured points for a roofline: the matmuls of ``sweep`` (TFLOP/s only), an elementwise add measured here (both),
    the copies of ``copies`` (TB/s only: the memory ceiling). ``.attrs``: ``measured_peak_tflops`` (best matmul) and
    ``measured_bw_tbps`` (best copy) for ``bench_plots.plot_roofline``. Columns: ``ROOFLINE_COLUMNS``."""
    rows: list[dict[str, Any]] = []
    if sweep is not None:
        if missing := {"dtype", "n", "tflops", "intensity_flop_per_byte"} - set(sweep.columns):
            raise ValueError(f"roofline_points(sweep=...): not a matmul_sweep frame, missing columns {sorted(missing)}")
        ok = sweep[sweep["status"] == "ok"] if "status" in sweep else sweep
        for r in ok.itertuples(index=False):
            rows.append({"label": f"matmul {r.dtype} {r.n}", "kind": "matmul", "dtype": r.dtype,  # not bandwidth-bound
                         "intensity_flop_per_byte": r.intensity_flop_per_byte, "tflops": r.tflops, "tbps": math.nan,
                         "device": r.device})
    rows.append(elementwise_add(elementwise_numel, device=device, reps=reps))  # its median_ms is not a column
    if copies is not None:
        if missing := {"size_bytes", "gbps"} - set(copies.columns):
            raise ValueError(
                f"roofline_points(copies=...): not a copy_bandwidth frame, missing columns {sorted(missing)}")
        for r in copies.itertuples(index=False):
            rows.append({"label": f"copy {format_bytes(r.size_bytes)}", "kind": "copy", "dtype": "",
                         "intensity_flop_per_byte": math.nan, "tflops": math.nan, "tbps": r.gbps / 1e3,
                         "device": r.device})
    df = pd.DataFrame(rows, columns=ROOFLINE_COLUMNS)
    mm = df.loc[df["kind"] == "matmul", "tflops"]
    cp = df.loc[df["kind"] == "copy", "tbps"]
    df.attrs["measured_peak_tflops"] = float(mm.max()) if len(mm) else None
    df.attrs["measured_bw_tbps"] = float(cp.max()) if len(cp) else None
    return df
