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


def assert_same_draws(got: torch.Tensor, ref: torch.Tensor, logits, mask, temp, keys, max_differ: int = 1) -> None:
    """The kernels' inverse-CDF draws equal the reference's except at most max_differ rows, and
    only where the uniform lies within float rounding (1e-6 of the mass) of a CDF step."""
    from deepinfer_kernels.inverse_cdf import row_uniforms
    from deepinfer_kernels.sampling import bitmask_to_bool

    got, ref = got.cpu(), ref.cpu()
    differ = (got != ref).nonzero().squeeze(1).tolist()
    assert len(differ) <= max_differ, f"rows {differ} drew other tokens"
    for b in differ:
        assert float(temp[b]) != 0, "greedy rows must agree exactly"
        x = logits[b].cpu().masked_fill(~bitmask_to_bool(mask[b : b + 1].cpu(), logits.shape[1])[0], float("-inf"))
        cdf = torch.softmax(x / temp[b].cpu(), -1).cumsum(0, dtype=torch.float64)
        target = float(row_uniforms(keys[b : b + 1].cpu(), "cpu")[0]) * float(cdf[-1])
        lo, hi = sorted((int(got[b]), int(ref[b])))
        assert abs(float(cdf[lo]) - target) < 1e-6 or abs(float(cdf[hi - 1]) - target) < 1e-6
