"""Lab 01b exercises: GPU kernels in Triton's language, graded by running them.

Each kernel check launches the student's ``@triton.jit`` function (compiled on a GPU, Triton's interpreter on CPU
tensors) on awkward sizes (not multiples of the block), with its tensors inside larger buffers whose other elements
hold a known value (``kernels.guarded``): a kernel that reads or writes past the end, as an unmasked last block does,
changes them or reads NaN, and the message names that symptom. Results are compared with torch.

Design notes: docs/internals.md#lab_utilsexerciseslab01bpy
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from lab_utils.exercises.framework import (
    CodeExercise,
    Exercise,
    Wrong,
    close_to,
    integer,
    is_blank,
    run_student,
)
from lab_utils.exercises.lab01 import grading_device
from lab_utils.gpu import kernels
from lab_utils.gpu.kernels import GUARD_FILL, MatmulConfig, guarded

__all__ = ["q1", "q2", "q3", "q4", "q5", "KernelExercise", "triton_unavailable", "GRID_N", "GRID_BLOCK",
           "WARPS_BLOCK", "WARPS"]

NAN = float("nan")


def triton_unavailable() -> str | None:
    """Why the kernel checks cannot run here (triton missing or broken, with the install), or None."""
    here = kernels.load_triton(grading_device())
    return None if here.runs else here.note


def _kernel(value: Any, signature: str) -> Any:
    if not (hasattr(value, "fn") and hasattr(value, "__getitem__")):
        what = "a plain Python function" if callable(value) else f"a {type(value).__name__}"
        raise Wrong(f"expected a Triton kernel: `@triton.jit` above `def {signature}`; got {what}. The check "
                    "launches it as kernel[grid](...)")
    return value


def _launch(call: str, launch: Any, device: str) -> None:
    def run() -> None:
        with warnings.catch_warnings():  # the interpreter's NumPy warns of an overflowing exp: the check says more
            warnings.simplefilter("ignore", RuntimeWarning)
            launch()
            if device.startswith("cuda"):  # a compiled kernel's error shows at the synchronize: in the student's call
                torch.cuda.synchronize()

    run_student(run, call=call, timeout_s=180)


@dataclass
class KernelExercise(CodeExercise):
    """A ``CodeExercise`` whose answer is a ``@triton.jit`` kernel: blank when the function under the decorator
    has only ``...`` in its body (the starting code)."""

    def _outcome(self, value: Any) -> Any:
        if hasattr(value, "fn") and is_blank(value.fn):
            value = None  # the decorated starting code
        if (course := _course_kernel(value)) is not None:
            return self._incorrect(value, f"your answer is {course}, the course's kernel that later cells launch "
                                          f"until yours is accepted: write `{self.var}` yourself")
        return super()._outcome(value)


def _course_kernel(value: Any) -> str | None:
    """The dotted name of the course's kernel that ``value`` is (the object, or the same Python function under another
    ``@triton.jit``), else None. The delegation guard's traps work on Python functions that the answer calls; a
    kernel is compiled from its own source, so being the course's function is what there is to catch."""
    fn = getattr(value, "fn", None)
    if fn is None:
        return None
    from lab_utils.gpu import triton_kernels  # loads triton for this device: only once an answer is a kernel

    for name in ("add_kernel", "softmax_kernel", "matmul_kernel"):
        ref = getattr(triton_kernels, name)
        if value is ref or getattr(fn, "__code__", None) is getattr(ref.fn, "__code__", False):
            return f"lab_utils.gpu.triton_kernels.{name}"
    return None


# --- q1: the vector add ----------------------------------------------------------------------------------

_MASK_FIX = ("mask every load and store of the last program: mask = offs < n; tl.load(x_ptr + offs, mask=mask), "
             "tl.store(out_ptr + offs, ..., mask=mask)")


def _add_sizes(device: str) -> list[tuple[int, int]]:
    sizes = [(1003, 256), (4096, 1024), (1, 128), (5000, 1024)]
    return sizes + ([(2**20 + 7, 1024)] if device.startswith("cuda") else [])


def _grade_add(value: Any) -> str:
    kernel = _kernel(value, "add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr)")
    device = grading_device()
    gen = torch.Generator(device="cpu").manual_seed(11)
    for n, block in _add_sizes(device):
        x = guarded((n,), torch.float32, device, (block,), NAN, torch.randn(n, generator=gen).to(device))
        y = guarded((n,), torch.float32, device, (block,), NAN, torch.randn(n, generator=gen).to(device))
        out = guarded((n,), torch.float32, device, (block,))
        grid = kernels.cdiv(n, block)
        call = f"add_kernel[({grid},)](x, y, out, n={n}, BLOCK={block})"
        _launch(call, lambda x=x, y=y, out=out, b=block: kernels.launch_add(kernel, x.view, y.view, out.view, b),
                device)
        if spilled := out.spilled():
            last = (grid - 1) * block
            one = " One element: is the mask `offs <= n`? Offsets run 0..n-1." if spilled == 1 else ""
            raise Wrong(f"{call} wrote {spilled} element(s) outside `out`: the last of the {grid} programs covers "
                        f"offsets {last}..{last + block - 1}, and only those below n = {n} are out's (on a GPU "
                        f"such a store corrupts other tensors or faults).{one} The fix: {_MASK_FIX}")
        want = x.view + y.view
        got = out.view
        if torch.equal(got, want):
            continue
        untouched = int((got == GUARD_FILL).sum())
        if n > block and torch.equal(got[:block], want[:block]) and untouched == n - block:
            raise Wrong(f"{call}: only out[0:{block}] was written: every program wrote the first block. A program's "
                        "offsets start at its own block: offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)")
        if untouched:
            raise Wrong(f"{call}: {untouched} of out's {n} elements were never written: the {grid} programs "
                        "together must cover offsets 0..n-1, BLOCK each (offs = pid * BLOCK + tl.arange(0, BLOCK))")
        bad = int((got != want).sum())
        i = int((got != want).nonzero()[0])
        raise Wrong(f"{call}: out differs from x + y at {bad} of {n} elements (first at {i}: {float(got[i]):.4g} "
                    f"instead of {float(want[i]):.4g})")
    return f"x + y right on sizes {', '.join(str(n) for n, _ in _add_sizes(device))}, with nothing written past " \
           f"the end ({'compiled for the GPU' if device.startswith('cuda') else 'Triton interpreter'})."


q1 = KernelExercise(
    name="01b.1 the vector add kernel", var="add_kernel", grade=_grade_add,
    signature="add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr)", applicable=triton_unavailable,
    hints=[
        "The launch starts cdiv(n, BLOCK) copies of the kernel (programs); each handles BLOCK consecutive "
        "elements. Which ones? tl.program_id(0) tells a program its number.",
        "A program's element indices are its number times BLOCK, plus tl.arange(0, BLOCK). When n is not a multiple "
        "of BLOCK, the last program's indices run past n: those lanes must neither load nor store.",
        "Build a boolean mask by comparing the indices with n (strictly less than), and pass it as mask= to both "
        "tl.load calls and to the tl.store of the sum.",
    ],
    solution_text=(
        "@triton.jit\n"
        "def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):\n"
        "    pid = tl.program_id(axis=0)\n"
        "    offs = pid * BLOCK + tl.arange(0, BLOCK)\n"
        "    mask = offs < n\n"
        "    x = tl.load(x_ptr + offs, mask=mask)\n"
        "    y = tl.load(y_ptr + offs, mask=mask)\n"
        "    tl.store(out_ptr + offs, x + y, mask=mask)\n"),
)

# --- q2: the grid -----------------------------------------------------------------------------------------

GRID_N, GRID_BLOCK = 1_000_003, 1024  # elements, elements per program

q2 = Exercise(
    name="01b.2 programs in the grid", var="n_programs",
    grade=close_to(
        -(-GRID_N // GRID_BLOCK), rel=1e-9, reveal=False,
        why=f"Every one of the {GRID_N:,} elements needs a program, and each program covers {GRID_BLOCK}.",
        slips={
            (GRID_N // GRID_BLOCK) / -(-GRID_N // GRID_BLOCK):
                "one short: n // BLOCK rounds down and drops the last, partial block (its 3 elements would never be "
                "added). Round up: triton.cdiv(n, BLOCK) = (n + BLOCK - 1) // BLOCK.",
            GRID_N / -(-GRID_N // GRID_BLOCK): "that is one program per element (CUDA's one thread per element); a "
                                               "Triton program handles a whole BLOCK of them.",
            (GRID_N / GRID_BLOCK) / -(-GRID_N // GRID_BLOCK): "a grid counts whole programs: round n / BLOCK up.",
        },
    ),
    hints=[
        "Each program covers BLOCK consecutive elements; the programs together must cover all n.",
        "n / BLOCK is not a whole number here: the last program is only partly used (its mask switches off the "
        "rest), but it must exist.",
        "Round up: (n + BLOCK - 1) // BLOCK, which is what triton.cdiv(n, BLOCK) computes.",
    ],
    solution_text=f"n_programs = ({GRID_N} + {GRID_BLOCK} - 1) // {GRID_BLOCK}   # = triton.cdiv(n, BLOCK) = "
                  f"{-(-GRID_N // GRID_BLOCK)}: the last program covers 3 elements, its mask the other {1024 - 3}",
)


# --- q3: CUDA threads per Triton program ---------------------------------------------------------------------------

WARPS_BLOCK, WARPS = 1024, 4  # a program's BLOCK and its num_warps


def _grade_per_thread(value: Any) -> None:
    got = integer(value, "elements per thread")
    want = WARPS_BLOCK // (WARPS * 32)
    if got == want:
        return
    slips = {WARPS_BLOCK // WARPS: "that is per warp; a warp is 32 threads, each holding its own share.",
             WARPS_BLOCK // 32: "that divides by one warp's 32 threads; the program has num_warps warps.",
             WARPS * 32: "that is the number of threads of the program; the question asks for elements per thread.",
             WARPS_BLOCK: "that is the whole block: the program's threads share it."}
    raise Wrong(slips.get(got, f"not {got}: the BLOCK's elements are spread evenly over the program's threads "
                               "(num_warps warps of 32 threads)."))


q3 = Exercise(
    name="01b.3 elements per CUDA thread", var="elements_per_thread", grade=_grade_per_thread,
    hints=[
        "A Triton program runs as one CUDA thread block of num_warps warps; a warp is 32 threads.",
        f"num_warps = {WARPS}: {WARPS} × 32 = {WARPS * 32} threads share the program's {WARPS_BLOCK} elements evenly.",
        "Divide the block's elements by the program's threads (num_warps × 32).",
    ],
    solution_text=f"elements_per_thread = {WARPS_BLOCK} // ({WARPS} * 32)   # = {WARPS_BLOCK // (WARPS * 32)}: each "
                  "thread loads them in one vectorized access (the CUDA version has 1 per thread)",
)


# --- q4: the fused row softmax ---------------------------------------------------------------------------------


def _softmax_with_zero_padding(x: torch.Tensor, block: int) -> torch.Tensor:
    """What a kernel that loads the masked lanes as 0 (``other=0``) computes: each of the block's
    ``block - n_cols`` extra lanes adds exp(0 - max) to the denominator."""
    m = torch.clamp(x.max(dim=1, keepdim=True).values, min=0.0)
    e = torch.exp(x - m)
    return e / (e.sum(dim=1, keepdim=True) + (block - x.shape[1]) * torch.exp(-m))


def _grade_softmax(value: Any) -> str:
    kernel = _kernel(value, "softmax_kernel(out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols, BLOCK)")
    device = grading_device()
    gen = torch.Generator(device="cpu").manual_seed(12)
    for rows, cols in [(7, 1000), (5, 1024), (3, 1), (4, 129)] + ([(64, 3000)] if device.startswith("cuda") else []):
        block = kernels.softmax_block(cols)
        values = 3 * torch.randn(rows, cols, generator=gen)
        big_row = 1 if rows > 1 else 0
        values[big_row] += 100.0  # exp(100) overflows float32: only a kernel that subtracts the max survives it
        # rows longer than n_cols in memory (strides cols + 2*block and cols + 2*block + 16): a kernel that steps
        # rows by n_cols, or by the input's stride in the output, lands in the wrong place
        x = guarded((rows, cols), torch.float32, device, (0, block), NAN, values.to(device))
        out = guarded((rows, cols), torch.float32, device, (1, block + 8))
        call = (f"softmax_kernel[({rows},)](out, x, in_row_stride={x.view.stride(0)}, out_row_stride="
                f"{out.view.stride(0)}, n_cols={cols}, BLOCK={block})")
        _launch(call, lambda x=x, out=out: kernels.launch_softmax(kernel, x.view, out.view), device)
        got, want = out.view, torch.softmax(x.view, dim=1)
        if spilled := out.spilled():
            raise Wrong(f"{call} wrote {spilled} element(s) outside the rows of `out` ({rows} rows of {cols}; a "
                        f"program's {block} lanes run past n_cols = {cols}): mask the store with cols < n_cols, "
                        "and step rows by out_row_stride")
        nonfinite = [r for r in range(rows) if not torch.isfinite(got[r]).all()]
        if nonfinite == [big_row]:
            raise Wrong(f"{call}: row {big_row} (values near 100) came out NaN/inf: exp(100) overflows float32 "
                        "(its largest is about 3.4e38 = exp(88.7)). Subtract the row's max before exp: softmax "
                        "is unchanged, and the largest exponent becomes exp(0) = 1.")
        rows_ok = [bool(torch.allclose(got[r], want[r], rtol=1e-4, atol=1e-6)) for r in range(rows)]
        if rows_ok[0] and not all(rows_ok):
            raise Wrong(f"{call}: row 0 is right, row {rows_ok.index(False)} is not: row r starts at "
                        "in_ptr + r * in_row_stride and goes to out_ptr + r * out_row_stride (the strides, not "
                        f"n_cols: these rows are {cols} long and {x.view.stride(0)} apart in memory)")
        if nonfinite:
            raise Wrong(f"{call}: NaN in row {nonfinite[0]}: the kernel read memory past the row's end (here it "
                        "holds NaN; on a GPU, whatever lies there). Mask the load with cols < n_cols, and give the "
                        "masked lanes other=-float('inf') so that they add exp(-inf) = 0 to the sum.")
        if torch.allclose(got, want, rtol=1e-4, atol=1e-6):
            continue
        if block > cols and torch.allclose(got, _softmax_with_zero_padding(x.view, block), rtol=1e-4, atol=1e-6):
            raise Wrong(f"{call}: each row sums to less than 1: the {block - cols} masked lanes were loaded as 0 "
                        "(tl.load's other=0) and their exp counts in the sum. Load them as other=-float('inf'): "
                        "they then drop out of the max and add exp(-inf) = 0 to the sum.")
        err = float((got - want).abs().max())
        raise Wrong(f"{call}: out differs from torch.softmax(x, dim=1) (largest difference {err:.3g}): x - max, "
                    "exp, the sum over the row, then divide")
    return ("softmax right on awkward rows (1, 129, 1000, 1024 columns, rows apart in memory, one row near 100), "
            "nothing written outside the rows.")


q4 = KernelExercise(
    name="01b.4 the fused row softmax", var="softmax_kernel", grade=_grade_softmax,
    signature="softmax_kernel(out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols, BLOCK: tl.constexpr)",
    applicable=triton_unavailable,
    hints=[
        "One program per row: row = tl.program_id(0). The row's elements start at in_ptr + row * in_row_stride; "
        "tl.arange(0, BLOCK) gives each lane its column (cols), BLOCK being the next power of two at or above n_cols.",
        "Lanes with cols >= n_cols are not the row's: mask them, and load them as -inf so that they lose the max "
        "and add exp(-inf) = 0 to the sum. Subtract the row's max (tl.max(x, axis=0)) before tl.exp: exp(100) "
        "overflows float32.",
        "Load the row with that mask and other=-float('inf'); subtract its max; take tl.exp; divide by the tl.sum "
        "over axis 0; store at out_ptr + row * out_row_stride + cols with the same mask.",
    ],
    solution_text=(
        "@triton.jit\n"
        "def softmax_kernel(out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols, BLOCK: tl.constexpr):\n"
        "    row = tl.program_id(axis=0)\n"
        "    cols = tl.arange(0, BLOCK)\n"
        "    mask = cols < n_cols\n"
        "    x = tl.load(in_ptr + row * in_row_stride + cols, mask=mask, other=-float('inf'))\n"
        "    x = x - tl.max(x, axis=0)\n"
        "    num = tl.exp(x)\n"
        "    tl.store(out_ptr + row * out_row_stride + cols, num / tl.sum(num, axis=0), mask=mask)\n"),
)


# --- q5: the tiled matmul ----------------------------------------------------------------------------------


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool(((got.float() - want).abs() <= 1e-2 + 2e-3 * want.abs()).all())  # fp16 output: 11-bit mantissa


def _grade_matmul(value: Any) -> str:
    kernel = _kernel(value, "matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, ..., BM, BN, BK)")
    device = grading_device()
    gen = torch.Generator(device="cpu").manual_seed(13)
    cases = [(100, 70, 90, MatmulConfig(32, 32, 32)), (64, 64, 64, MatmulConfig(32, 32, 32)),
             (33, 17, 50, MatmulConfig(16, 16, 16))]
    for m, n, k, cfg in cases + ([(300, 200, 130, MatmulConfig(64, 64, 32))] if device.startswith("cuda") else []):
        a = guarded((m, k), torch.float16, device, (cfg.bm, cfg.bk), NAN,
                    torch.randn(m, k, generator=gen).half().to(device))
        b = guarded((k, n), torch.float16, device, (cfg.bk, cfg.bn), NAN,
                    torch.randn(k, n, generator=gen).half().to(device))
        c = guarded((m, n), torch.float16, device, (cfg.bm, cfg.bn))
        grid = (kernels.cdiv(m, cfg.bm), kernels.cdiv(n, cfg.bn))
        call = f"matmul_kernel[{grid}](a, b, c, M={m}, N={n}, K={k}, ..., {cfg})"
        _launch(call, lambda a=a, b=b, c=c, cfg=cfg: kernels.launch_matmul(kernel, a.view, b.view, c.view, cfg),
                device)
        want = a.view.float() @ b.view.float()
        got = c.view
        if spilled := c.spilled():
            raise Wrong(f"{call} wrote {spilled} element(s) outside C ({m}x{n}; the edge tiles run past M and N): "
                        "mask the store with (rm[:, None] < M) & (rn[None, :] < N)")
        if torch.isnan(got).any():
            raise Wrong(f"{call}: NaN in C: a load read outside A or B (the edge tiles of M and N, or the last "
                        f"K step: K = {k} is not a multiple of BK = {cfg.bk}; here that memory holds NaN, on a GPU "
                        "whatever lies there). Mask both loads, with other=0.0 so that the extra lanes add nothing.")
        if _close(got, want):
            continue
        last = (kernels.cdiv(k, cfg.bk) - 1) * cfg.bk
        if last > 0 and _close(got, a.view[:, last:].float() @ b.view[last:, :].float()):
            raise Wrong(f"{call}: C holds only the last K step's product (k = {last}..{k - 1}): add each step's "
                        "tile product to the accumulator (acc += tl.dot(a, b)), made once before the loop")
        if (got == GUARD_FILL).any():
            raise Wrong(f"{call}: some tiles of C were never written: program_id(0) numbers the tiles along M "
                        f"(grid[0] = cdiv(M, BM) = {grid[0]}), program_id(1) those along N ({grid[1]})")
        err = float((got.float() - want).abs().max())
        raise Wrong(f"{call}: C differs from A @ B (largest difference {err:.3g}): each program's tile is "
                    "rows pid_m*BM.. and columns pid_n*BN.., summed over K in steps of BK")
    return "A @ B right on awkward sizes (M, N, K not multiples of the tiles), nothing written outside C."


q5 = KernelExercise(
    name="01b.5 the tiled matmul", var="matmul_kernel", grade=_grade_matmul,
    signature="matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, "
              "stride_cm, stride_cn, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr)",
    applicable=triton_unavailable,
    hints=[
        "Each program computes one BM×BN tile of C: its rows start at tl.program_id(0) * BM, its columns at "
        "tl.program_id(1) * BN. It walks K in steps of BK, multiplying a BM×BK tile of A by a BK×BN tile of B.",
        "Start from an fp32 accumulator of zeros, shape (BM, BN). A tile's addresses are 2-D: the rows as a column "
        "(rm[:, None]) times the row stride, plus the columns as a row times the column stride. The edge tiles run "
        "past M, N and K: mask the loads (other=0.0, so extra lanes add 0) and the store.",
        "In the loop over K: this step's K indices, two masked loads, and the accumulator grows by tl.dot of the two "
        "tiles. After the loop, cast it to C's element type (c_ptr.dtype.element_ty) and store it, masked to rows "
        "below M and columns below N.",
    ],
    solution_text=(
        "@triton.jit\n"
        "def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,\n"
        "                  stride_cm, stride_cn, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):\n"
        "    pid_m, pid_n = tl.program_id(axis=0), tl.program_id(axis=1)\n"
        "    rm = pid_m * BM + tl.arange(0, BM)\n"
        "    rn = pid_n * BN + tl.arange(0, BN)\n"
        "    acc = tl.zeros((BM, BN), dtype=tl.float32)\n"
        "    for k0 in range(0, K, BK):\n"
        "        kk = k0 + tl.arange(0, BK)\n"
        "        a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :] * stride_ak,\n"
        "                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)\n"
        "        b = tl.load(b_ptr + kk[:, None] * stride_bk + rn[None, :] * stride_bn,\n"
        "                    mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)\n"
        "        acc += tl.dot(a, b)\n"
        "    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),\n"
        "             mask=(rm[:, None] < M) & (rn[None, :] < N))\n"),
)

