"""Token-bitmask kernels (csrc/bitmask.c) for the grammar layer: apply a mask to fp32 logits in place,
find the one first byte a mask's allowed tokens share (jump-forward's probe), and the allowed token
of least rank (the budget guard's closing path). Each returns False where the native library is
unavailable or the input is not in the kernel's layout; the caller then runs its torch / numpy path (deepinfer/grammar/bitmask.py, grammar/xgrammar_backend.py)."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from . import native


def _configure(lib) -> None:
    i64, fp = ctypes.c_int64, ctypes.c_void_p
    lib.di_apply_bitmask_f32.argtypes = [fp, i64, i64, fp, i64, fp, i64]
    lib.di_apply_bitmask_f32.restype = ctypes.c_int
    lib.di_bitmask_forced_byte.argtypes = [fp, i64, fp, i64]
    lib.di_bitmask_forced_byte.restype = ctypes.c_int
    lib.di_bitmask_min_rank.argtypes = [fp, i64, fp, i64]
    lib.di_bitmask_min_rank.restype = ctypes.c_int64


def _lib():
    """The library, or None without it (the callers then take their torch / numpy paths)."""
    return native.require(_configure) if native.available() else None


def apply_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> bool:
    """logits[r, t] = -inf where bit t of bitmask[r] is clear, for r in rows (int64, in range: the
    caller checked). False (nothing done) unless logits are fp32 CPU with dense rows and the mask a
    contiguous int32 CPU tensor wide enough."""
    lib = _lib()
    if (lib is None or logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.stride(1) != 1
            or bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous()):
        return False
    rows = rows.to(torch.int64).contiguous()
    if rows.numel():
        rc = lib.di_apply_bitmask_f32(logits.data_ptr(), logits.stride(0), logits.shape[1], bitmask.data_ptr(),
                                      bitmask.shape[1], rows.data_ptr(), rows.numel())
        if rc:
            return False
    return True


def forced_byte(words: torch.Tensor, first_byte: np.ndarray) -> int | None | bool:
    """For one mask row (int32 words): the byte every allowed token starts with, None when there is
    no such single byte; False when the kernel cannot run (the caller falls back)."""
    lib = _lib()
    if (lib is None or words.dtype != torch.int32 or words.device.type != "cpu" or not words.is_contiguous()
            or first_byte.dtype != np.int16 or not first_byte.flags["C_CONTIGUOUS"]):
        return False
    b = lib.di_bitmask_forced_byte(words.data_ptr(), words.numel(), first_byte.ctypes.data, len(first_byte))
    return b if b >= 0 else None


def min_rank_token(words: torch.Tensor, rank: torch.Tensor) -> int | None | bool:
    """For one mask row (int32 words): the allowed token id with the smallest rank[id] (ties: the
    lowest id), None when no token is allowed; False when the kernel cannot run (caller falls back).
    rank: int64 [V], V the vocabulary (bits past it are ignored)."""
    lib = _lib()
    if (lib is None or words.dtype != torch.int32 or words.device.type != "cpu" or not words.is_contiguous()
            or rank.dtype != torch.int64 or rank.device.type != "cpu" or not rank.is_contiguous()):
        return False
    t = lib.di_bitmask_min_rank(words.data_ptr(), words.numel(), rank.data_ptr(), rank.numel())
    return t if t >= 0 else None
