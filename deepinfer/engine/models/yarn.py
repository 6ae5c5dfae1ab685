"""YaRN rotary frequencies (the blend of interpolated and extrapolated frequencies over a linear ramp
between the beta_fast / beta_slow correction dimensions) and its cos/sin magnitude factor."""

from __future__ import annotations

import math
from typing import Any

import torch

from deepinfer.engine.moe_config import yarn_mscale


def yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2], attention factor multiplying cos and sin)."""
    orig = float(scaling.get("original_max_position_embeddings") or max_positions)
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else max_positions / orig
    attn = scaling.get("attention_factor")
    if attn is None:
        ms, msa = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn = yarn_mscale(factor, float(ms)) / yarn_mscale(factor, float(msa)) if ms and msa else yarn_mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def corr_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extra = 1 - ramp  # share of the extrapolated (unscaled) frequency
    inv = (1.0 / (factor * pos)) * (1 - extra) + (1.0 / pos) * extra
    return inv, float(attn)
