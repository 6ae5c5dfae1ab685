"""A CI-sized soak (issue 21): a few hundred mixed requests under a KV budget far below the load,
with random aborts and forks mid-flight, overlap on and off. Every request, fork child included,
finishes exactly once; no KV block leaks; the radix cache's invariants hold throughout."""

from __future__ import annotations

import random

import pytest

from deepinfer import Engine, SamplingParams
from test_engine_core import WORDS, assert_all_blocks_free

N_REQUESTS = 200


def _params(r: random.Random, i: int) -> SamplingParams:
    kind = r.choice(["greedy", "sampled", "stop", "regex", "choices", "long"])
    if kind == "greedy":
        return SamplingParams(temperature=0, max_tokens=r.randint(0, 12), ignore_eos=r.random() < 0.5)
    if kind == "sampled":
        return SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=r.randint(1, 12))
    if kind == "stop":
        return SamplingParams(temperature=0.5, seed=i, max_tokens=16, stop=[r.choice(["e", " the", "o"])])
    if kind == "regex":
        return SamplingParams(temperature=0.8, seed=i, max_tokens=12, regex=r"(yes|no), [a-z]{2,6}!")
    if kind == "choices":
        return SamplingParams(temperature=0.8, seed=i, max_tokens=8, choices=["alpha", "beta", "gamma delta"])
    return SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _check_kv(eng: Engine) -> None:
    radix = eng.kv.radix
    if radix is not None:
        radix.check_invariants()
    cached = radix.evictable_blocks + radix.protected_blocks if radix is not None else 0
    assert eng.kv.allocator.num_free + cached <= eng.kv.allocator.num_blocks


@pytest.mark.parametrize("overlap", [False, True])
def test_soak_every_request_finishes_once_and_nothing_leaks(tiny_models, overlap):
    r = random.Random(1234 + overlap)
    # 96 KB of KV (~190 tokens at 512 B/token) for dozens of live requests: constant preemption
    eng = Engine(str(tiny_models["llama"]), kv_cache_memory=96 << 10, block_size=4, max_num_seqs=16,
                 overlap_schedule=overlap)
    pool_tokens = eng.kv.allocator.num_blocks * eng.config.block_size
    submitted: set[str] = set()
    finished: dict[str, int] = {}
    aborted: set[str] = set()
    shared = " ".join(r.choice(WORDS) for _ in range(12))  # a common prefix for the radix cache
    n_sub = steps = forks = 0
    while n_sub < N_REQUESTS or eng.has_unfinished():
        for _ in range(r.randint(0, 6) if n_sub < N_REQUESTS else 0):
            words = " ".join(r.choice(WORDS) for _ in range(r.randint(1, 20)))
            prompt = shared + " " + words if r.random() < 0.5 else words
            submitted.add(eng.add_request(prompt, _params(r, n_sub)))
            n_sub += 1
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = finished.get(out.request_id, 0) + 1
                if out.finish_reason == "error":
                    # the one error allowed: a request whose prompt + output outgrew the whole pool
                    assert "not enough KV cache blocks" in out.error, out.error
                    assert len(out.prompt_token_ids) + len(out.token_ids) + 1 > pool_tokens - eng.config.block_size
                else:
                    assert out.finish_reason in ("stop", "length", "abort"), out
        steps += 1
        live = [i for i in submitted if i not in finished]
        if live and r.random() < 0.1:
            victim = r.choice(live)
            if eng.abort(victim):
                aborted.add(victim)
        if live and r.random() < 0.1:
            parent = r.choice(live)
            try:
                kids = eng.fork(parent, r.randint(1, 2), SamplingParams(temperature=0.7, seed=steps, max_tokens=4))
            except Exception as e:  # only "no such running request" is allowed here
                assert "cannot fork" in str(e), e
            else:
                submitted.update(kids)
                forks += len(kids)
        if steps % 25 == 0:
            _check_kv(eng)
        assert steps < 20000, "the soak did not converge"
    assert set(finished) == submitted, "a request never finished"
    assert all(n == 1 for n in finished.values()), {k: n for k, n in finished.items() if n != 1}
    assert aborted and forks > 0, "the soak was meant to abort and fork"
    assert eng.stats.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert_all_blocks_free(eng)
