"""Continuous batching, chunked prefill, preemption, KV accounting, stop conditions, seeded sampling."""

from __future__ import annotations

import random

import pytest

from deepinfer import Engine, InvalidRequestError, PromptTooLongError, SamplingParams

WORDS = "the quick brown fox jumps over lazy dog paris capital france hello world how are you".split()


def random_prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[str]:
    r = random.Random(seed)
    return [" ".join(r.choice(WORDS) for _ in range(r.randint(lo, hi))) for _ in range(n)]


def assert_all_blocks_free(eng: Engine) -> None:
    radix = eng.kv.radix
    held = radix.protected_blocks if radix is not None else 0
    cached = radix.evictable_blocks if radix is not None else 0
    assert held == 0, "a finished request still locks radix-cache blocks"
    assert eng.kv.allocator.num_free + cached == eng.kv.allocator.num_blocks, "KV blocks leaked"
    if radix is not None:
        radix.check_invariants()
        radix.reset()
    assert eng.kv.allocator.num_free == eng.kv.allocator.num_blocks


@pytest.fixture(scope="module")
def llama(tiny_models):
    return str(tiny_models["llama"])


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_batched_greedy_equals_each_alone(llama, prefix_caching):
    prompts = random_prompts(12, seed=1)
    eng = Engine(llama, kv_cache_memory=8 << 20, block_size=4, enable_prefix_caching=prefix_caching)
    batched = [o.token_ids for o in eng.generate(prompts, GREEDY)]
    alone = [eng.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert batched == alone
    assert_all_blocks_free(eng)


def test_chunked_prefill_equals_unchunked(llama):
    prompts = random_prompts(6, seed=2, lo=30, hi=60)
    whole = Engine(llama, kv_cache_memory=8 << 20, max_num_batched_tokens=4096, enable_prefix_caching=False)
    chunked = Engine(llama, kv_cache_memory=8 << 20, max_num_batched_tokens=7, enable_prefix_caching=False)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    a = whole.generate(prompts, sp)
    b = chunked.generate(prompts, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a, b):
        for lx, ly in zip(x.logprobs, y.logprobs):
            assert abs(lx.logprob - ly.logprob) < 1e-4
    assert chunked.stats.num_steps > whole.stats.num_steps
    assert_all_blocks_free(chunked)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_under_small_kv_budget_gives_same_outputs(llama, prefix_caching):
    prompts = random_prompts(10, seed=3, lo=10, hi=30)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = Engine(llama, kv_cache_memory=16 << 20, enable_prefix_caching=False).generate(prompts, sp)
    # 2 layers * 2 * 2 heads * 16 dims * 4 bytes = 512 B per token: 48 KB holds ~96 tokens, far fewer than needed
    small = Engine(llama, kv_cache_memory=48 << 10, block_size=4, enable_prefix_caching=prefix_caching)
    out = small.generate(prompts, sp)
    assert small.stats.num_preemptions > 0, "the budget was meant to force preemption"
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert_all_blocks_free(small)


def test_abort_frees_blocks_and_reports(llama):
    eng = Engine(llama, kv_cache_memory=8 << 20, block_size=4)
    ids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)) for p in random_prompts(4)]
    eng.step()
    eng.step()
    assert eng.abort(ids[1])
    finished = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o
    assert finished[ids[1]].finish_reason == "abort"
    assert len(finished[ids[1]].token_ids) < 50
    assert all(finished[i].finish_reason == "length" and len(finished[i].token_ids) == 50 for i in ids if i != ids[1])
    assert_all_blocks_free(eng)


def test_seeded_sampling_is_batch_independent(llama):
    eng = Engine(llama, kv_cache_memory=8 << 20)
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, seed=1234, ignore_eos=True)
    target = "the quick brown fox"
    alone = eng.generate([target], sp)[0].token_ids
    others = random_prompts(7, seed=5)
    mixed = others[:3] + [target] + others[3:]
    params = [SamplingParams(temperature=0.8, max_tokens=16, seed=i) for i in range(3)] + [sp] + [
        SamplingParams(temperature=0, max_tokens=16) for _ in range(4)
    ]
    batched = eng.generate(mixed, params)[3].token_ids
    assert batched == alone
    # a different seed gives (with overwhelming probability) a different sample
    other = eng.generate([target], SamplingParams(temperature=1.0, max_tokens=16, seed=99, ignore_eos=True))[0]
    assert other.token_ids != alone


def test_unseeded_runs_are_reproducible_with_engine_seed(llama):
    sp = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    prompts = random_prompts(5, seed=9)
    a = Engine(llama, kv_cache_memory=8 << 20, seed=7).generate(prompts, sp)
    b = Engine(llama, kv_cache_memory=8 << 20, seed=7).generate(prompts, sp)
    c = Engine(llama, kv_cache_memory=8 << 20, seed=8).generate(prompts, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_stop_strings_stop_tokens_min_tokens(llama):
    eng = Engine(llama, kv_cache_memory=8 << 20)
    prompt = "the quick brown fox"
    free = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[: free.text.index(stop)]
    incl = eng.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    )[0]
    assert incl.text == free.text[: free.text.index(stop) + len(stop)]
    # stop token id: the 5th generated token
    tid = free.token_ids[4]
    first = free.token_ids.index(tid)
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[tid]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == tid and out.token_ids == free.token_ids[: first + 1]
    # min_tokens keeps a stop token from ending generation early
    out = eng.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[tid], min_tokens=first + 2)
    )[0]
    assert len(out.token_ids) >= first + 2
    assert tid not in out.token_ids[: first + 2]


def test_max_tokens_zero_and_length(llama):
    eng = Engine(llama, kv_cache_memory=8 << 20)
    out = eng.generate(["hello world"], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert out.finish_reason == "length" and out.token_ids == [] and out.prompt_logprobs[1] is not None
    out = eng.generate(["hello world"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_streaming_deltas_add_up(llama):
    eng = Engine(llama, kv_cache_memory=8 << 20)
    rid = eng.add_request("hello world how", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    text, toks, final = "", [], None
    while eng.has_unfinished():
        for o in eng.step():
            text += o.delta_text
            toks += o.delta_token_ids
            final = o
    assert final.finished and final.request_id == rid
    assert toks == final.token_ids and text == final.text == eng.tokenizer.decode(final.token_ids)


def test_bad_input_is_rejected_with_typed_errors_and_batch_survives(llama):
    eng = Engine(llama, kv_cache_memory=8 << 20, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="empty"):
        eng.add_request("")
    with pytest.raises(InvalidRequestError, match="empty"):
        eng.add_request([])
    with pytest.raises(PromptTooLongError, match="64"):
        eng.add_request("the " * 100)
    with pytest.raises(InvalidRequestError, match="out of range"):
        eng.add_request([1, 2, 10**9])
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(InvalidRequestError, match="unknown Engine option"):
        Engine(llama, not_an_option=1)
    outs = eng.generate(["hello world", "", "the " * 100, "quick fox"], SamplingParams(temperature=0, max_tokens=4))
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "length"]
    assert "empty" in outs[1].error and "PromptTooLong" in outs[2].error
    assert_all_blocks_free(eng)


def test_generation_stops_at_context_limit(llama):
    eng = Engine(llama, kv_cache_memory=8 << 20, max_model_len=32)
    ids = eng.tokenizer.encode("the quick brown fox jumps over")
    out = eng.generate([ids], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(ids) + len(out.token_ids) == 32


def test_chat_messages_prompt(llama):
    eng = Engine(llama, kv_cache_memory=8 << 20)
    msgs = [{"role": "user", "content": "hello"}]
    out = eng.generate([msgs], SamplingParams(temperature=0, max_tokens=3))[0]
    expected = eng.tokenizer.encode(eng.tokenizer.apply_chat_template(msgs, add_generation_prompt=True))
    assert out.prompt_token_ids == expected
    assert eng.tokenizer.decode(expected, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
