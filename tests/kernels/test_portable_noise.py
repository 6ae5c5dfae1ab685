"""The portable Gumbel noise: accuracy, and bit-identity of the torch and C implementations."""

import math

import pytest
import torch

from deepinfer_kernels import noise, rng

ALL_UNIFORM_HASHES = torch.arange(1 << rng.UNIFORM_BITS, dtype=torch.int64) << (32 - rng.UNIFORM_BITS)


def test_log_portable_is_accurate_over_every_input_the_noise_uses():
    u = rng.uniform_portable_from_hash(ALL_UNIFORM_HASHES)
    assert bool((u > 0).all()) and bool((u < 1).all())
    lu = rng.log_portable(u)
    rel = ((lu.double() - torch.log(u.double())).abs() / torch.log(u.double()).abs()).max().item()
    assert rel < 3e-7
    t = -lu
    lt = rng.log_portable(t)
    err = (lt.double() - torch.log(t.double())).abs() / torch.log(t.double()).abs().clamp_min(1e-3)
    assert err.max().item() < 3e-7


def test_log_portable_matches_math_log_on_a_spread_of_values():
    xs = torch.tensor([1e-30, 1e-7, 0.5, 0.7071, 0.7072, 1.0, 1.5, 2.0, 3.0, 1e4, 3e38], dtype=torch.float32)
    got = rng.log_portable(xs)
    for x, g in zip(xs.tolist(), got.tolist()):
        assert g == pytest.approx(math.log(x), rel=3e-7, abs=1e-7)


def test_portable_gumbel_is_finite_and_has_gumbel_moments():
    g = rng.gumbel_portable_from_hash(ALL_UNIFORM_HASHES)
    assert bool(torch.isfinite(g).all())
    # Over all 2**23 equally likely uniforms the mean is Euler's gamma, the variance pi^2/6.
    assert g.double().mean().item() == pytest.approx(0.5772156649, abs=1e-4)
    assert g.double().var().item() == pytest.approx(math.pi**2 / 6, abs=2e-3)


def test_portable_noise_depends_only_on_key_and_token():
    keys = torch.tensor([rng.row_key(7, 3), rng.row_key(7, 4), rng.row_key(8, 3)], dtype=torch.int64)
    full = rng.gumbel_portable_from_keys(keys, 1000)
    alone = rng.gumbel_portable_from_keys(keys[1:2], 1000)
    assert torch.equal(full[1:2], alone)
    assert not torch.equal(full[0], full[1]) and not torch.equal(full[0], full[2])
    # A shorter vocab is a prefix of a longer one (the noise is per token index).
    assert torch.equal(rng.gumbel_portable_from_keys(keys, 77), full[:, :77])


def test_c_noise_kernel_is_bit_identical_to_torch_for_every_uniform_value(tilelang_available):
    # Low bits set too: the kernel must ignore the bits below the 23 it uses.
    h = ALL_UNIFORM_HASHES | 0x1FF
    got = noise.noise_tilelang(h)
    ref = rng.gumbel_portable_from_hash(h)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
