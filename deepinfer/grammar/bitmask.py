"""Token bitmasks: allocate them and apply them to logits (CPU-tuned here; other devices go to
bitmask_device.py's torch path).

Layout (the same as xgrammar's): int32 [B, ceil(V/32)], bit (t % 32) of word (t // 32) set means
token t is allowed. Applying sets every disallowed logit to -inf; bits past the logits width are
ignored, so logits wider than the tokenizer are masked exactly where the matcher left bits 0.

`apply_token_bitmask_` on fp32 logits with dense rows runs the native kernel (kernels/csrc/bitmask.c:
one pass over the words, logits set to -inf in place; the torch paths below took 50-120 ms per step on
64 rows of a 49k vocabulary in the extraction job, allocating several copies of the logits). Without
the native library, or for other dtypes, it picks a torch path from the mask itself. A structural state of constrained
decoding allows a handful of tokens (nearly every word 0): save those logits, fill the rows with
-inf, put them back. A free-text state disallows a handful (nearly every word all-ones): unpack
just those words and scatter -inf. Any other mask is expanded through a 256-entry byte table of
additive values (0 or -inf) with one gather and added to the logits: a vectorised add is several
times faster on CPU than masked_fill_ with a bool mask. Adding -inf equals setting -inf for every
logit except +inf/NaN (which become NaN): logits must not hold +inf/NaN where masked.
"""

from __future__ import annotations

from typing import Sequence

import torch

from deepinfer.errors import InvalidRequestError
from deepinfer_kernels import bitmask as native_bitmask

_NEG_INF = float("-inf")
# _BYTE_DISALLOWED[b, k]: bit k of byte b is 0. A little-endian int32 word viewed as 4 bytes
# gives its bits 0-7, 8-15, ... in order, so a byte-wise gather unpacks tokens in id order.
_BYTE_DISALLOWED = ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1) == 0
# the same table as additive float values: 0.0 where allowed, -inf where disallowed
_BYTE_ADD = torch.zeros(256, 8).masked_fill_(_BYTE_DISALLOWED, float("-inf"))
# below this share of words holding any allowed token, save-fill-restore beats the table add
_SPARSE_SHARE = 1 / 16


def bitmask_words(vocab_size: int) -> int:
    """Words per bitmask row: ceil(vocab_size / 32)."""
    return (vocab_size + 31) // 32


def allocate_token_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """An int32 [batch, ceil(vocab_size/32)] bitmask with every token allowed."""
    if batch < 1 or vocab_size < 1:
        raise InvalidRequestError(f"bitmask needs batch >= 1 and vocab_size >= 1, got {batch}, {vocab_size}")
    return torch.full((batch, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def _check(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise InvalidRequestError(f"logits and bitmask must be 2-D, got {tuple(logits.shape)} and {tuple(bitmask.shape)}")
    if bitmask.dtype != torch.int32:
        raise InvalidRequestError(f"bitmask must be int32, got {bitmask.dtype}")
    if logits.device.type != "cpu" or bitmask.device.type != "cpu":
        raise InvalidRequestError("apply_token_bitmask_ is the CPU path: logits and bitmask must be on the CPU")
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise InvalidRequestError(
            f"bitmask covers {bitmask.shape[1] * 32} tokens, fewer than the logits' {logits.shape[1]}"
        )
    if bitmask.shape[0] < logits.shape[0]:
        raise InvalidRequestError(f"bitmask has {bitmask.shape[0]} rows, fewer than the logits' {logits.shape[0]}")


def _rows_tensor(rows: Sequence[int] | torch.Tensor | None, batch: int) -> torch.Tensor | None:
    if rows is None:
        return None
    t = torch.as_tensor(rows, dtype=torch.int64).reshape(-1)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= batch):
        raise InvalidRequestError(f"rows {t.tolist()} out of range for batch {batch}")
    return t


def apply_token_bitmask_(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor | None = None
) -> None:
    """In place: logits[r, t] = -inf wherever bit t of bitmask[r] is 0, for r in rows (all rows
    when None; other rows are untouched). logits: float [B, V] on CPU; bitmask: int32
    [>= B, >= ceil(V/32)] (row r of the bitmask belongs to row r of the logits, so a bitmask
    allocated for the largest batch serves every smaller one)."""
    if logits.device.type != "cpu" or bitmask.device.type != "cpu":
        from deepinfer.grammar.bitmask_device import apply_token_bitmask_device_

        apply_token_bitmask_device_(logits, bitmask, rows)  # CUDA logits: the device-generic torch path
        return
    _check(logits, bitmask)
    B, V = logits.shape
    rows_t = _rows_tensor(rows, B)
    if native_bitmask.apply_(logits, bitmask, torch.arange(B) if rows_t is None else rows_t):
        return
    m = bitmask[:B] if rows_t is None else bitmask.index_select(0, rows_t)
    R = m.shape[0]
    if R == 0:
        return
    Wf = V // 32
    if V % 32:  # the tail word covers fewer than 32 logits: the table add on that slice
        _add_table(logits[:, Wf * 32 :], m[:, Wf : Wf + 1], rows_t)
    if Wf == 0:
        return
    m = m[:, :Wf]
    l3 = logits[:, : Wf * 32].view(B, Wf, 32)  # one row of 32 logits per mask word
    ridx = torch.arange(R) if rows_t is None else rows_t
    budget = _SPARSE_SHARE * R * Wf
    some_allowed = m != 0
    if int(some_allowed.sum()) <= budget:
        # structural state: keep the few words with allowed tokens, fill the rest
        r, w = some_allowed.nonzero(as_tuple=True)
        kept = l3[ridx[r], w].add_(_word_table(m[r, w]))
        if rows_t is None:
            l3.fill_(_NEG_INF)
        else:
            l3.index_fill_(0, rows_t, _NEG_INF)
        l3[ridx[r], w] = kept
        return
    some_disallowed = m != -1
    n = int(some_disallowed.sum())
    if n == 0:
        return
    if n <= budget:  # free-text state: touch only the words with disallowed tokens
        r, w = some_disallowed.nonzero(as_tuple=True)
        l3[ridx[r], w] = l3[ridx[r], w].add_(_word_table(m[r, w]))
        return
    _add_table(logits[:, : Wf * 32], m, rows_t)


def _word_table(words: torch.Tensor) -> torch.Tensor:
    """float [n, 32]: 0 where the bit of words[i] is set, -inf where clear."""
    idx = words.contiguous().view(torch.uint8).to(torch.int32)
    return _BYTE_ADD.index_select(0, idx).view(words.shape[0], 32)


def _add_table(logits: torch.Tensor, m: torch.Tensor, rows_t: torch.Tensor | None) -> None:
    """Dense path: expand every word through the table and add (logits may be a column slice)."""
    R, W = m.shape
    cols = logits.shape[1]
    idx = m.contiguous().view(torch.uint8).to(torch.int32).reshape(-1)
    add = _BYTE_ADD.index_select(0, idx).view(R, W * 32)[:, :cols].to(logits.dtype)
    if rows_t is None:
        logits.add_(add)
    else:
        logits.index_copy_(0, rows_t, logits.index_select(0, rows_t).add_(add))


def apply_token_bitmask_reference_(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor | None = None
) -> None:
    """Straightforward reference of apply_token_bitmask_ (one row at a time, bit by bit)."""
    _check(logits, bitmask)
    B, V = logits.shape
    rows_t = _rows_tensor(rows, B)
    ids = torch.arange(V)
    for r in (range(B) if rows_t is None else rows_t.tolist()):
        bits = (bitmask[r, ids // 32].to(torch.int64) >> (ids % 32)) & 1
        logits[r, bits == 0] = _NEG_INF


def allowed_token_ids(bitmask_row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The token ids whose bits are set in one bitmask row (int64, ascending).

    The row's bytes unpacked least significant bit first (bit k of word w is token 32 w + k on
    this little-endian layout): 13x faster on a full 49152-token row than shifting an arange of the
    vocabulary, which was over half of a complete_within_budget JSON batch's wall time (BudgetGuard
    calls it every step near the budget)."""
    import sys

    import numpy as np

    words = bitmask_row.detach().to("cpu").contiguous()
    if sys.byteorder != "little":  # pragma: no cover - the arithmetic form is layout-independent
        ids = torch.arange(vocab_size)
        return ids[((words[ids // 32].to(torch.int64) >> (ids % 32)) & 1) == 1]
    bits = np.unpackbits(words.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return torch.from_numpy(np.flatnonzero(bits).astype(np.int64, copy=False))
