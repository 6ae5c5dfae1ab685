"""Keep freed host memory in the process instead of handing it back to the OS (glibc on Linux).

A CPU forward allocates and frees its activations every step: a 2048-token prefill step of the
default model makes tensors of up to 25 MB (gate|up), and glibc serves every allocation above its
mmap threshold (128 KiB, raised dynamically to the size of the largest chunk freed so far, but
never above 32 MiB) with a fresh mmap and returns it with munmap on free. Every page of such a
buffer is then page-faulted and zeroed by the kernel again on each use. Measured on the extraction job of
benchmarks/structured.py (64 prompts, dtype="quantized", 2-core Zen 5 host): 84k-206k minor page
faults in its 2048-token prefill step and 15k-25k over its 57 decode steps; with the thresholds
below, none, and the 2048-token step took 0.86-0.97 s instead of 1.25-1.33 s.

`keep_freed_memory()` raises the mmap threshold so such buffers come from the heap (and are reused
from it after a free), and the trim threshold so free space at the heap's top stays mapped. The
cost: memory freed by the process stays resident up to its peak use (a step's activations).
It changes no result, only where the bytes live; elsewhere (no glibc) it does nothing.
Not a guarantee: torch allocates with posix_memalign, which asks for a little more than the size, so
a freed chunk of exactly one tensor's size, pinned by a small allocation just after it, does not fit
the next tensor of that size. Seen in the test suite's long-lived, fragmented heap: every 40 MB round
took new heap (tests/engine/test_host_memory.py runs its rounds in a fresh process for that reason).
"""

from __future__ import annotations

import ctypes
import sys

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 256 << 20  # allocations below this come from the heap (a step's largest: 25 MB above)
TRIM_THRESHOLD = 1 << 30  # free space at the heap's top kept mapped up to this

_applied: bool | None = None
mmap_threshold_set: int = 0  # the mmap threshold keep_freed_memory() put in effect (0: none)


def keep_freed_memory() -> bool:
    """Set the process's glibc malloc thresholds (once); True where they are in effect."""
    global _applied, mmap_threshold_set
    if _applied is None:
        _applied = False
        if sys.platform.startswith("linux"):
            try:
                mallopt = ctypes.CDLL(None).mallopt
            except (OSError, AttributeError):  # not glibc (musl has no mallopt)
                return False
            mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            mallopt.restype = ctypes.c_int
            # (glibc versions that cap the threshold at 32 MiB, HEAP_MAX_SIZE / 2, refuse more: take the cap)
            for threshold in (MMAP_THRESHOLD, 32 << 20):
                if mallopt(_M_MMAP_THRESHOLD, threshold):
                    mmap_threshold_set = threshold
                    break
            _applied = bool(mmap_threshold_set) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied
