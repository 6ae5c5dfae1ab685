"""Sampler pieces on crafted logits: penalties, filters, bans, and the seeded draw."""

from __future__ import annotations

import collections

import torch

from deepinfer import SamplingParams
from deepinfer.engine.sampler import Sampler, SamplingRow, apply_penalties, inverse_cdf_sample, row_uniforms


def _row(params, prompt=(), output=(), banned=(), seed=0, position=0):
    return SamplingRow(params, seed, position, list(prompt), list(output), list(banned))


def test_penalties_follow_their_definitions():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    apply_penalties(logits, [_row(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])])
    # HF semantics: positive logits divided, negative multiplied, only for seen tokens
    assert logits.tolist() == [[1.0, -4.0, 1.0, 0.5]]
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    apply_penalties(logits, [_row(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), output=[2, 2, 3])])
    assert logits.tolist() == [[1.0, 1.0, 1.0 - 1.0 - 0.25, 1.0 - 0.5 - 0.25]]


def test_bans_and_filters_keep_draws_inside_the_allowed_set():
    s = Sampler()
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]]).repeat(200, 1)
    rows = [_row(SamplingParams(temperature=1.0, top_k=2), banned=[0], seed=i) for i in range(200)]
    toks = s.sample(logits.clone(), rows).tolist()
    # top-2 of {1,2,3,4} after banning 0 -> only 1 and 2 can be drawn, and both are
    assert set(toks) == {1, 2}
    rows = [_row(SamplingParams(temperature=1.0, top_p=0.5), seed=i) for i in range(200)]
    assert set(s.sample(logits.clone(), rows).tolist()) == {0}  # token 0 alone holds > 50%
    rows = [_row(SamplingParams(temperature=1.0, min_p=0.3), seed=i) for i in range(200)]
    assert set(s.sample(logits.clone(), rows).tolist()) == {0, 1}  # e^-1 = 0.37 >= 0.3 > e^-2


def test_inverse_cdf_draw_matches_the_distribution_and_depends_only_on_its_key():
    x = torch.tensor([[0.0, 1.0, 2.0, float("-inf")]])
    n = 20000
    counts = collections.Counter(int(inverse_cdf_sample(x, row_uniforms([k], "cpu"))[0]) for k in range(n))
    p = torch.softmax(x, -1)[0].tolist()
    assert counts[3] == 0
    for t in range(3):
        assert abs(counts[t] / n - p[t]) < 0.015
    # the same key draws the same token whatever else is in the batch
    many = torch.randn(16, 4)
    many[5] = x[0]
    keys = list(range(100, 116))
    alone = inverse_cdf_sample(x, row_uniforms([keys[5]], "cpu"))[0]
    assert inverse_cdf_sample(many, row_uniforms(keys, "cpu"))[5] == alone


def test_greedy_rows_take_torch_argmax_with_either_kernels_option():
    """Greedy rows go through the native argmax on CPU (kernels "auto") and torch's ("torch"): the
    same first-maximum tokens, in an all-greedy batch and among sampled rows."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 1000, generator=g)
    logits[0, 7] = logits[0, 900] = 50.0  # a tie: the first
    logits[2, 999] = 60.0  # in the row's scalar tail (1000 = 62 vectors of 16 + 8)
    greedy = SamplingParams(temperature=0.0)
    hot = SamplingParams(temperature=1.0, seed=5)
    rows = [SamplingRow(greedy if i % 2 == 0 else hot, 1, 10, [1], [], []) for i in range(6)]
    for kernels in ("auto", "torch"):
        s = Sampler(kernels=kernels)
        assert torch.equal(s.sample(logits.clone(), [SamplingRow(greedy, 1, 10, [1], [], [])] * 6), logits.argmax(-1))
        mixed = s.sample(logits.clone(), rows)
        assert mixed[0::2].tolist() == logits[0::2].argmax(-1).tolist() == [7, 999, logits[4].argmax().item()]
    assert Sampler(kernels="torch").sample(logits.clone(), rows).tolist() == Sampler().sample(logits.clone(), rows).tolist()


def test_greedy_cpu_batches_go_through_the_native_argmax_unless_kernels_is_torch(monkeypatch):
    from deepinfer_kernels import native

    if not native.available():
        import pytest

        pytest.skip("no C compiler here: the native kernels are not built")
    calls = []
    real = native.argmax_rows
    monkeypatch.setattr(native, "argmax_rows", lambda x: calls.append(x.shape) or real(x))
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(2))
    rows = [SamplingRow(SamplingParams(temperature=0.0), 1, 10, [1], [], [])] * 4
    assert torch.equal(Sampler().sample(logits.clone(), rows), logits.argmax(-1))
    assert calls == [(4, 300)]
    Sampler(kernels="torch").sample(logits.clone(), rows)
    assert calls == [(4, 300)]  # torch's own argmax there
