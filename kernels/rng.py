"""Counter-based random numbers shared by the engine's sampler and the sampling kernels.

A draw depends only on (seed, position, token index), never on the batch around it: this is what
makes seeded sampling batch-independent. The hash is 32-bit integer arithmetic so that a CUDA or
C kernel computes the very same bits as this torch reference. Computed in int64 with explicit
masking because torch has no full uint32 arithmetic.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF


def hash32(x: int) -> int:
    """The per-element 32-bit mixer (a "lowbias32"-style avalanche), on Python ints."""
    x &= MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    x ^= x >> 16
    return x


def hash32_t(x: torch.Tensor) -> torch.Tensor:
    """hash32 on an int64 tensor holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    x = x ^ (x >> 16)
    return x


def row_key(seed: int, position: int) -> int:
    """The 32-bit key of one sampling draw: one request's seed at one output position."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    return hash32(hash32(hash32(s & MASK32) ^ (s >> 32)) ^ hash32(position & MASK32))


_TOKEN_HASH_CACHE: dict[tuple[int, str], torch.Tensor] = {}


def token_hashes(vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """hash32(token index) for every token, cached per (vocab, device)."""
    key = (vocab_size, str(device))
    t = _TOKEN_HASH_CACHE.get(key)
    if t is None:
        t = hash32_t(torch.arange(vocab_size, dtype=torch.int64, device=device) + 0x9E3779B9)
        _TOKEN_HASH_CACHE[key] = t
    return t


def uniform_from_keys(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform floats in (0, 1), shape [B, V], from int64 row keys [B]: u = (h >> 8 + 0.5) / 2**24."""
    th = token_hashes(vocab_size, keys.device)
    h = hash32_t(keys[:, None] ^ th[None, :])
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)


def gumbel_from_keys(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise -log(-log(u)), shape [B, V], fp32."""
    u = uniform_from_keys(keys, vocab_size)
    return -torch.log(-torch.log(u))
