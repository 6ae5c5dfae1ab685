"""One KV pool per data-parallel rank (kv_pools.RankedKV): partitioned block ids, the rank choice
(balance first, then the cached prefix), per-pool capacity, preemption within the short pool, fork
and pins (no model, no processes)."""

from __future__ import annotations

import pytest

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.kv_pools import RankedKV, make_kv
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.sequence import Sequence

BS = 4
_arrivals = iter(range(10**6))


def _seq(tokens, rid=None) -> Sequence:
    a = next(_arrivals)
    return Sequence(rid or f"r{a}", list(tokens), SamplingParams(), arrival=a, rng_seed=0)


def _admit(kv, seq) -> None:
    kv.match_prefix(seq)
    assert kv.allocate_for(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens


def _check(kv: RankedKV) -> None:
    for r, p in enumerate(kv.pools):
        if p.radix is not None:
            p.radix.check_invariants()
        assert p.allocator.first == r * kv.stride


def test_one_rank_is_the_plain_manager_and_ranks_partition_the_ids():
    assert isinstance(make_kv(1, 8, BS, True), KVCacheManager)
    kv = make_kv(3, 8, BS, True)
    assert isinstance(kv, RankedKV) and kv.stride == 9 and kv.max_seq_blocks == 8
    taken = []
    for p in kv.pools:
        taken.append(set(p.allocator.allocate(8)))
        assert not p.allocator.can_allocate(1)
    assert taken == [set(range(0, 8)), set(range(9, 17)), set(range(18, 26))]  # 8, 17, 26: scratch blocks
    _check(kv)


def test_new_sequences_balance_over_ranks_and_blocks_stay_in_their_pool():
    kv = make_kv(2, 16, BS, True)
    seqs = [_seq(range(100 * i, 100 * i + 9)) for i in range(4)]
    for s in seqs:
        _admit(kv, s)
    assert [s.kv_pool for s in seqs] == [0, 1, 0, 1] and kv.live == [2, 2]
    for s in seqs:
        assert all(b // kv.stride == s.kv_pool for b in s.block_table)
    for s in seqs:
        kv.release(s)
        assert s.kv_pool is None
    assert kv.live == [0, 0]
    _check(kv)


def test_cached_prefix_wins_within_the_balance_slack_only():
    kv = make_kv(2, 32, BS, True)
    prefix = list(range(1000, 1012))  # three full pages
    first = _seq(prefix + [1, 2])
    _admit(kv, first)
    r = first.kv_pool
    kv.release(first)  # its pages go to rank r's radix cache
    assert kv.pools[r].cached_prefix_len(prefix + [7]) == 12 and kv.pools[1 - r].cached_prefix_len(prefix + [7]) == 0
    a = _seq(prefix + [3, 4])
    assert kv.match_prefix(a) == 12 and a.kv_pool == r  # equal loads: the cache decides
    kv.allocate_for(a, a.num_tokens)
    b = _seq(prefix + [5, 6])
    assert kv.match_prefix(b) == 12 and b.kv_pool == r  # one over the other rank: still within the slack
    kv.allocate_for(b, b.num_tokens)
    c = _seq(prefix + [8, 9])
    assert kv.match_prefix(c) == 0 and c.kv_pool == 1 - r  # two over: balance first, the prefix computed again
    kv.unmatch(c)
    assert c.kv_pool is None and kv.live[1 - r] == 0
    _check(kv)


def test_capacity_is_per_pool_and_preemption_stays_in_the_short_pool():
    # 2 ranks of 4 blocks; rank 0's two sequences outgrow its pool while rank 1 has room
    kv = make_kv(2, 4, BS, False)
    sched = Scheduler(EngineConfig(max_num_batched_tokens=64, enable_prefix_caching=False), kv)
    seqs = [_seq(range(10 * i, 10 * i + 8)) for i in range(4)]  # 8 tokens: 2 full blocks each
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [x.seq.kv_pool for x in out.scheduled] == [0, 1, 0, 1] and not out.preempted
    for x in out.scheduled:
        x.seq.num_computed_tokens += x.num_tokens
    assert kv.pools[0].num_free_blocks() == 0 and kv.pools[1].num_free_blocks() == 0
    # rank 1 frees one sequence; rank 0's two each need a third block next step
    sched.remove(seqs[1])
    for s in (seqs[0], seqs[2], seqs[3]):
        s.output_token_ids.append(1)
        s.num_computed_tokens = s.num_tokens - 1  # decoding: position 8 opens a third block
    assert not kv.fits([(seqs[0], 9), (seqs[2], 9)]) and kv.fits([(seqs[3], 9)])
    out = sched.schedule()
    # the newest sequence of rank 0 (seqs[2]) is preempted, not the newest overall (seqs[3], rank 1)
    assert out.preempted == [seqs[2]]
    assert [x.seq for x in out.scheduled] == [seqs[0], seqs[3]]
    assert seqs[2].kv_pool is None and seqs[0].kv_pool == 0 and seqs[3].kv_pool == 1
    assert kv.live == [1, 1]


def test_fork_children_share_their_parents_pool_and_pins_cover_every_rank():
    kv = make_kv(2, 16, BS, True)
    other = _seq(range(500, 506))
    _admit(kv, other)  # rank 0 busy: the parent goes to rank 1
    parent = _seq(range(200, 210))  # 10 tokens: 2 full pages + 2 tokens
    _admit(kv, parent)
    assert parent.kv_pool == 1
    copies = []
    kids = [_seq([]), _seq([])]
    assert kv.fork(parent, kids, lambda s, d, n: copies.append((s, d, n)))
    assert [k.kv_pool for k in kids] == [1, 1] and kv.live == [1, 3]
    assert all(s // kv.stride == d // kv.stride == 1 for s, d, _ in copies) and [n for *_, n in copies] == [2, 2]
    for s in [other, parent, *kids]:
        kv.release(s)
    # both ranks now cache a different prefix; a pin covers the rank that holds it
    h = kv.pin_prefix(list(range(200, 210)))
    assert [r for r, _ in h] == [1]
    assert kv.pin_prefix([9999, 9998, 9997, 9996, 1]) is None
    kv.reset_cache()
    assert kv.pools[1].cached_prefix_len(list(range(200, 210))) == 8  # pinned pages survive a reset
    kv.unpin(h)
    kv.reset_cache()
    assert kv.cached_prefix_len(list(range(200, 210))) == 0
    assert kv.num_free_blocks() == 32
    _check(kv)


def test_a_sequence_without_a_pool_is_a_bug_named():
    kv = make_kv(2, 8, BS, True)
    with pytest.raises(RuntimeError, match="no KV pool"):
        kv.truncate(_seq([1, 2, 3]), 1)
