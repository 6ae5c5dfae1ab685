"""The seeded inverse-CDF draw: one uniform per (seed, position), one token per row.

Shared by the engine's sampler (every device) and the masked_sample kernels, so a row draws the
same token whichever path samples it, up to the float rounding of its softmax.

  u(key)   = ((hash32(key ^ 0x5BD1E995) >> 8) + 0.5) / 2**24   exact in float64, never 0 or 1
  draw(x)  = the first token j with cdf[j] > u * cdf[V-1], cdf = the float64 running sum of
             softmax(x) (fp32 probabilities), clamped to V-1

Every op is row-wise, so a row's draw depends only on its own logits and its uniform. Masked
(-inf) tokens have zero mass and are never drawn (the running sum does not rise there).
"""

from __future__ import annotations

import torch

from .rng import hash32, hash32_t

UNIFORM_SALT = 0x5BD1E995
UNIFORM_SCALE = 16777216.0  # 2**24


def row_uniform(key: int) -> float:
    """The uniform of one draw from its 32-bit key (rng.row_key), on Python ints (same bits as
    row_uniforms: the integer is below 2**24 and the scale a power of two, so both are exact)."""
    return ((hash32(key ^ UNIFORM_SALT) >> 8) + 0.5) / UNIFORM_SCALE


def row_uniforms(keys, device) -> torch.Tensor:
    """float64 [B] uniforms from 32-bit keys (a list or an int64 tensor)."""
    k = keys if isinstance(keys, torch.Tensor) else torch.tensor(keys, dtype=torch.long)
    h = hash32_t(k.to(device=device, dtype=torch.long) ^ UNIFORM_SALT)
    return ((h >> 8).to(torch.float64) + 0.5) / UNIFORM_SCALE


def inverse_cdf_sample(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one token per row of x [B, V] from softmax(x) by inverting its CDF at u [B].

    Three passes over the logits (softmax, a float64 cumulative sum, a binary search) rather
    than the per-token noise a Gumbel-max draw needs; fp64 keeps sums over 100k+ tokens exact
    enough that the draw does not drift with the vocabulary size.
    """
    probs = torch.softmax(x, dim=-1)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    target = (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return idx.clamp_(max=x.shape[1] - 1)
