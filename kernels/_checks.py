"""Small input validators shared by the kernel entry points (they raise KernelInputError)."""

from __future__ import annotations

import torch

from .errors import KernelInputError


def tensor(name: str, t, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise KernelInputError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise KernelInputError(f"{name} must have dtype {names}, got {str(t.dtype).removeprefix('torch.')}")


def same_device(**ts: torch.Tensor) -> torch.device:
    devs = {str(t.device) for t in ts.values()}
    if len(devs) != 1:
        detail = ", ".join(f"{k} on {t.device}" for k, t in ts.items())
        raise KernelInputError(f"all tensors must be on one device: {detail}")
    return next(iter(ts.values())).device


def dim(name: str, t: torch.Tensor, axis: int, expected: int, why: str) -> None:
    if t.shape[axis] != expected:
        raise KernelInputError(f"{name}.shape[{axis}] must be {expected} ({why}), got {t.shape[axis]}")
