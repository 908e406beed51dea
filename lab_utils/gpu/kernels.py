"""Lab 01b's helpers: GPU kernels written in Triton's language, launched, guarded and timed.

Triton compiles ``@triton.jit`` functions for an NVIDIA GPU; without one, its interpreter (``TRITON_INTERPRET=1``)
runs the same kernels on CPU tensors, one program after another, with NumPy: right for checking a kernel, meaningless
for its speed. ``load_triton`` picks the mode before ``triton`` is imported. The launchers here are the one place the
lab's three kernels are launched (the checks and the lab's timings use them); buffers with guard bands around them
catch a kernel that reads or writes past the end, as an unmasked last block does, without touching memory that is
not the tensor's own. All timing goes through lab 01's ``lab_utils.timing.benchmark`` (CUDA events on a GPU).

Units in column names, as in ``gpu.bench``: ``_ms`` milliseconds, ``gbps`` GB/s (1e9 B/s), ``tflops`` TFLOP/s (1e12),
``tbps`` TB/s, ``intensity_flop_per_byte`` FLOP per byte."""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from lab_utils.args import check_int
from lab_utils.compat import triton_interpreter
from lab_utils.gpu.bench import ROOFLINE_COLUMNS, resolve_device
from lab_utils.timing import benchmark, matmul_bytes, matmul_flops

KERNELS_INSTALL = "pip install -e '.[kernels]'"  # triton from PyPI (about 1 GB installed); ./course setup does it
INTERPRET_ENV = "TRITON_INTERPRET"

# FLOPs per element of a row softmax, by the usual count: the max (1 compare), x - max, exp, the sum, the division.
SOFTMAX_FLOPS_PER_ELEMENT = 5


# --- which Triton this machine has ------------------------------------------------------------------------------


class _Missing(types.SimpleNamespace):
    """Stands in for ``triton`` and ``triton.language`` where triton is not installed: ``@triton.jit`` keeps the
    function as written (it is never run) and ``tl.constexpr`` can annotate its parameters, so the lab's cells still
    define their kernels; anything else names the install."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"triton.{name}: triton is not installed here; {KERNELS_INSTALL} installs it")


def _jit(fn: Any = None, **_: Any) -> Any:
    return fn if fn is not None else (lambda f: f)


MISSING_TRITON = _Missing(jit=_jit, constexpr="constexpr", cdiv=lambda a, b: -(-a // b),
                          next_power_of_2=lambda n: 1 << max(int(n) - 1, 0).bit_length())


@dataclass(frozen=True)
class TritonHere:
    """Triton as this lab uses it here. ``mode``: ``"compiled"`` (kernels compiled for the GPU), ``"interpreter"``
    (``TRITON_INTERPRET=1``: the same kernels on CPU tensors) or ``"missing"`` (``triton``/``tl`` are stand-ins
    that only let a kernel be defined)."""

    triton: Any
    tl: Any
    mode: str
    version: str | None
    note: str

    @property
    def runs(self) -> bool:
        """Whether kernels can be launched here (compiled or interpreted)."""
        return self.mode != "missing"


def load_triton(device: str) -> TritonHere:
    """Import triton for ``device``: compiled on a CUDA device; on the CPU ``TRITON_INTERPRET=1`` is set first (the
    interpreter is chosen when a kernel is decorated, so before any ``@triton.jit``). Without triton, stand-ins."""
    if importlib.util.find_spec("triton") is None:
        return TritonHere(MISSING_TRITON, MISSING_TRITON, "missing", None,
                          f"triton is not installed: the kernels are defined but not run. {KERNELS_INSTALL} "
                          "installs it (a GPU's torch usually brings it)")
    cuda = resolve_device(device).startswith("cuda")
    if not cuda:
        os.environ[INTERPRET_ENV] = "1"
    try:
        triton = importlib.import_module("triton")
        tl = importlib.import_module("triton.language")
    except Exception as err:  # a broken install: say which, run the rest of the lab
        return TritonHere(MISSING_TRITON, MISSING_TRITON, "missing", None,
                          f"`import triton` failed ({type(err).__name__}: {err}); reinstall it: {KERNELS_INSTALL}")
    version = getattr(triton, "__version__", None)
    if cuda and os.environ.get(INTERPRET_ENV, "") in ("", "0"):
        return TritonHere(triton, tl, "compiled", version, f"triton {version}: kernels compiled for this GPU")
    # an older triton under NumPy >= 2.4: its interpreter cannot take a loop bounded by a kernel argument
    mended = " (its loop bounds mended for this NumPy: lab_utils.compat.triton_interpreter)" \
        if triton_interpreter.apply() else ""
    if cuda:
        return TritonHere(triton, tl, "interpreter", version,
                          f"{INTERPRET_ENV} is set: the interpreter runs the kernels although a GPU is here "
                          f"(unset it for compiled kernels){mended}")
    return TritonHere(triton, tl, "interpreter", version,
                      f"triton {version}, {INTERPRET_ENV}=1: the interpreter runs each program of the grid on CPU "
                      f"tensors, one after another (right for checking a kernel, says nothing about GPU speed){mended}")


# --- guard bands: memory around a tensor that no right kernel touches ---------------------------------------------

GUARD_FILL = -1000.0  # written around an output: exact in fp16 and fp32, and no kernel of the lab produces it


@dataclass
class Guarded:
    """A tensor (``view``) inside a larger buffer (``base``) whose other elements hold ``fill``: a kernel that writes
    past the view's end (an unmasked last block) changes them, and ``spilled()`` counts the changes."""

    base: torch.Tensor
    view: torch.Tensor
    fill: float

    def spilled(self) -> int:
        """Elements outside ``view`` whose value changed (NaN-safe), i.e. written by a kernel past the tensor."""
        inside = torch.zeros(self.base.shape, dtype=torch.bool, device=self.base.device)
        inside.as_strided(self.view.shape, self.view.stride(),
                          self.view.storage_offset() - self.base.storage_offset()).fill_(True)
        outside = self.base[~inside]
        same = (outside == self.fill) | (torch.isnan(outside) & math.isnan(self.fill))
        return int((~same).sum())


def guarded(shape: Sequence[int], dtype: torch.dtype, device: str, pad: Sequence[int], fill: float = GUARD_FILL,
            values: torch.Tensor | None = None) -> Guarded:
    """A tensor of ``shape`` at ``pad[d]`` elements from the start of each dimension of a buffer ``shape + 2*pad``
    (rows of a 2-D view are then longer than its columns: its row stride is ``cols + 2*pad[1]``), the rest ``fill``;
    ``values`` copied in when given."""
    full = [s + 2 * p for s, p in zip(shape, pad, strict=True)]
    base = torch.full(full, fill, dtype=dtype, device=device)
    view = base[tuple(slice(p, p + s) for s, p in zip(shape, pad, strict=True))]
    if values is not None:
        view.copy_(values)
    return Guarded(base, view, fill)


# --- the launchers: the one place each kernel of the lab is launched ----------------------------------------------


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive integers: programs needed to cover ``a`` elements ``b`` at a time."""
    return -(-a // b)


def _options(num_warps: int | None, num_stages: int | None) -> dict[str, int]:
    return {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}


def launch_add(kernel: Any, x: torch.Tensor, y: torch.Tensor, out: torch.Tensor, block: int = 1024,
               num_warps: int | None = None) -> tuple[int]:
    """``kernel[grid](x, y, out, n, BLOCK=block)`` over ``cdiv(n, block)`` programs; returns the grid."""
    n = out.numel()
    grid = (cdiv(n, block),)
    kernel[grid](x, y, out, n, BLOCK=block, **_options(num_warps, None))
    return grid


def softmax_block(n_cols: int) -> int:
    """The block of one row: the next power of two >= ``n_cols`` (``tl.arange`` needs a power of two), at least 16
    (a block smaller than a warp gains nothing, and tiny blocks are the compiler's least trodden path)."""
    return max(16, 1 << max(n_cols - 1, 0).bit_length())


def launch_softmax(kernel: Any, x: torch.Tensor, out: torch.Tensor, num_warps: int | None = None) -> tuple[int]:
    """One program per row: ``kernel[(rows,)](out, x, x.stride(0), out.stride(0), n_cols, BLOCK=...)``."""
    rows, cols = x.shape
    kernel[(rows,)](out, x, x.stride(0), out.stride(0), cols, BLOCK=softmax_block(cols), **_options(num_warps, None))
    return (rows,)


@dataclass(frozen=True)
class MatmulConfig:
    """A tile shape for the matmul kernel: BM×BN outputs per program, BK along K per step; warps and pipeline
    stages per program (``num_stages``: how many K steps' loads are in flight at once)."""

    bm: int
    bn: int
    bk: int
    num_warps: int | None = None
    num_stages: int | None = None

    def __str__(self) -> str:
        opts = "".join(f", {k}={v}" for k, v in _options(self.num_warps, self.num_stages).items())
        return f"BM={self.bm}, BN={self.bn}, BK={self.bk}{opts}"


def launch_matmul(kernel: Any, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, cfg: MatmulConfig) -> tuple[int, int]:
    """C = A @ B over a 2-D grid of ``(cdiv(M, BM), cdiv(N, BN))`` programs, each one BM×BN tile of C."""
    (m, k), n = a.shape, b.shape[1]
    grid = (cdiv(m, cfg.bm), cdiv(n, cfg.bn))
    kernel[grid](a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                 BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, **_options(cfg.num_warps, cfg.num_stages))
    return grid


def unfused_softmax(x: torch.Tensor) -> torch.Tensor:
    """Row softmax as a chain of torch operations, each its own kernel and its own pass over memory."""
    m = x.max(dim=1, keepdim=True).values
    e = torch.exp(x - m)
    return e / e.sum(dim=1, keepdim=True)


# --- the CUDA C++ vector add, through CuPy -------------------------------------------------------------------

CUDA_ADD_SOURCE = r"""
extern "C" __global__ void add(const float* x, const float* y, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;  // one element per thread
    if (i < n) {                                     // the mask: the last block's extra threads do nothing
        out[i] = x[i] + y[i];
    }
}
"""


def cupy_status() -> str | None:
    """Why CuPy's ``RawKernel`` cannot run here, or None when it can (CuPy imports and sees a GPU)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU: the CUDA C++ kernel is shown, not compiled"
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (pip install cupy-cuda13x, or cupy-cuda12x for a CUDA 12 torch)"
    return None


def cuda_add(threads_per_block: int = 256) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[int]]:
    """``CUDA_ADD_SOURCE`` compiled by CuPy (NVRTC) as a function ``add(x, y, out)`` of torch CUDA float32 tensors,
    launched on ``cdiv(n, threads_per_block)`` blocks of ``threads_per_block`` threads; it returns the grid."""
    import cupy as cp

    kernel = cp.RawKernel(CUDA_ADD_SOURCE, "add")

    def add(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> tuple[int]:
        n = out.numel()
        grid = (cdiv(n, threads_per_block),)
        # CuPy reads torch's memory in place (__cuda_array_interface__) and launches on torch's current stream.
        # CuPy 14 deprecates ExternalStream for Stream.from_external, which older CuPy lacks: the one both have.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                kernel(grid, (threads_per_block,), (cp.asarray(x), cp.asarray(y), cp.asarray(out), cp.int32(n)))
        return grid

    return add


# --- timings ---------------------------------------------------------------------------------------------


def _row(label: str, kind: str, t: Any, nbytes: float, flops: float, dtype: str, device: str,
         **extra: Any) -> dict[str, Any]:
    return {"label": label, "kind": kind, "dtype": dtype, "median_ms": t.median_ms, "spread": t.spread,
            "gbps": t.gbps(nbytes), "tflops": t.tflops(flops), "intensity_flop_per_byte": flops / nbytes,
            "device": device, **extra}


def time_add(kernel: Any, numel: int, device: str, reps: int = 10, block: int = 1024,
             others: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]] | None = None
             ) -> pd.DataFrame:
    """GB/s of ``out = x + y`` in fp32 (3 × 4 bytes per element: two reads, one write) by the Triton ``kernel``,
    by ``torch.add`` and by each of ``others`` (name -> ``fn(x, y, out)``), all with lab 01's timer."""
    numel = check_int(numel, "numel", "time_add")
    x, y = torch.randn(numel, device=device), torch.randn(numel, device=device)
    out = torch.empty_like(x)
    nbytes, rows = 3 * 4 * numel, []
    ways = {"triton add": lambda: launch_add(kernel, x, y, out, block),
            "torch.add": lambda: torch.add(x, y, out=out)}
    ways.update({name: (lambda f=f: f(x, y, out)) for name, f in (others or {}).items()})
    for name, fn in ways.items():
        out.zero_()
        fn()
        if not torch.equal(out, x + y):
            raise ValueError(f"time_add: {name} did not compute x + y on {numel} elements; fix it before timing it")
        t = benchmark(fn, reps=reps, warmup=3, device=device, name=name)
        rows.append(_row(name, "elementwise", t, nbytes, numel, "fp32", device))
    return pd.DataFrame(rows)


def time_softmax(kernel: Any, rows: int, cols: int, device: str, reps: int = 10,
                 warps: Sequence[int | None] = (None,)) -> pd.DataFrame:
    """GB/s of a row softmax of a rows×cols fp32 matrix, counting what the job must move (read it once, write it
    once: 2 × 4 bytes per element) for every way: the Triton ``kernel`` with each of ``warps`` (None: Triton's
    default; no ``kernel``: no Triton rows), ``torch.softmax`` (one fused kernel of PyTorch's) and the unfused chain
    (five kernels, several passes over memory)."""
    x = torch.randn(rows, cols, device=device)
    out = torch.empty_like(x)
    want = torch.softmax(x, dim=1)
    nbytes, flops = 2 * 4 * rows * cols, SOFTMAX_FLOPS_PER_ELEMENT * rows * cols
    ways: list[tuple[str, Any, Callable[[], Any]]] = [
        (f"triton softmax (num_warps={w or 'default'})", w, lambda w=w: launch_softmax(kernel, x, out, w))
        for w in warps] if kernel is not None else []
    ways += [("torch.softmax", None, lambda: torch.softmax(x, dim=1)), ("unfused torch chain", None,
                                                                         lambda: unfused_softmax(x))]
    table = []
    for name, w, fn in ways:
        got = fn()
        got = out if name.startswith("triton") else got
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-6):
            raise ValueError(f"time_softmax: {name} is not the softmax of a {rows}x{cols} matrix; fix it first")
        t = benchmark(fn, reps=reps, warmup=3, device=device, name=name)
        table.append(_row(name, "softmax", t, nbytes, flops, "fp32", device, num_warps=w))
    return pd.DataFrame(table)


# Tile shapes tried on a GPU (fp16 in, fp32 accumulation): large tiles reuse each loaded tile most; num_stages keeps
# that many K steps' loads in flight.
GPU_MATMUL_CONFIGS = (MatmulConfig(128, 128, 64, 8, 3), MatmulConfig(128, 256, 64, 8, 3),
                      MatmulConfig(64, 128, 64, 4, 4))


def time_matmul(kernel: Any, n: int, device: str, reps: int = 10,
                configs: Sequence[MatmulConfig] = GPU_MATMUL_CONFIGS) -> pd.DataFrame:
    """TFLOP/s of an n×n×n fp16 matmul (2·n³ FLOPs) by the Triton ``kernel`` with each tile shape of ``configs``
    and by cuBLAS (``a @ b``), with lab 01's timer; random inputs, checked against cuBLAS first."""
    a = torch.randn(n, n, device=device, dtype=torch.float16)
    b = torch.randn(n, n, device=device, dtype=torch.float16)
    c = torch.empty(n, n, device=device, dtype=torch.float16)
    want = a @ b
    flops, nbytes = matmul_flops(n, n, n), matmul_bytes(n, n, n, 2)
    table = []
    for cfg in configs:
        launch_matmul(kernel, a, b, c, cfg)
        err = float((c.float() - want.float()).abs().max())
        if not err <= 0.05 * math.sqrt(n):
            raise ValueError(f"time_matmul: the Triton matmul ({cfg}) differs from cuBLAS by up to {err:.3g}; fix it")
        t = benchmark(lambda cfg=cfg: launch_matmul(kernel, a, b, c, cfg), reps=reps, warmup=3, device=device,
                      name=f"triton {cfg}")
        table.append(_row(f"triton matmul ({cfg})", "matmul", t, nbytes, flops, "fp16", device, config=str(cfg)))
    t = benchmark(lambda: a @ b, reps=reps, warmup=3, device=device, name="cuBLAS")
    table.append(_row("cuBLAS (a @ b)", "matmul", t, nbytes, flops, "fp16", device, config="cuBLAS's choice"))
    return pd.DataFrame(table)


def roofline_rows(*frames: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``time_add``/``time_softmax``/``time_matmul`` frames as roofline points (``ROOFLINE_COLUMNS``,
    for ``bench_plots.plot_roofline``)."""
    rows = [{"label": r["label"], "kind": r["label"].split(" (")[0], "dtype": r["dtype"],
             "intensity_flop_per_byte": r["intensity_flop_per_byte"], "tflops": r["tflops"],
             "tbps": r["gbps"] / 1e3, "device": r["device"]} for f in frames for _, r in f.iterrows()]
    return pd.DataFrame(rows, columns=ROOFLINE_COLUMNS)


# What the lab records (reference_runs/h200/results_01b.json holds the H200's): name -> (kind, dtype, FLOP/byte).
# The matmul's intensity is its size's (n/3 FLOP/byte in fp16), recorded beside it as matmul_n.
RECORDED_POINTS = {
    "triton_add_gbps": ("triton add", "fp32", 1 / 12),
    "torch_add_gbps": ("torch.add", "fp32", 1 / 12),
    "cuda_add_gbps": ("CUDA C++ add", "fp32", 1 / 12),
    "triton_softmax_gbps": ("triton softmax", "fp32", SOFTMAX_FLOPS_PER_ELEMENT / 8),
    "torch_softmax_gbps": ("torch.softmax", "fp32", SOFTMAX_FLOPS_PER_ELEMENT / 8),
    "unfused_softmax_gbps": ("unfused torch chain", "fp32", SOFTMAX_FLOPS_PER_ELEMENT / 8),
    "triton_matmul_tflops": ("triton matmul", "fp16", None),
    "cublas_matmul_tflops": ("cuBLAS (a @ b)", "fp16", None),
}


def reference_points(measured: dict[str, float]) -> pd.DataFrame:
    """Roofline points from a run's recorded numbers (``specs.h200_measured("01b")``): bandwidths become TFLOP/s
    at their intensity, the matmuls sit at n/3 FLOP/byte. Empty when the run recorded none of them."""
    rows = []
    n = measured.get("matmul_n")
    for name, (kind, dtype, intensity) in RECORDED_POINTS.items():
        if name not in measured or not (n or name.endswith("_gbps")):  # a matmul's intensity needs matmul_n
            continue
        if name.endswith("_gbps"):
            tbps = measured[name] / 1e3
            tflops = tbps * intensity
        else:
            intensity = matmul_flops(int(n), int(n), int(n)) / matmul_bytes(int(n), int(n), int(n), 2)
            tflops, tbps = measured[name], math.nan
        rows.append({"label": f"H200 {kind}", "kind": f"H200 {kind}", "dtype": dtype,
                     "intensity_flop_per_byte": intensity, "tflops": tflops, "tbps": tbps, "device": "H200 reference"})
    return pd.DataFrame(rows, columns=ROOFLINE_COLUMNS)
