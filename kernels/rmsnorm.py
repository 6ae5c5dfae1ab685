"""RMSNorm fused with the residual add: (x, residual, weight, eps) -> (normed, x + residual).

  h = x + residual  (rounded to x's dtype, as an unfused model would store it)
  normed = h * rsqrt(mean(h**2) + eps) * weight, computed in float32, stored in x's dtype

One row per program instance (a thread block on GPU, an outer-loop iteration on CPU), so a
row's result never depends on which other rows share the batch. Implementations: the torch
reference (runtime fallback), a GPU-style TileLang kernel (row in a register fragment, block
reduction) and its CPU twin (target "c", float32 only).
"""

# No "from __future__ import annotations": TileLang evaluates the kernel signatures at build time.

import torch

from . import _checks, _tilelang
from .errors import KernelInputError

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TL_DTYPE = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def check_args(x, residual, weight, eps) -> None:
    """Validate shapes, dtypes and eps; raises KernelInputError naming the problem."""
    _checks.tensor("x", x, 2, _DTYPES)
    _checks.tensor("residual", residual, 2, (x.dtype,))
    _checks.tensor("weight", weight, 1, _DTYPES)
    _checks.same_device(x=x, residual=residual, weight=weight)
    if residual.shape != x.shape:
        raise KernelInputError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    _checks.dim("weight", weight, 0, x.shape[1], "hidden size of x")
    if x.shape[1] == 0:
        raise KernelInputError("hidden size must be positive")
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise KernelInputError(f"eps must be a positive number, got {eps!r}")


def fused_add_rmsnorm_reference(x, residual, weight, eps: float):
    """The torch definition; returns (normed, x + residual) in x's dtype."""
    h = x + residual
    hf = h.float()
    inv = torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return ((hf * inv) * weight.float()).to(x.dtype), h


def gpu_threads(hidden: int) -> int:
    """Threads per row block: the largest of 256/128/64/32 dividing hidden (fragments need it)."""
    for nt in (256, 128, 64, 32):
        if hidden % nt == 0:
            return nt
    raise KernelInputError(f"GPU fused_add_rmsnorm needs hidden % 32 == 0, got {hidden}")


def build_cpu(hidden: int, eps: float):
    """CPU twin (target "c", float32): one row per outer-loop iteration, serial loops."""
    import tilelang.cpu.language as T  # noqa: PLC0415 - optional dependency

    from .tl_math import C_PRELUDE, make_math  # noqa: PLC0415

    M = make_math(cuda=False)
    R = T.dynamic("R")
    D = hidden

    @T.prim_func
    def fused_add_rmsnorm_cpu(
        x: T.Tensor((R, D), "float32"),
        residual: T.Tensor((R, D), "float32"),
        weight: T.Tensor((D,), "float32"),
        normed: T.Tensor((R, D), "float32"),
        res_out: T.Tensor((R, D), "float32"),
    ):
        with T.Kernel(R, prelude=C_PRELUDE) as row:
            acc = T.alloc_local((1,), "float32")
            inv = T.alloc_local((1,), "float32")
            acc[0] = T.float32(0)
            for i in T.serial(D):
                res_out[row, i] = x[row, i] + residual[row, i]
                acc[0] = acc[0] + res_out[row, i] * res_out[row, i]
            inv[0] = M.inv_rms(acc[0], D, eps)
            for i in T.serial(D):
                normed[row, i] = M.rms_scale(res_out[row, i], inv[0], weight[i])

    return fused_add_rmsnorm_cpu


def build_gpu(hidden: int, eps: float, dtype: str = "float32"):
    """GPU kernel: one block per row, the row in a register fragment, one block-wide sum."""
    import tilelang.language as T  # noqa: PLC0415 - optional dependency

    from .tl_math import make_math  # noqa: PLC0415

    M = make_math(cuda=True)
    R = T.dynamic("R")
    D = hidden
    NT = gpu_threads(hidden)

    @T.prim_func
    def fused_add_rmsnorm_gpu(
        x: T.Tensor((R, D), dtype),
        residual: T.Tensor((R, D), dtype),
        weight: T.Tensor((D,), dtype),
        normed: T.Tensor((R, D), dtype),
        res_out: T.Tensor((R, D), dtype),
    ):
        with T.Kernel(R, threads=NT) as row:
            h = T.alloc_fragment((D,), "float32")
            sq = T.alloc_fragment((D,), "float32")
            ss = T.alloc_fragment((1,), "float32")
            for i in T.Parallel(D):
                # Round the sum to the storage dtype first, like an unfused residual stream.
                res_out[row, i] = x[row, i] + residual[row, i]
                h[i] = T.Cast("float32", x[row, i] + residual[row, i])
                sq[i] = h[i] * h[i]
            T.reduce_sum(sq, ss, dim=0)
            for i in T.Parallel(D):
                normed[row, i] = T.Cast(dtype, M.rms_scale(h[i], M.inv_rms(ss[0], D, eps), T.Cast("float32", weight[i])))

    return fused_add_rmsnorm_gpu


def fused_add_rmsnorm_tilelang(x, residual, weight, eps: float):
    """Run the TileLang kernel for the tensors' device; returns (normed, x + residual).

    Compiles once per (device kind, hidden size, eps, dtype); rows are dynamic.
    """
    cuda = x.is_cuda
    d = x.shape[1]
    if not cuda and x.dtype != torch.float32:
        raise KernelInputError(f"the CPU TileLang fused_add_rmsnorm supports float32 only, got {x.dtype}")
    tdt = _TL_DTYPE[x.dtype]
    if cuda:
        kern = _tilelang.compile_cached(("rmsnorm", "cuda", d, eps, tdt), lambda: build_gpu(d, eps, tdt), "cuda")
    else:
        kern = _tilelang.compile_cached(("rmsnorm", "c", d, eps), lambda: build_cpu(d, eps), "c")
    normed = torch.empty_like(x)
    res_out = torch.empty_like(x)
    if x.shape[0]:
        kern(x.contiguous(), residual.contiguous(), weight.to(x.dtype).contiguous(), normed, res_out)
    return normed, res_out
