"""Speculative decoding (n-gram drafts) is exact: every output is identical with it on or off.

The tiny random-weight models repeat themselves a lot, so prompt lookup finds drafts and both paths
of verification (accepted runs and rejected drafts) are exercised; each test checks they were.
"""

from __future__ import annotations

import pytest

from deepinfer import Engine, InvalidRequestError, SamplingParams
from deepinfer.engine.speculation import ForwardCost

from test_engine_core import assert_all_blocks_free, random_prompts


@pytest.fixture(scope="module")
def llama(tiny_models):
    return str(tiny_models["llama"])


def _pair(path, **kw):
    """Without and with speculation; the latter verifies every draft (no budget), so both
    verification paths are exercised whatever this machine's forward costs measure."""
    base = dict(kv_cache_memory=8 << 20, block_size=4)
    base.update(kw)
    return Engine(path, **base), Engine(path, speculative="ngram", speculative_budget=False, **base)


def _same(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.text for o in a] == [o.text for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    assert [o.stop_reason for o in a] == [o.stop_reason for o in b]


def _check_verified(eng, outs):
    st = eng.stats
    assert st.verify_runs > 0 and st.accepted_draft_tokens > 0, "no draft was accepted: the test proves nothing"
    assert st.accepted_draft_tokens < st.draft_tokens, "no draft was rejected: the rejection path is untested"
    assert sum(o.num_accepted_draft_tokens for o in outs) == st.accepted_draft_tokens
    assert sum(o.num_draft_tokens for o in outs) == st.draft_tokens


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_greedy_identical_and_fewer_steps(llama, prefix_caching):
    plain, spec = _pair(llama, enable_prefix_caching=prefix_caching)
    prompts = random_prompts(10, seed=3)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    a, b = plain.generate(prompts, sp), spec.generate(prompts, sp)
    _same(a, b)
    # native CPU attention and GEMM (every CPU level where they build): a verify row computes what a decode does, bitwise
    exact = plain.runner.token_attention is not None and getattr(plain.runner.linear, "backend", "") == "native"
    for x, y in zip(a, b):  # logprobs of verified rows equal those of single decodes
        assert [lp.token_id for lp in x.logprobs] == [lp.token_id for lp in y.logprobs]
        if exact:
            assert [lp.logprob for lp in x.logprobs] == [lp.logprob for lp in y.logprobs]
        assert all(abs(p.logprob - q.logprob) < 1e-5 for p, q in zip(x.logprobs, y.logprobs))
    _check_verified(spec, b)
    assert spec.stats.num_steps < plain.stats.num_steps
    assert_all_blocks_free(spec)


def test_seeded_sampling_identical(llama):
    plain, spec = _pair(llama)
    prompts = random_prompts(8, seed=4)
    sps = [SamplingParams(temperature=0.7, top_k=20, top_p=0.95, seed=100 + i, max_tokens=32, ignore_eos=True,
                          repetition_penalty=1.1 if i % 2 else 1.0, frequency_penalty=0.2 if i % 3 == 0 else 0.0)
           for i in range(8)]
    # a low temperature keeps the random model repetitive enough for drafts to be accepted
    sps += [SamplingParams(temperature=0.05, seed=7, max_tokens=32, ignore_eos=True)] * 2
    prompts += random_prompts(2, seed=5)
    a, b = plain.generate(prompts, sps), spec.generate(prompts, sps)
    _same(a, b)
    _check_verified(spec, b)
    assert_all_blocks_free(spec)


def test_stop_conditions_inside_an_accepted_run(llama):
    plain, spec = _pair(llama)
    prompts = random_prompts(10, seed=6)
    ref = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    # stop ids and stop strings taken from what the model writes, so they hit mid-output
    stop_ids = sorted({o.token_ids[9] for o in ref})[:3]
    stop_strs = sorted({o.text[len(o.text) // 2 : len(o.text) // 2 + 3] for o in ref if len(o.text) > 8})[:3]
    cases = [
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=stop_ids, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop=stop_strs, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop=stop_strs, include_stop_str_in_output=True, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),  # max_tokens mid-draft
        SamplingParams(temperature=0, max_tokens=30, min_tokens=12, stop_token_ids=stop_ids, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30),  # the model's own EOS
    ]
    for sp in cases:
        _same(plain.generate(prompts, sp), spec.generate(prompts, sp))
    assert spec.stats.accepted_draft_tokens > 0
    assert any(o.finish_reason == "stop" for o in spec.generate(prompts, cases[0]))
    assert_all_blocks_free(spec)


def test_context_limit_inside_a_draft(llama):
    plain, spec = _pair(llama, max_model_len=48)
    prompts = random_prompts(6, seed=8, lo=20, hi=30)
    sp = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    a, b = plain.generate(prompts, sp), spec.generate(prompts, sp)
    _same(a, b)
    assert all(o.finish_reason == "length" for o in b)
    assert_all_blocks_free(spec)


def test_preemption_under_a_tiny_kv_budget(llama):
    plain = Engine(llama, kv_cache_memory=8 << 20, block_size=4)
    spec = Engine(llama, kv_cache_memory=48 * 1024, block_size=4, speculative="ngram", speculative_budget=False)
    prompts = random_prompts(12, seed=9, lo=10, hi=25)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    a, b = plain.generate(prompts, sp), spec.generate(prompts, sp)
    _same(a, b)
    assert spec.stats.num_preemptions > 0, "the budget did not force a preemption"
    assert spec.stats.accepted_draft_tokens > 0
    assert_all_blocks_free(spec)


def test_grammar_constrained_identical(llama):
    # jump-forward would write forced text itself; with it off, drafts go through the grammar masks
    plain, spec = _pair(llama, jump_forward=False)
    prompts = random_prompts(8, seed=10)
    cases = [
        SamplingParams(temperature=0, max_tokens=40, regex=r"(ab|cd|[a-z ]){5,40}"),
        SamplingParams(temperature=0, max_tokens=60, json_schema={
            "type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "array", "items": {"type": "integer"}}},
            "required": ["a", "b"]}),
        SamplingParams(temperature=0.8, seed=3, max_tokens=40, regex=r"([a-z]+ ){3,10}"),
    ]
    for sp in cases:
        a, b = plain.generate(prompts, sp), spec.generate(prompts, sp)
        _same(a, b)
        assert all(o.finish_reason != "error" for o in b), [o.error for o in b]
    assert spec.stats.draft_tokens > 0
    assert_all_blocks_free(spec)


def test_grammar_matcher_ends_in_the_same_state(llama):
    plain, spec = _pair(llama, jump_forward=False)
    prompt = random_prompts(1, seed=11)[0]
    sp = SamplingParams(temperature=0, max_tokens=12, regex=r"[a-z ]{1,30}")
    ids = []
    for eng in (plain, spec):
        rid = eng.add_request(prompt, sp)
        seq = eng._seqs[rid]
        matcher = seq.matcher
        out = None
        while eng.has_unfinished():
            for o in eng.step():
                out = o
        ids.append(out.token_ids)
        # the matcher accepted exactly the output: rolling it back to the start and replaying agrees
        n = len(out.token_ids)
        matcher.rollback(n)
        assert all(matcher.accept_token(t) for t in out.token_ids)
    assert ids[0] == ids[1]


def test_fork_and_prefix_hits_with_drafts(llama):
    plain, spec = _pair(llama)
    prompt = random_prompts(1, seed=12, lo=30, hi=30)[0]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = []
    for eng in (plain, spec):
        rid = eng.add_request(prompt, sp)
        for _ in range(6):
            eng.step()
        kids = eng.fork(rid, 2)
        done = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.token_ids
        again = eng.generate([prompt], sp)[0]  # a prefix hit on the finished request's pages
        assert again.num_cached_tokens > 0
        results.append(([done[rid]] + [done[k] for k in kids], again.token_ids))
        assert_all_blocks_free(eng)
    assert results[0] == results[1]


def test_batch_invariant_verify_rows_equal_single_decodes(llama):
    plain, spec = _pair(llama, batch_invariant=True)
    prompts = random_prompts(6, seed=13)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    a, b = plain.generate(prompts, sp), spec.generate(prompts, sp)
    _same(a, b)
    for x, y in zip(a, b):  # bitwise: a verify pass of k + 1 rows gives what k + 1 decodes give
        assert [lp.logprob for lp in x.logprobs] == [lp.logprob for lp in y.logprobs]
    assert spec.stats.accepted_draft_tokens > 0


def test_config_errors(llama):
    with pytest.raises(InvalidRequestError, match="speculative must be"):
        Engine(llama, kv_cache_memory=8 << 20, speculative="eagle")
    with pytest.raises(InvalidRequestError, match="no multi-token-prediction layer"):
        Engine(llama, kv_cache_memory=8 << 20, speculative="mtp")
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens"):
        Engine(llama, kv_cache_memory=8 << 20, speculative="ngram", num_speculative_tokens=0)


def test_jump_forward_is_verified_and_changes_no_output(llama):
    """Forced grammar text arrives as drafts: outputs equal those with jump-forward off, in fewer steps."""
    on = Engine(llama, kv_cache_memory=8 << 20, block_size=4, jump_forward=True)
    off = Engine(llama, kv_cache_memory=8 << 20, block_size=4, jump_forward=False)
    prompts = random_prompts(6, seed=14)
    schema = {"type": "object", "properties": {"alpha_key": {"type": "string", "maxLength": 8},
              "beta_long_key_name": {"type": "integer"}, "gamma": {"enum": ["first choice", "second choice"]}},
              "required": ["alpha_key", "beta_long_key_name", "gamma"], "additionalProperties": False}
    # the budget guard (on by default for typed results) holds drafts back within BUDGET_ZONE tokens
    # of max_tokens: the first two run without it, the last with it, far enough from its budget
    for sp in (SamplingParams(temperature=0, max_tokens=80, json_schema=schema, complete_within_budget=False),
               SamplingParams(temperature=0.9, seed=5, max_tokens=80, json_schema=schema, logprobs=1,
                              complete_within_budget=False),
               SamplingParams(temperature=0, max_tokens=30, regex=r"The answer is (yes|no|maybe)\. Because .{5,20}"),
               SamplingParams(temperature=0, max_tokens=160, json_schema=schema)):
        on.stats.num_steps = off.stats.num_steps = 0
        a, b = off.generate(prompts, sp), on.generate(prompts, sp)
        _same(a, b)
        assert on.stats.num_steps < off.stats.num_steps
        if sp.logprobs is not None:  # forced tokens get the model's real logprobs, not 0.0
            for x, y in zip(a, b):
                assert all(abs(p.logprob - q.logprob) < 1e-5 for p, q in zip(x.logprobs, y.logprobs))
    assert on.stats.jump_forward_tokens > 0
    assert_all_blocks_free(on)


def test_overlap_mode_gives_the_same_constrained_outputs(llama):
    sync = Engine(llama, kv_cache_memory=8 << 20, block_size=4, jump_forward=True)
    over = Engine(llama, kv_cache_memory=8 << 20, block_size=4, overlap_schedule=True, jump_forward=True)
    prompts = random_prompts(6, seed=15)
    # (the budget guard, on by default for a schema, drafts nothing within BUDGET_ZONE = 64 tokens of max_tokens)
    sp = SamplingParams(temperature=0, max_tokens=60, complete_within_budget=False, json_schema={
        "type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "tags"]})
    _same(sync.generate(prompts, sp), over.generate(prompts, sp))
    assert sync.stats.jump_forward_tokens > 0


def test_budgeted_engine_learns_and_stays_exact(llama):
    """With the budget on: the cost model is measured at start, confidences are learned from what
    verification accepts, and the outputs stay exact."""
    plain = Engine(llama, kv_cache_memory=8 << 20, block_size=4)
    spec = Engine(llama, kv_cache_memory=8 << 20, block_size=4, speculative="ngram")
    assert spec.speculator.cost is not None and spec.speculator.cost(1) > 0
    spec.speculator.cost = ForwardCost([(1, 1.0), (4096, 1.0)])  # flat: every draft pays (machine-independent)
    prompts = random_prompts(8, seed=16)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    _same(plain.generate(prompts, sp), spec.generate(prompts, sp))
    st = spec.stats
    assert st.drafts_proposed > 0 and st.drafts_admitted == st.draft_tokens > 0
    assert spec.speculator.confidence._trials, "no acceptance was learned"
    assert 1.0 < st.mean_accepted_length <= 1 + spec.config.num_speculative_tokens
    # a steep cost (each token costs a whole step) admits nothing but the occasional one-draft
    # probe (speculation.PROBE_EVERY); outputs still exact
    spec.speculator.cost = ForwardCost([(1, 1.0), (2, 2.0)])
    before, probes = st.drafts_admitted, spec.speculator.probes
    _same(plain.generate(prompts, sp), spec.generate(prompts, sp))
    assert st.drafts_admitted - before == spec.speculator.probes - probes and st.drafts_proposed > 0


@pytest.mark.parametrize("where", ["fill_bitmask", "accept_token", "find_jump_forward_string"])
def test_a_failing_grammar_fails_only_its_request(llama, where):
    eng = Engine(llama, kv_cache_memory=8 << 20, block_size=4, jump_forward=True)
    prompts = random_prompts(2, seed=17)
    sp = SamplingParams(temperature=0, max_tokens=20, regex=r"[a-z ]{1,40}")
    alone = eng.generate([prompts[1]], sp)[0]
    bad, good = eng.add_request(prompts[0], sp), eng.add_request(prompts[1], sp)

    def boom(*a, **k):
        raise RuntimeError("matcher exploded")

    setattr(eng._seqs[bad].matcher, where, boom)
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert done[bad].finish_reason == "error" and "matcher exploded" in done[bad].error
    assert done[good].token_ids == alone.token_ids and done[good].finish_reason == alone.finish_reason
    assert_all_blocks_free(eng)


@pytest.mark.parametrize("budget", [False, True])
def test_overlap_schedule_with_speculation(llama, budget):
    """The overlapped loop verifies drafts (planning such a step after its predecessor's tokens are
    known) and overlaps while drafting is paused: outputs identical to plain decoding either way."""
    base = dict(kv_cache_memory=8 << 20, block_size=4)
    plain = Engine(llama, **base)
    over = Engine(llama, speculative="ngram", speculative_budget=budget, overlap_schedule=True, **base)
    prompts = random_prompts(8, seed=11)
    sps = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 6
    sps += [SamplingParams(temperature=0.05, seed=5, max_tokens=40, ignore_eos=True, stop=["e"]),
            SamplingParams(temperature=0, max_tokens=30, regex=r"(ab|cd)+[0-9]{2,9}")]
    a, b = plain.generate(prompts, sps), over.generate(prompts, sps)
    _same(a, b)
    assert over.stats.accepted_draft_tokens > 0
    assert_all_blocks_free(over)


def test_overlap_loop_plans_ahead_while_drafting_is_paused(llama):
    """Chat-like prompts with nothing to copy: drafting pauses, and paused steps are planned ahead."""
    base = dict(kv_cache_memory=8 << 20, block_size=4)
    over = Engine(llama, speculative="ngram", overlap_schedule=True, **base)
    plain = Engine(llama, **base)
    prompts = [[i + 3] for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)  # too short for any draft to pay
    _same(plain.generate(prompts, sp), over.generate(prompts, sp))
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    _same(plain.generate(prompts, sp), over.generate(prompts, sp))
    assert over.speculator.paused_steps > 0
