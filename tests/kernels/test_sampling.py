"""Masked greedy / inverse-CDF sampling: the C twin returns the reference's token ids (greedy rows
exactly; sampled rows up to float rounding at a CDF step)."""

import pytest
import torch

from deepinfer_kernels import KernelInputError, rng
from deepinfer_kernels.sampling import bitmask_to_bool, masked_sample_reference, masked_sample_tilelang

from kernels_testutil import assert_same_draws, pack_bool_mask, random_bitmask


def make_batch(seed: int, batch: int, vocab: int, p_allow=0.5, greedy_every=2, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen) * scale
    mask = random_bitmask(gen, batch, vocab, p_allow)
    temp = torch.rand(batch, generator=gen) * 1.5 + 0.05
    if greedy_every:
        temp[::greedy_every] = 0.0
    keys = torch.tensor([rng.row_key(seed * 1000 + i, i + 3) for i in range(batch)], dtype=torch.int64)
    return logits, mask, temp, keys


def test_bitmask_layout_matches_xgrammar_convention():
    allowed = torch.zeros(1, 70, dtype=torch.bool)
    allowed[0, [0, 31, 32, 69]] = True
    words = pack_bool_mask(allowed)
    assert words.shape == (1, 3)
    assert words[0, 0].item() == (1 | -(2**31))  # bits 0 and 31 (int32 sign bit)
    assert words[0, 1].item() == 1 and words[0, 2].item() == 1 << 5
    assert torch.equal(bitmask_to_bool(words, 70), allowed)


def test_reference_respects_mask_and_greedy_rule():
    logits, mask, temp, keys = make_batch(1, 16, 1000)
    out = masked_sample_reference(logits, mask, temp, keys)
    allowed = bitmask_to_bool(mask, 1000)
    assert bool(allowed[torch.arange(16), out].all())
    greedy = temp == 0
    expect = logits.masked_fill(~allowed, float("-inf")).argmax(1)
    assert torch.equal(out[greedy], expect[greedy])


def test_reference_sampling_follows_softmax():
    # Same logits, 4000 different keys: empirical frequencies ~ softmax(logits / T).
    v, n = 5, 4000
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5]]).repeat(n, 1)
    mask = torch.full((n, 1), -1, dtype=torch.int32)
    temp = torch.full((n,), 0.7)
    keys = torch.tensor([rng.row_key(42, i) for i in range(n)], dtype=torch.int64)
    out = masked_sample_reference(logits, mask, temp, keys)
    freq = torch.bincount(out, minlength=v).double() / n
    assert torch.allclose(freq, torch.softmax(logits[0] / 0.7, 0).double(), atol=0.03)


@pytest.mark.parametrize(
    "batch,vocab", [(1, 1), (1, 33), (3, 1000), (64, 1000), (8, 49152), (1, 129280), (64, 4099)]
)
def test_twin_matches_reference(tilelang_available, batch, vocab):
    logits, mask, temp, keys = make_batch(batch * 7 + vocab, batch, vocab)
    ref = masked_sample_reference(logits, mask, temp, keys)
    got = masked_sample_tilelang(logits, mask, temp, keys)
    assert got.dtype == torch.int64
    assert_same_draws(got, ref, logits, mask, temp, keys)


def test_reference_is_the_engine_samplers_draw():
    # the fused route and the engine's torch ops are one definition: masked logits / T, then
    # the inverse CDF at the (seed, position) uniform
    from deepinfer_kernels.inverse_cdf import inverse_cdf_sample, row_uniforms

    logits, mask, temp, keys = make_batch(3, 32, 2000, greedy_every=0)
    x = logits.masked_fill(~bitmask_to_bool(mask, 2000), float("-inf")) / temp[:, None]
    assert torch.equal(masked_sample_reference(logits, mask, temp, keys), inverse_cdf_sample(x, row_uniforms(keys, "cpu")))


def test_twin_all_masked_but_one(tilelang_available):
    batch, vocab = 64, 1003
    logits, _, temp, keys = make_batch(5, batch, vocab)
    allowed = torch.zeros(batch, vocab, dtype=torch.bool)
    only = torch.randint(0, vocab, (batch,), generator=torch.Generator().manual_seed(9))
    only[0], only[1] = vocab - 1, 0  # the last token (in the partial word) and the first
    allowed[torch.arange(batch), only] = True
    mask = pack_bool_mask(allowed)
    got = masked_sample_tilelang(logits, mask, temp, keys)
    assert torch.equal(got, only)
    assert torch.equal(got, masked_sample_reference(logits, mask, temp, keys))


def test_twin_edge_rows_match_torch_argmax_rules(tilelang_available):
    vocab = 100
    logits = torch.zeros(5, vocab)
    logits[0, [10, 20, 30]] = 5.0  # tie: first index wins
    logits[1, :] = float("-inf")  # every score -inf: torch.argmax gives 0
    logits[2, 50] = float("inf")
    logits[3, 7] = 1.0
    mask = torch.full((5, 4), -1, dtype=torch.int32)
    mask[3] = 0  # nothing allowed: 0
    mask[4, 0] = 0  # tokens 0..31 masked, rest tie at 0.0: first allowed is 32
    temp = torch.zeros(5)
    keys = torch.arange(5, dtype=torch.int64)
    ref = masked_sample_reference(logits, mask, temp, keys)
    assert ref.tolist() == [10, 0, 50, 0, 32]
    assert torch.equal(masked_sample_tilelang(logits, mask, temp, keys), ref)
    # Same rows sampled: a +inf maximum is taken as it is, and the -inf rows still give 0.
    temp = torch.ones(5)
    ref = masked_sample_reference(logits, mask, temp, keys)
    assert ref[1].item() == 0 and ref[2].item() == 50 and ref[3].item() == 0
    assert torch.equal(masked_sample_tilelang(logits, mask, temp, keys), ref)


def test_twin_is_batch_invariant(tilelang_available):
    logits, mask, temp, keys = make_batch(11, 64, 3000)
    full = masked_sample_tilelang(logits, mask, temp, keys)
    for i in (0, 17, 63):
        one = masked_sample_tilelang(logits[i : i + 1], mask[i : i + 1], temp[i : i + 1], keys[i : i + 1])
        assert one.item() == full[i].item()


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: a.update(logits=a["logits"].double()), "logits must have dtype float32"),
        (lambda a: a.update(bitmask=a["bitmask"][:, :-1]), r"bitmask.shape\[1\] must be 32"),
        (lambda a: a.update(temperature=-a["temperature"]), "temperature must be finite and >= 0"),
        (lambda a: a.update(keys=a["keys"].int()), "keys must have dtype int64"),
        (lambda a: a.update(keys=a["keys"][:1]), r"keys.shape\[0\] must be 4"),
    ],
)
def test_bad_inputs_raise_typed_errors(change, match):
    from deepinfer_kernels import masked_sample

    logits, mask, temp, keys = make_batch(2, 4, 1000)
    args = dict(logits=logits, bitmask=mask, temperature=temp, keys=keys)
    change(args)
    with pytest.raises(KernelInputError, match=match):
        masked_sample(**args)


def test_keys_out_of_range_are_rejected():
    from deepinfer_kernels import masked_sample

    logits, mask, temp, keys = make_batch(3, 2, 64)
    with pytest.raises(KernelInputError, match=r"keys must be in \[0, 2\*\*32\)"):
        masked_sample(logits, mask, temp, torch.tensor([1, 2**40]))
