"""Self-drafting (speculative="draft": the model's first layers + its head draw the drafts) is exact:
outputs are identical with it on or off, and the draft passes leave no trace in the KV cache."""

from __future__ import annotations

import pytest

from deepinfer import Engine, InvalidRequestError, SamplingParams

from test_engine_core import assert_all_blocks_free, random_prompts
from test_speculative import _same


@pytest.fixture(scope="module")
def llama(tiny_models):
    return str(tiny_models["llama"])


def _pair(path, **kw):
    base = dict(kv_cache_memory=8 << 20, block_size=4)
    base.update(kw)
    return Engine(path, **base), Engine(path, speculative="draft", draft_layers=1, speculative_budget=False, **base)


def _check_verified(eng):
    st = eng.stats
    assert st.accepted_draft_tokens > 0, "no draft was accepted: the test proves nothing"
    assert st.accepted_draft_tokens < st.draft_tokens, "no draft was rejected: the rejection path is untested"
    assert eng.speculator.drafter.seconds > 0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_greedy_identical(llama, prefix_caching):
    plain, spec = _pair(llama, enable_prefix_caching=prefix_caching)
    prompts = random_prompts(10, seed=3)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    a, b = plain.generate(prompts, sp), spec.generate(prompts, sp)
    _same(a, b)
    for x, y in zip(a, b):
        assert all(abs(p.logprob - q.logprob) < 1e-5 for p, q in zip(x.logprobs, y.logprobs))
    _check_verified(spec)
    assert_all_blocks_free(spec)
    # the cache the draft passes wrote into serves later requests correctly
    _same(plain.generate(prompts[:3], sp), spec.generate(prompts[:3], sp))


def test_seeded_sampling_and_grammar_identical(llama):
    plain, spec = _pair(llama, jump_forward=False)
    prompts = random_prompts(6, seed=4)
    sps = [SamplingParams(temperature=0.05, seed=100 + i, max_tokens=32, ignore_eos=True) for i in range(4)]
    sps += [SamplingParams(temperature=0, max_tokens=24, regex=r"(ab|cd)+[0-9]{2,6}"),
            SamplingParams(temperature=0.7, seed=3, max_tokens=40,
                           json_schema={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})]
    a, b = plain.generate(prompts, sps), spec.generate(prompts, sps)
    _same(a, b)
    _check_verified(spec)
    assert_all_blocks_free(spec)


def test_preemption_under_a_tiny_kv_budget(llama):
    plain, spec = _pair(llama, kv_cache_memory=96 << 10, enable_prefix_caching=True)
    prompts = random_prompts(12, seed=6)
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    a, b = plain.generate(prompts, sp), spec.generate(prompts, sp)
    _same(a, b)
    assert spec.stats.num_preemptions > 0, "no preemption: the test proves nothing"
    assert_all_blocks_free(spec)


def test_batch_invariant_mode_is_bitwise(llama):
    plain, spec = _pair(llama, batch_invariant=True)
    prompts = random_prompts(4, seed=7)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    a, b = plain.generate(prompts, sp), spec.generate(prompts, sp)
    _same(a, b)
    for x, y in zip(a, b):
        assert [lp.logprob for lp in x.logprobs] == [lp.logprob for lp in y.logprobs]


def test_budgeted_self_draft_is_exact(llama):
    base = dict(kv_cache_memory=8 << 20, block_size=4)
    plain = Engine(llama, **base)
    spec = Engine(llama, speculative="draft", draft_layers=1, **base)
    assert 0 < spec.speculator.draft_frac < 1.5
    prompts = random_prompts(4, seed=8)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    _same(plain.generate(prompts, sp), spec.generate(prompts, sp))


def test_config_errors(llama, tiny_models):
    with pytest.raises(InvalidRequestError, match="draft_layers must be in"):
        Engine(llama, kv_cache_memory=8 << 20, speculative="draft", draft_layers=99)
    with pytest.raises(InvalidRequestError, match="draft_layers must be an int"):
        Engine(llama, kv_cache_memory=8 << 20, speculative="draft", draft_layers=0)
