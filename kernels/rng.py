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


# --------------------------------------------------------------------------------------------
# Portable noise: bit-identical on torch CPU, torch CUDA, and the C / CUDA sampling kernels.
#
# Gumbel noise through torch.log would not do: its last bit differs between torch's CPU (SLEEF,
# vector vs. scalar tail), CUDA's logf and a C compiler's libm (about 7% of float32 inputs differ
# by one ulp here), so a kernel could not reproduce it bit for bit; and a 24-bit uniform
# ((h >> 8) + 0.5) / 2**24 rounds up to 1.0 for the top value, making that token's noise +inf.
# The portable noise below avoids both: u uses 23 bits so (k + 0.5) is exact and u < 1, and
# log is a fixed sequence of IEEE float32 operations (+, -, *, / and bit casts), each rounded
# once, which every backend evaluates the same way. kernels/tl_math.py is its TileLang twin;
# any change here must be made there too (tests/kernels checks them against each other
# exhaustively over all 2**23 uniform values).
# --------------------------------------------------------------------------------------------

import struct as _struct


def _f32(x: float) -> float:
    """Round a Python float to the nearest float32 (constants must be identical everywhere)."""
    return _struct.unpack("f", _struct.pack("f", x))[0]


def f32_bits(x: float) -> int:
    """The float32 bit pattern of x (rounded to nearest), as a signed int32 value."""
    return _struct.unpack("i", _struct.pack("f", x))[0]


# log(m) = 2s + 2s * R(s*s), s = (m - 1) / (m + 1): the odd atanh series, truncated after s**9
# (|s| <= 0.1716, so the first dropped term is below 2e-9 relative).
LOG_C3 = _f32(1.0 / 3.0)
LOG_C5 = _f32(1.0 / 5.0)
LOG_C7 = _f32(1.0 / 7.0)
LOG_C9 = _f32(1.0 / 9.0)
LN2_HI = 0.693359375  # few mantissa bits: k * LN2_HI is exact for every float32 exponent k
LN2_LO = _f32(0.6931471805599453 - 0.693359375)
# Adding this to the bits of x carries into the exponent exactly when the mantissa is at least
# sqrt(2)/2's, so the reduced mantissa m lands in [sqrt(1/2), sqrt(2)).
LOG_EXP_BIAS = 0x3F800000 - 0x3F3504F3
UNIFORM_BITS = 23
TOKEN_SALT = 0x9E3779B9


def _c(x: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32, device=like.device)


def log_portable(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive normal float32 values, bit-identical to the kernels' version.

    Accurate to a few ulp (not correctly rounded); the point is that the result is the same on
    every backend. Inputs that are zero, negative, subnormal, inf or nan give unspecified values.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"log_portable needs float32, got {x.dtype}")
    bits = x.view(torch.int32)
    k = ((bits + LOG_EXP_BIAS) >> 23) - 127
    m = (bits - k * 0x00800000).view(torch.float32)
    f = m - _c(1.0, x)  # exact: m is within a factor 2 of 1
    s = f / (f + _c(2.0, x))
    z = s * s
    r = z * (_c(LOG_C3, x) + z * (_c(LOG_C5, x) + z * (_c(LOG_C7, x) + z * _c(LOG_C9, x))))
    s2 = s + s
    lm = s2 + s2 * r
    kf = k.to(torch.float32)
    return kf * _c(LN2_HI, x) + (lm + kf * _c(LN2_LO, x))


def uniform_portable_from_hash(h: torch.Tensor) -> torch.Tensor:
    """u = ((h >> 9) + 0.5) / 2**23 in (0, 1) as float32, from int64 hashes in [0, 2**32); exact."""
    k = (h >> (32 - UNIFORM_BITS)).to(torch.float32)
    return (k + _c(0.5, k)) * _c(1.0 / (1 << UNIFORM_BITS), k)


def gumbel_portable_from_hash(h: torch.Tensor) -> torch.Tensor:
    """Gumbel noise -log(-log(u)) with log_portable; finite for every hash."""
    u = uniform_portable_from_hash(h)
    return -log_portable(-log_portable(u))


def gumbel_portable_from_keys(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Portable Gumbel noise [B, V] fp32 from int64 row keys [B] (see row_key).

    Token j of a row with key K gets hash32(K ^ hash32(j + 0x9E3779B9)), the same per-token
    hash for every backend (see the section comment).
    """
    th = token_hashes(vocab_size, keys.device)
    h = hash32_t(keys.to(torch.int64)[:, None] ^ th[None, :])
    return gumbel_portable_from_hash(h)
