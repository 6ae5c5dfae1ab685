"""Tensors in memory advised for transparent huge pages (Linux), for weights a kernel streams.

The routed experts of one MoE layer are tens of MB read once per decode step (32 experts of 3 MiB in
benchmarks/moe.py's models): with 4 KiB pages every 4 KiB of a weight panel costs a TLB miss, with
2 MiB pages one per 2 MiB. On kernels whose transparent_hugepage mode is "madvise" (this machine's),
memory gets huge pages only where a process asks with madvise(MADV_HUGEPAGE) before touching it,
which torch's allocator does not do by default. `empty(n)` asks on the 2 MiB-aligned part of a fresh
buffer; where that fails or is not Linux it is a plain torch.empty. The effect is measured side by
side in benchmarks/moe_kernels.py (packed with and without).
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_libc = None


def _madvise():
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _libc.madvise.restype = ctypes.c_int
        except (OSError, AttributeError):
            _libc = False
    return _libc.madvise if _libc else None


def empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of numel elements starting on a 2 MiB boundary, its whole
    2 MiB pages advised for huge pages (best effort: the result is correct either way)."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    madvise = _madvise() if sys.platform.startswith("linux") else None
    if madvise is None or nbytes < HUGE:
        return torch.empty(numel, dtype=dtype)
    buf = torch.empty(nbytes + HUGE, dtype=torch.uint8)
    off = -buf.data_ptr() % HUGE
    madvise(buf.data_ptr() + off, nbytes // HUGE * HUGE, _MADV_HUGEPAGE)  # (a failure leaves 4 KiB pages)
    return buf[off : off + nbytes].view(dtype)


def copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor t in huge-page-advised memory (the view keeps its buffer alive)."""
    out = empty(t.numel(), t.dtype).view(t.shape)
    out.copy_(t)
    return out
