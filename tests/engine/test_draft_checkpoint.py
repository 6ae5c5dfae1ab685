"""Drafting with a separate checkpoint (speculative="draft", draft_model=PATH) is exact: outputs are
identical with it on or off, whatever the draft model is, and its KV cache (paged by the target's
block ids) follows preemption, prefix hits and fork."""

from __future__ import annotations

import json
import shutil

import pytest

from deepinfer import Engine, InvalidRequestError, SamplingParams
from deepinfer.errors import ModelLoadError

from model_factory import make_tiny_model
from test_engine_core import assert_all_blocks_free, random_prompts
from test_speculative import _same

BASE = dict(kv_cache_memory=8 << 20, block_size=4)


@pytest.fixture(scope="module")
def llama(tiny_models):
    return str(tiny_models["llama"])


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A different model (another architecture, other random weights) with the same tokenizer."""
    return str(make_tiny_model(tmp_path_factory.mktemp("draft") / "qwen3", "qwen3", seed=5))


def _pair(target, draft, **kw):
    base = dict(BASE)
    base.update(kw)
    return Engine(target, **base), Engine(target, speculative="draft", draft_model=draft, speculative_budget=False, **base)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_the_target_as_its_own_draft_is_accepted_and_exact(llama, prefix_caching):
    plain, spec = _pair(llama, llama, enable_prefix_caching=prefix_caching)
    prompts = random_prompts(8, seed=3)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    a, b = plain.generate(prompts, sp), spec.generate(prompts, sp)
    _same(a, b)
    for x, y in zip(a, b):
        assert all(abs(p.logprob - q.logprob) < 1e-5 for p, q in zip(x.logprobs, y.logprobs))
    st = spec.stats
    # the same weights draft what the target decodes: (nearly) every draft is accepted
    assert st.draft_tokens > 0 and st.accepted_draft_tokens >= 0.9 * st.draft_tokens
    assert st.num_steps < 0.5 * plain.stats.num_steps
    drafter = spec.speculator.drafter
    assert drafter.seconds > 0
    # each sequence's prompt is caught up once, not once per step (after a fully accepted run the
    # last draft, never fed, and the bonus token are: one extra token per step of 2+ tokens)
    prompt_tokens = sum(len(spec.encode_prompt(p)) for p in prompts)
    assert drafter.caught_up_tokens <= prompt_tokens + sum(len(o.token_ids) for o in b) // 2
    assert_all_blocks_free(spec)
    # a second round (prefix hits when caching) reuses the draft cache's blocks correctly
    _same(plain.generate(prompts[:3], sp), spec.generate(prompts[:3], sp))
    assert spec.stats.accepted_draft_tokens >= 0.9 * spec.stats.draft_tokens


def test_another_model_drafts_exactly(llama, other_draft):
    plain, spec = _pair(llama, other_draft, jump_forward=False)
    prompts = random_prompts(6, seed=4)
    sps = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True) for _ in range(2)]
    sps += [SamplingParams(temperature=0.05, seed=100 + i, max_tokens=32, ignore_eos=True) for i in range(2)]
    sps += [SamplingParams(temperature=0, max_tokens=24, regex=r"(ab|cd)+[0-9]{2,6}"),
            SamplingParams(temperature=0.7, seed=3, max_tokens=40,
                           json_schema={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})]
    a, b = plain.generate(prompts, sps), spec.generate(prompts, sps)
    _same(a, b)
    st = spec.stats
    assert st.draft_tokens > 0 and st.accepted_draft_tokens < st.draft_tokens, "no draft was rejected"
    assert_all_blocks_free(spec)


def test_preemption_and_fork_keep_the_draft_cache_right(llama):
    plain, spec = _pair(llama, llama, kv_cache_memory=96 << 10, enable_prefix_caching=True)
    prompts = random_prompts(12, seed=6)
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    a, b = plain.generate(prompts, sp), spec.generate(prompts, sp)
    _same(a, b)
    assert spec.stats.num_preemptions > 0, "no preemption: the test proves nothing"
    # after a preemption the draft cache is caught up again, so the drafts stay the target's own
    assert spec.stats.accepted_draft_tokens >= 0.9 * spec.stats.draft_tokens
    assert_all_blocks_free(spec)


def test_fork_mid_decode_and_prefix_hits(llama):
    plain, spec = _pair(llama, llama, enable_prefix_caching=True)
    prompt = random_prompts(1, seed=12, lo=30, hi=30)[0]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = []
    for eng in (plain, spec):
        rid = eng.add_request(prompt, sp)
        while not any(o.token_ids for o in eng.step()):
            pass
        for _ in range(2):  # decode on: with drafts, the parent's draft cache holds its tokens
            eng.step()
        kids = eng.fork(rid, 2)  # children share the parent's blocks: their draft cache too
        done, prompts_of = {}, {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.token_ids
                    prompts_of[o.request_id] = o.prompt_token_ids
        again = eng.generate([prompt], sp)[0]
        assert again.num_cached_tokens > 0
        # the fork point differs (drafts advance the parent faster): each child continues its parent's
        # tokens at that point exactly as plain decoding would, which a plain run of that prefix shows
        results.append([done[rid], again.token_ids])
        for k in kids:
            forked_at = prompts_of[k]  # the parent's tokens when it was forked
            alone = plain.generate([forked_at], SamplingParams(
                temperature=0, max_tokens=len(done[k]), ignore_eos=True))[0]
            assert done[k] == alone.token_ids
        assert_all_blocks_free(eng)
    assert results[0] == results[1]
    assert spec.stats.accepted_draft_tokens >= 0.9 * spec.stats.draft_tokens > 0


def test_budgeted_draft_model_is_exact(llama, other_draft):
    plain = Engine(llama, **BASE)
    spec = Engine(llama, speculative="draft", draft_model=other_draft, **BASE)
    # the draft pass's price is measured (a timing: only its sign and finiteness are certain)
    assert 0 < spec.speculator.draft_frac < float("inf")
    prompts = random_prompts(4, seed=8)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    _same(plain.generate(prompts, sp), spec.generate(prompts, sp))


def test_config_and_tokenizer_errors(llama, tmp_path):
    with pytest.raises(InvalidRequestError, match="draft_model is used by speculative='draft'"):
        Engine(llama, speculative="ngram", draft_model=llama, **BASE)
    with pytest.raises(InvalidRequestError, match="exclude each other"):
        Engine(llama, speculative="draft", draft_model=llama, draft_layers=1, **BASE)
    with pytest.raises(InvalidRequestError, match="draft_model must be a path"):
        Engine(llama, speculative="draft", draft_model=3, **BASE)
    with pytest.raises(ModelLoadError, match="draft_model: .*missing"):
        Engine(llama, speculative="draft", draft_model=str(tmp_path / "missing"), **BASE)
    # the same model with two token ids swapped: its drafts would mean other tokens
    bad = tmp_path / "swapped"
    shutil.copytree(llama, bad)
    spec = json.loads((bad / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    x, y = sorted(vocab, key=vocab.get)[100:102]
    vocab[x], vocab[y] = vocab[y], vocab[x]
    (bad / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(InvalidRequestError, match="tokenizer differs from the target's"):
        Engine(llama, speculative="draft", draft_model=str(bad), **BASE)


def test_own_probability_is_calibrated_and_cuts_unlikely_runs(llama):
    from deepinfer.engine.speculation import ForwardCost

    plain = Engine(llama, **BASE)
    spec = Engine(llama, speculative="draft", draft_model=llama, **BASE)
    # flat, and draft passes priced at nothing: the budget admits every likely slot
    spec.speculator.cost, spec.speculator.draft_frac = ForwardCost([(1, 1.0), (4096, 1.0)]), 0.0
    drafter = spec.speculator.drafter
    prompts = random_prompts(4, seed=9)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    _same(plain.generate(prompts, sp), spec.generate(prompts, sp))
    # the target drafting for itself: every bucket that saw drafts learned they pass
    seen = [b for b in range(len(drafter.trials)) if drafter.trials[b] >= 5]
    assert seen and all(drafter.hits[b] / drafter.trials[b] > 0.9 for b in seen)
    assert all(drafter.calibrated(b) > 0.8 for b in seen)
    # teach it that nothing it drafts passes: every run is cut after drawing, none is verified
    n = len(drafter.trials)
    drafter.trials, drafter.hits = [1000.0] * n, [0.0] * n
    verified, cut = spec.stats.draft_tokens, drafter.cut_drafts
    _same(plain.generate(prompts, sp), spec.generate(prompts, sp))
    assert drafter.cut_drafts > cut and spec.stats.draft_tokens == verified
    assert_all_blocks_free(spec)


def test_batch_invariant_mode_is_bitwise(llama, other_draft):
    plain, spec = _pair(llama, other_draft, batch_invariant=True)
    prompts = random_prompts(4, seed=7)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    a, b = plain.generate(prompts, sp), spec.generate(prompts, sp)
    _same(a, b)
    for x, y in zip(a, b):
        assert [lp.logprob for lp in x.logprobs] == [lp.logprob for lp in y.logprobs]
    assert spec.stats.draft_tokens > 0
