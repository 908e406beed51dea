"""Lab 01b's reference kernels in Triton's language: the vector add, the fused row softmax and the tiled matmul.

Importing this module loads triton for this machine's device first (``kernels.load_triton``: on the CPU it sets
``TRITON_INTERPRET=1``, which must come before the kernels are decorated). Without triton the functions stay plain,
never-run Python (``kernels.MISSING_TRITON``). The checks grade a student's kernels against torch, not against
these; the lab runs these where a student's kernel is not accepted yet, so every later cell still runs."""

from __future__ import annotations

from lab_utils.gpu.bench import resolve_device
from lab_utils.gpu.kernels import load_triton

HERE = load_triton(resolve_device("auto"))
triton, tl = HERE.triton, HERE.tl


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(axis=0)  # which program of the grid this is
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # the BLOCK elements this program owns
    mask = offs < n  # the last program's block runs past n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + y, mask=mask)


@triton.jit
def softmax_kernel(out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(axis=0)  # one program per row
    cols = tl.arange(0, BLOCK)  # BLOCK >= n_cols, a power of two
    mask = cols < n_cols
    x = tl.load(in_ptr + row * in_row_stride + cols, mask=mask, other=-float("inf"))  # exp(-inf) = 0: no weight
    x = x - tl.max(x, axis=0)  # the largest becomes 0: exp cannot overflow
    num = tl.exp(x)
    tl.store(out_ptr + row * out_row_stride + cols, num / tl.sum(num, axis=0), mask=mask)


@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(axis=0)  # this program's tile of C: rows pid_m*BM.., columns pid_n*BN..
    pid_n = tl.program_id(axis=1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)  # accumulate in fp32 whatever the inputs
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + kk[:, None] * stride_bk + rn[None, :] * stride_bn,
                    mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(a, b)  # a BM×BK by BK×BN tile product on the tensor cores
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, c, mask=(rm[:, None] < M) & (rn[None, :] < N))
