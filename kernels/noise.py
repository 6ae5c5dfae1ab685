"""Elementwise Gumbel noise from 32-bit hashes: the sampling kernels' noise, exposed alone.

noise_tilelang(h) == rng.gumbel_portable_from_hash(h) bit for bit; tests run it over every
distinct uniform value (2**23 of them) on CPU and GPU to pin the portable maths down.
"""

# No "from __future__ import annotations": TileLang evaluates the kernel signatures at build time.

import torch

from . import _tilelang


def build_cpu():
    import tilelang.cpu.language as T  # noqa: PLC0415 - optional dependency

    from .tl_math import C_PRELUDE, make_math  # noqa: PLC0415

    M = make_math(cuda=False)
    N = T.dynamic("N")

    @T.prim_func
    def gumbel_noise_cpu(h: T.Tensor((N,), "int64"), out: T.Tensor((N,), "float32")):
        with T.Kernel(1, prelude=C_PRELUDE) as _:
            for i in T.serial(N):
                out[i] = M.gumbel_from_hash(T.Cast("uint32", h[i]))

    return gumbel_noise_cpu


def build_gpu(threads: int = 256):
    import tilelang.language as T  # noqa: PLC0415 - optional dependency

    from .tl_math import make_math  # noqa: PLC0415

    M = make_math(cuda=True)
    N = T.dynamic("N")

    @T.prim_func
    def gumbel_noise_gpu(h: T.Tensor((N,), "int64"), out: T.Tensor((N,), "float32")):
        with T.Kernel(T.ceildiv(N, threads), threads=threads) as bx:
            for t in T.Parallel(threads):
                if bx * threads + t < N:
                    out[bx * threads + t] = M.gumbel_from_hash(T.Cast("uint32", h[bx * threads + t]))

    return gumbel_noise_gpu


def noise_tilelang(h: torch.Tensor) -> torch.Tensor:
    """Gumbel noise float32 for int64 hashes in [0, 2**32), on h's device (1-D)."""
    cuda = h.is_cuda
    kern = _tilelang.compile_cached(("noise", "cuda" if cuda else "c"), build_gpu if cuda else build_cpu, "cuda" if cuda else "c")
    out = torch.empty(h.shape, dtype=torch.float32, device=h.device)
    if h.numel():
        kern(h.contiguous(), out)
    return out
