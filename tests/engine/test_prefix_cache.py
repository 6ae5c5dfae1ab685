"""Radix prefix reuse in the engine: cached prompts compute only their new tokens, outputs unchanged."""

from __future__ import annotations

import pytest

from deepinfer import Engine, SamplingParams
from test_engine_core import assert_all_blocks_free, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PREFIX = "the quick brown fox jumps over the lazy dog " * 6


@pytest.fixture(scope="module")
def llama(tiny_models):
    return str(tiny_models["llama"])


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_second_request_computes_only_new_tokens(llama, block_size):
    eng = Engine(llama, kv_cache_memory=8 << 20, block_size=block_size)
    ids = eng.tokenizer.encode(PREFIX)
    first = eng.generate([ids + eng.tokenizer.encode("paris")], GREEDY)[0]
    assert first.num_cached_tokens == 0
    before = eng.stats.computed_prompt_tokens
    q2 = ids + eng.tokenizer.encode("hello world")
    second = eng.generate([q2], GREEDY)[0]
    computed = eng.stats.computed_prompt_tokens - before
    cached = second.num_cached_tokens
    assert cached >= (len(ids) // block_size) * block_size - block_size  # whole pages of the prefix
    assert cached + computed == len(q2)
    assert computed <= len(q2) - len(ids) + block_size
    # a repeat of a finished request reuses its prompt and output: all but the last token
    third = eng.generate([q2], GREEDY)[0]
    assert third.token_ids == second.token_ids
    assert third.num_cached_tokens >= len(q2) - block_size
    assert_all_blocks_free(eng)


def test_outputs_identical_with_cache_on_and_off_under_memory_pressure(llama):
    shared = random_prompts(1, seed=11, lo=30, hi=30)[0]
    prompts = [shared + " " + p for p in random_prompts(16, seed=12, lo=2, hi=12)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    off = Engine(llama, kv_cache_memory=8 << 20, enable_prefix_caching=False).generate(prompts, sp)
    # ~200 tokens of KV: eviction and preemption both happen
    tight = Engine(llama, kv_cache_memory=100 << 10, block_size=4)
    on = tight.generate(prompts, sp)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert tight.stats.cached_prompt_tokens > 0
    assert tight.stats.num_preemptions > 0
    assert_all_blocks_free(tight)


def test_cache_aware_scheduling_prefers_cached_prefixes(llama):
    eng = Engine(llama, kv_cache_memory=8 << 20, max_num_seqs=1, block_size=4)
    a = "the lazy dog " * 10
    eng.generate([a + "x"], SamplingParams(temperature=0, max_tokens=1))
    order = []
    cold = [eng.add_request(p, GREEDY) for p in random_prompts(3, seed=21)]
    warm = eng.add_request(a + "hello", GREEDY)
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                order.append(o.request_id)
    assert order[0] == warm
    assert set(order) == set(cold) | {warm}


def test_fcfs_policy_keeps_arrival_order(llama):
    eng = Engine(llama, kv_cache_memory=8 << 20, max_num_seqs=1, block_size=4, schedule_policy="fcfs")
    a = "the lazy dog " * 10
    eng.generate([a + "x"], SamplingParams(temperature=0, max_tokens=1))
    ids = [eng.add_request(p, GREEDY) for p in random_prompts(3, seed=21)] + [eng.add_request(a + "hello", GREEDY)]
    order = []
    while eng.has_unfinished():
        order += [o.request_id for o in eng.step() if o.finished]
    assert order == ids


@pytest.mark.parametrize("block_size", [1, 4])
def test_fork_shares_blocks_and_matches_fresh_requests(llama, block_size):
    eng = Engine(llama, kv_cache_memory=8 << 20, block_size=block_size)
    parent = eng.add_request(PREFIX, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(4):
        eng.step()
    used_before = eng.kv.allocator.num_blocks - eng.kv.allocator.num_free
    kids_params = [SamplingParams(temperature=0.9, max_tokens=8, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    kids = eng.fork(parent, 3, kids_params)
    used_after = eng.kv.allocator.num_blocks - eng.kv.allocator.num_free
    # only the partial last page is copied per child
    assert used_after - used_before <= 3
    tokens = eng._seqs[kids[0]].prompt_token_ids
    assert all(t >= 0 for t in tokens) and len(tokens) > len(eng.tokenizer.encode(PREFIX))
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert done[parent].finish_reason == "length" and len(done[parent].token_ids) == 30
    fresh = Engine(llama, kv_cache_memory=8 << 20, block_size=block_size, enable_prefix_caching=False)
    for kid, p in zip(kids, kids_params):
        assert done[kid].prompt_token_ids == tokens
        assert done[kid].num_cached_tokens == len(tokens) - 1
        assert done[kid].token_ids == fresh.generate([tokens], p)[0].token_ids
    assert_all_blocks_free(eng)
