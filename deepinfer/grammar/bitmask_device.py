"""Token bitmasks on any device: apply a packed int32 mask where the logits live, and move a
step's mask from the host to the device once.

`apply_token_bitmask_device_` is plain torch (unpack 32 bits per word with a shift and an and,
masked_fill): the path for CUDA logits, and the same function CPU tests call. (bitmask.py's
apply_token_bitmask_ keeps its CPU-tuned paths and sends non-CPU tensors here.)

`BitmaskUploader.upload` copies a host mask into a pinned staging buffer and from there to the
device with non_blocking=True, so the copy is queued on the current stream without a host sync;
the buffer is reused next step only after the event recorded behind the previous copy has
completed.
"""

from __future__ import annotations

from typing import Sequence

import torch

from deepinfer.errors import InvalidRequestError

_SHIFTS: dict[str, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    key = str(device)
    t = _SHIFTS.get(key)
    if t is None:
        t = _SHIFTS[key] = torch.arange(32, dtype=torch.int32, device=device)
    return t


def check_device_args(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise InvalidRequestError(f"logits and bitmask must be 2-D, got {tuple(logits.shape)} and {tuple(bitmask.shape)}")
    if bitmask.dtype != torch.int32:
        raise InvalidRequestError(f"bitmask must be int32, got {bitmask.dtype}")
    if logits.device != bitmask.device:
        raise InvalidRequestError(f"logits ({logits.device}) and bitmask ({bitmask.device}) must be on one device")
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise InvalidRequestError(
            f"bitmask covers {bitmask.shape[1] * 32} tokens, fewer than the logits' {logits.shape[1]}"
        )
    if bitmask.shape[0] < logits.shape[0]:
        raise InvalidRequestError(f"bitmask has {bitmask.shape[0]} rows, fewer than the logits' {logits.shape[0]}")


def disallowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [R, vocab]: True where the token's bit is 0 (on the bitmask's device)."""
    words = (vocab + 31) // 32
    bits = (bitmask[:, :words, None] >> _shifts(bitmask.device)) & 1
    return (bits == 0).view(bitmask.shape[0], words * 32)[:, :vocab]


def apply_token_bitmask_device_(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor | None = None
) -> None:
    """In place on logits' device: logits[r, t] = -inf wherever bit t of bitmask[r] is 0, for r in
    rows (all rows when None). The same contract as bitmask.apply_token_bitmask_."""
    check_device_args(logits, bitmask)
    B, V = logits.shape
    if rows is None:
        logits.masked_fill_(disallowed(bitmask[:B], V), float("-inf"))
        return
    r = torch.as_tensor(rows, dtype=torch.int64).reshape(-1)
    if r.numel() == 0:
        return
    if r.device.type == "cpu" and (int(r.min()) < 0 or int(r.max()) >= B):  # no device sync for this check
        raise InvalidRequestError(f"rows {r.tolist()} out of range for batch {B}")
    r = r.to(logits.device, non_blocking=True)
    sub = logits.index_select(0, r).masked_fill_(disallowed(bitmask.index_select(0, r), V), float("-inf"))
    logits.index_copy_(0, r, sub)


class BitmaskUploader:
    """Host bitmask -> device, once per step, through a reused pinned buffer (CUDA only; on the
    CPU the mask is returned as it is)."""

    def __init__(self) -> None:
        self._pinned: torch.Tensor | None = None
        self._event = None  # recorded after the last copy out of the pinned buffer

    def upload(self, bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
        device = torch.device(device)
        if device.type != "cuda":
            return bitmask.to(device)
        if self._event is not None:
            self._event.synchronize()  # the previous step's copy must be done before the buffer is rewritten
        n = bitmask.numel()
        if self._pinned is None or self._pinned.numel() < n:
            self._pinned = torch.empty(max(n, 1), dtype=torch.int32, pin_memory=True)
        staged = self._pinned[:n].view(bitmask.shape)
        staged.copy_(bitmask)
        out = staged.to(device, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()
        return out
