"""Helpers shared by the kernel tests (a uniquely named module: tests/ folders are not packages)."""

import torch


def random_bitmask(gen: torch.Generator, batch: int, vocab: int, p_allow: float = 0.5) -> torch.Tensor:
    """A packed int32 bitmask [batch, ceil(vocab/32)] with each token allowed with p_allow."""
    allowed = torch.rand(batch, vocab, generator=gen) < p_allow
    return pack_bool_mask(allowed)


def pack_bool_mask(allowed: torch.Tensor) -> torch.Tensor:
    """Pack a bool mask [B, V] into xgrammar-layout int32 words (bit j of word w = token 32w+j)."""
    b, v = allowed.shape
    w = (v + 31) // 32
    padded = torch.zeros(b, w * 32, dtype=torch.int64)
    padded[:, :v] = allowed.long()
    words = (padded.view(b, w, 32) << torch.arange(32)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)
