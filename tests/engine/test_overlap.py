"""The overlapped engine loop (plan step N+1 while step N runs) gives the same outputs as the
synchronous loop, and frees every KV block exactly once."""

from __future__ import annotations

import random

import pytest

from deepinfer import Engine, SamplingParams
from test_engine_core import WORDS, assert_all_blocks_free


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 40) -> list[str]:
    r = random.Random(seed)
    return [" ".join(r.choice(WORDS) for _ in range(r.randint(lo, hi))) for _ in range(n)]


def _mixed_params(n: int, seed: int, constrained: bool) -> list[SamplingParams]:
    r = random.Random(seed)
    out = []
    for i in range(n):
        kind = r.choice(["greedy", "seeded", "stop", "min", "regex", "choices"] if constrained else
                        ["greedy", "seeded", "stop", "min"])
        if kind == "greedy":
            out.append(SamplingParams(temperature=0, max_tokens=r.randint(1, 20)))
        elif kind == "seeded":
            out.append(SamplingParams(temperature=0.9, top_k=40, max_tokens=r.randint(1, 20), seed=i))
        elif kind == "stop":
            out.append(SamplingParams(temperature=0, max_tokens=20, stop=[r.choice(["o", "e", " the"])]))
        elif kind == "min":
            out.append(SamplingParams(temperature=0.7, max_tokens=12, min_tokens=8, seed=i + 100))
        elif kind == "regex":
            out.append(SamplingParams(temperature=0.8, seed=i, max_tokens=24, regex=r"(yes|no), [a-z]{2,6}!"))
        else:
            out.append(SamplingParams(temperature=0.8, seed=i, max_tokens=8, choices=["alpha", "beta", "gamma delta"]))
    return out


def _run(engine: Engine, prompts, params, abort_ids=(), abort_after=3):
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done, steps = {}, 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        steps += 1
        if steps == abort_after:
            for i in abort_ids:
                engine.abort(ids[i])
    return [done[i] for i in ids]


def _same(a, b, skip=()):
    # aborted requests stop at a point that depends on the loop's timing: compare the others
    a = [o for i, o in enumerate(a) if i not in skip]
    b = [o for i, o in enumerate(b) if i not in skip]
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.text for o in a] == [o.text for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]


@pytest.mark.parametrize("constrained", [False, True])
@pytest.mark.parametrize("kv_memory", [8 << 20, 40 << 10])  # roomy, and tight enough to preempt
def test_overlap_equals_sync_on_mixed_workloads(tiny_models, constrained, kv_memory):
    path = str(tiny_models["llama"])
    prompts = _prompts(24, seed=3)
    shared = "the quick brown fox jumps over the lazy dog " * 3
    prompts += [shared + p for p in _prompts(8, seed=4, hi=8)]  # prefix-cache hits
    params = _mixed_params(len(prompts), seed=5, constrained=constrained)
    results = {}
    for overlap in (False, True):
        eng = Engine(path, kv_cache_memory=kv_memory, block_size=4, overlap_schedule=overlap,
                     max_num_batched_tokens=64)
        results[overlap] = _run(eng, prompts, params, abort_ids=(1, 7))
        assert results[overlap][1].finish_reason == "abort"
        assert_all_blocks_free(eng)
        if kv_memory < 1 << 20:
            assert eng.stats.num_preemptions > 0
        if overlap:
            assert eng.stats.wait_time > 0  # the engine thread did wait on worker forwards
    _same(results[False], results[True], skip=(1, 7))


def test_overlap_generate_and_fork(tiny_models):
    path = str(tiny_models["llama"])
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = _prompts(10, seed=9)
    a = Engine(path, kv_cache_memory=8 << 20, overlap_schedule=False).generate(prompts, sp)
    eng = Engine(path, kv_cache_memory=8 << 20, overlap_schedule=True)
    b = eng.generate(prompts, sp)
    _same(a, b)
    assert_all_blocks_free(eng)
    parent = eng.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for _ in range(3):
        eng.step()
    kids = eng.fork(parent, 2, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert len(done[parent].token_ids) == 20
    assert all(len(done[k].token_ids) == 5 for k in kids)
    assert_all_blocks_free(eng)
