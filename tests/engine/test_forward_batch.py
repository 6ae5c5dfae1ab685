"""The step as plain data: ForwardBatch layout, KV truncation of rejected drafts, draft verification."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.block_allocator import BlockAllocator
from deepinfer.engine.drafter import NgramDrafter
from deepinfer.engine.forward_batch import ForwardBatch
from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.radix_cache import RadixCache
from deepinfer.engine.sample_step import accepted_run
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.sequence import Sequence


def test_build_lays_out_decodes_verify_runs_and_chunks():
    # seq 0: decode at position 5; seq 1: last token + 2 drafts from position 3; seq 2: prefill of 4
    b = ForwardBatch.build(
        tokens=[[7], [1, 2, 3], [4, 5, 6, 7]], starts=[5, 3, 0], block_tables=[[2, 3], [0, 1], [4, 5]],
        logit_rows=[0, 1, 2, 3, 7], block_size=4,
    )
    assert b.num_decodes == 1 and b.num_seqs == 3 and b.num_tokens == 8
    assert b.positions.tolist() == [5, 3, 4, 5, 0, 1, 2, 3]
    assert b.query_lens.tolist() == [1, 3, 4]
    assert b.context_lens.tolist() == [6, 6, 4]
    # slot = block_table[pos // 4] * 4 + pos % 4
    assert b.slot_mapping.tolist() == [3 * 4 + 1, 0 * 4 + 3, 1 * 4 + 0, 1 * 4 + 1, 16, 17, 18, 19]
    assert b.input_ids.tolist() == [7, 1, 2, 3, 4, 5, 6, 7]
    assert b.logit_rows.tolist() == [0, 1, 2, 3, 7]


def test_build_refuses_bad_layouts():
    with pytest.raises(ValueError, match="decodes must come before"):
        ForwardBatch.build([[1, 2], [3]], [0, 4], [[0], [1, 2]], [], block_size=4)
    with pytest.raises(ValueError, match="does not cover"):
        ForwardBatch.build([[1, 2, 3]], [3], [[0]], [], block_size=4)  # positions 3..5 need 2 blocks
    with pytest.raises(ValueError, match="at least one query token"):
        ForwardBatch.build([[1], []], [2, 0], [[0], [1]], [], block_size=4)


def test_decode_only_steps_build_the_same_tensors_as_the_general_layout():
    """build's fast path for single-token decodes against the general one, field by field"""
    import random

    r = random.Random(0)
    for _ in range(200):
        n, bs = r.randint(1, 20), r.choice([1, 4, 16])
        starts = [r.randint(1, 80) for _ in range(n)]
        tables = [[r.randint(0, 500) for _ in range(s // bs + 1 + r.randint(0, 2))] for s in starts]
        tokens = [[r.randint(0, 1000)] for _ in range(n)]
        rows = sorted(r.sample(range(n), r.randint(0, n)))
        fast = ForwardBatch.build(tokens, starts, tables, rows, bs)
        ref = ForwardBatch._build_any(tokens, starts, tables, rows, bs)
        for f in ("input_ids", "positions", "slot_mapping", "query_lens", "context_lens", "block_tables", "logit_rows"):
            a, b = getattr(fast, f), getattr(ref, f)
            assert a.dtype == b.dtype and torch.equal(a, b), f
        assert fast.num_decodes == ref.num_decodes == n and fast.block_size == bs
    with pytest.raises(ValueError, match="does not cover"):
        ForwardBatch.build([[1], [2]], [3, 4], [[0], [1]], [], block_size=4)  # position 4 is in block 1


def _seq(tokens: list[int]) -> Sequence:
    return Sequence("r", list(tokens), SamplingParams(), arrival=0, rng_seed=0)


def test_truncate_frees_draft_blocks_and_keeps_the_tree_clean():
    alloc = BlockAllocator(16, block_size=2)
    radix = RadixCache(alloc)
    kv = KVCacheManager(alloc, radix)
    seq = _seq(list(range(5)))  # 5 verified tokens
    assert kv.allocate_for(seq, 5 + 3)  # room for the last token + 3 drafts: positions 4..7
    seq.num_computed_tokens = 8  # as after a verify step
    assert len(seq.block_table) == 4 and alloc.num_free == 12
    kv.truncate(seq, 6)  # one draft accepted: KV valid for positions 0..5
    assert seq.num_computed_tokens == 6 and len(seq.block_table) == 3 and alloc.num_free == 13
    kv.truncate(seq, 9)  # never grows
    assert seq.num_computed_tokens == 6
    # released with 5 verified tokens: only the full pages of verified tokens reach the tree
    kv.release(seq)
    assert radix.peek_prefix_len(list(range(5)) + [99]) == 4
    radix.check_invariants()
    radix.reset()
    assert alloc.num_free == 16


def test_truncate_never_cuts_into_shared_pages():
    alloc = BlockAllocator(8, block_size=2)
    radix = RadixCache(alloc)
    kv = KVCacheManager(alloc, radix)
    first = _seq([1, 2, 3, 4, 5])
    kv.allocate_for(first, 5)
    first.num_computed_tokens = 5
    kv.release(first)  # pages [1,2], [3,4] cached
    seq = _seq([1, 2, 3, 4, 5, 6])
    assert kv.match_prefix(seq) == 4 and seq.num_tree_blocks == 2
    kv.allocate_for(seq, 8)
    seq.num_computed_tokens = 8
    with pytest.raises(ValueError, match="shared through the prefix cache"):
        kv.truncate(seq, 3)
    kv.truncate(seq, 4)
    assert seq.block_table[:2] == first_blocks_of(radix, [1, 2, 3, 4]) and len(seq.block_table) == 2
    kv.release(seq)
    radix.check_invariants()


def first_blocks_of(radix: RadixCache, tokens: list[int]) -> list[int]:
    return list(radix.match_prefix(tokens).blocks)


@pytest.mark.parametrize(
    "samples, drafts, valid, expected",
    [
        ([5, 6, 7, 8], [5, 6, 7], 4, [5, 6, 7, 8]),  # all drafts accepted + the bonus token
        ([5, 9, 7, 8], [5, 6, 7], 4, [5, 9]),  # draft 2 rejected: the target's token replaces it
        ([4, 6, 7, 8], [5, 6, 7], 4, [4]),  # first draft rejected
        ([5, 6, 7, 8], [5, 6, 7], 2, [5, 6]),  # grammar cut after draft 1: rows 2.. are not valid
        ([3], [], 1, [3]),  # plain decode
    ],
)
def test_accepted_run(samples, drafts, valid, expected):
    assert accepted_run(samples, drafts, valid) == expected


def test_ngram_drafter_proposes_the_continuation_of_the_latest_match():
    d = NgramDrafter(max_draft=3, min_n=1, max_n=3)
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 1, 2, 3]
    assert d.propose(tokens, 3) == ([5, 1, 2], 3)  # the most recent "1 2 3" is followed by 5
    assert d.propose(tokens, 1) == ([5], 3)
    assert d.propose([1, 2, 3, 4], 3) == ([], 0)  # no earlier occurrence of any suffix
    assert d.propose([7, 8, 7], 4) == ([8, 7], 1)  # falls back to a 1-gram, stops at the end
    assert NgramDrafter(2, min_n=2).propose([7, 8, 7], 4) == ([], 0)
    with pytest.raises(ValueError):
        NgramDrafter(0)


def test_suffix_index_drafts_from_other_outputs():
    from deepinfer.engine.drafter import SuffixIndex

    idx = SuffixIndex(min_n=2, max_n=3, max_entries=100)
    idx.add([10, 11, 12, 13, 14, 15])
    assert idx.lookup([1, 11, 12], 3) == ([13, 14, 15], 2)
    assert idx.lookup([10, 11, 12], 2) == ([13, 14], 3)
    assert idx.lookup([12, 99], 3) == ([], 0)
    idx.add([20, 11, 12, 40])  # newer occurrence wins
    assert idx.lookup([5, 11, 12], 2) == ([40], 2)
    d = NgramDrafter(4, index=idx)
    # the sequence's own 1-gram match loses to the index's 2-gram match
    assert d.propose_keyed([7, 12, 8, 11, 12], 4) == ([40], ("suffix", 2))
    # an own match of 2+ tokens is preferred
    assert d.propose_keyed([11, 12, 9, 11, 12], 4) == ([9, 11, 12], ("ngram", 2))
    small = SuffixIndex(min_n=2, max_n=2, max_entries=3)
    small.add(list(range(10)))
    assert len(small._at) == 3 and small.lookup([7, 8], 1) == ([9], 2) and small.lookup([0, 1], 1) == ([], 0)
