"""Attention data parallelism's cut of a step: which rank runs each sequence (the pool its blocks are
in), the sub-batches in each rank's local block ids, and the logits rows they fill (no processes)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.distributed.dp_split import RankSplit, scratch_batch, step_capacity
from deepinfer.engine.forward_batch import ForwardBatch

BS = 4
STRIDE = 10  # blocks per rank's pool: rank 0 holds ids 0..9, rank 1 10..19, rank 2 20..29


def _batch(seqs):
    """seqs: (tokens, start, block table); decodes first; logits for every sequence's last token."""
    tokens = [t for t, _, _ in seqs]
    rows, n = [], 0
    for t in tokens:
        n += len(t)
        rows.append(n - 1)
    return ForwardBatch.build(tokens, [s for _, s, _ in seqs], [b for _, _, b in seqs], rows, BS)


def test_sequences_run_where_their_pool_is_in_local_ids():
    sp = RankSplit(2, STRIDE)
    step = _batch([([3], 2, [13]), ([1], 5, [0, 1]), ([4, 4, 4, 4, 4], 4, [2, 4, 5]), ([6, 7], 0, [17])])
    subs, rows = sp.split(step)
    assert subs[0].num_seqs == 2 and subs[1].num_seqs == 2
    # local block ids: rank 1's blocks 13 and 17 are its 3 and 7
    assert subs[0].block_tables.tolist() == [[0, 1, 0], [2, 4, 5]]
    assert subs[1].block_tables.tolist() == [[3, 0, 0], [7, 0, 0]]  # (padded to the step's widest table)
    # slots in local ids, tokens and positions unchanged
    assert subs[1].slot_mapping.tolist() == [3 * BS + 2, 7 * BS, 7 * BS + 1]
    assert subs[1].input_ids.tolist() == [3, 6, 7] and subs[1].positions.tolist() == [2, 0, 1]
    assert subs[0].input_ids.tolist() == [1, 4, 4, 4, 4, 4]
    assert subs[0].num_decodes == 1 and subs[1].num_decodes == 1
    # logits: rank 0 fills the whole batch's rows 1 and 2, rank 1 rows 0 and 3
    assert [r.tolist() for r in rows] == [[1, 2], [0, 3]]


def test_a_sequence_with_blocks_in_two_pools_is_refused():
    sp = RankSplit(2, STRIDE)
    with pytest.raises(RuntimeError, match="another rank's pool"):
        sp.split(_batch([([1, 2, 3, 4, 5], 0, [3, 12])]))


def test_idle_rank_gets_the_scratch_step():
    sp = RankSplit(2, STRIDE)
    subs, rows = sp.split(_batch([([7], 6, [11, 12])]))
    assert subs[0] is None and subs[1] is not None and rows[0].numel() == 0
    assert step_capacity(subs) == 1
    s = scratch_batch(STRIDE - 1, BS)
    assert s.slot_mapping.tolist() == [(STRIDE - 1) * BS] and s.logit_rows.numel() == 0


def test_split_covers_every_token_and_logit_once():
    torch.manual_seed(0)
    sp = RankSplit(3, STRIDE)
    seqs = [([int(x) for x in torch.randint(0, 50, (n,))], 0, [(i % 3) * STRIDE + 2 * (i // 3), (i % 3) * STRIDE + 2 * (i // 3) + 1])
            for i, n in enumerate([3, 8, 1, 5, 2, 7])]
    b = _batch(seqs)
    subs, rows = sp.split(b)
    assert sorted(t for s in subs for t in s.input_ids.tolist()) == sorted(b.input_ids.tolist())
    assert sorted(torch.cat(rows).tolist()) == list(range(len(seqs)))
    assert [s.num_seqs for s in subs] == [2, 2, 2]
    for s in subs:
        assert int(s.block_tables.max()) < STRIDE - 1 and int(s.slot_mapping.max()) < (STRIDE - 1) * BS
