"""Attention data parallelism's cut of a step: which rank runs each sequence, the sub-batches, and the
logits rows they fill (no processes)."""

from __future__ import annotations

import torch

from deepinfer.distributed.dp_split import RankSplit, scratch_batch, step_capacity
from deepinfer.engine.forward_batch import ForwardBatch

BS = 4


def _batch(seqs):
    """seqs: (tokens, start, block table); decodes first; logits for every sequence's last token."""
    tokens = [t for t, _, _ in seqs]
    rows, n = [], 0
    for t in tokens:
        n += len(t)
        rows.append(n - 1)
    return ForwardBatch.build(tokens, [s for _, s, _ in seqs], [b for _, _, b in seqs], rows, BS)


def test_sequences_balance_then_stay_where_their_kv_is():
    sp = RankSplit(2)
    step1 = _batch([([1, 2, 3, 4, 5], 0, [10, 11]), ([6, 7], 0, [12]), ([8, 9, 10], 0, [13])])
    subs, rows = sp.split(step1)
    assert [s.num_seqs for s in subs] == [1, 2]  # 5 tokens on rank 0; 2 + 3 on rank 1
    assert sp.block_rank == {10: 0, 11: 0, 12: 1, 13: 1}
    # every sub-batch row carries the original tokens, slots and positions of its sequences
    assert subs[1].input_ids.tolist() == [6, 7, 8, 9, 10] and subs[1].slot_mapping.tolist() == [48, 49, 52, 53, 54]
    assert [r.tolist() for r in rows] == [[0], [1, 2]]  # logits rows: rank 0 fills row 0, rank 1 rows 1, 2
    # next step: decodes, in another order, plus a sequence whose prefix (block 10) rank 0 wrote
    step2 = _batch([([3], 2, [13]), ([1], 5, [10, 11]), ([4, 4, 4, 4, 4], 4, [10, 14, 15])])
    subs, rows = sp.split(step2)
    assert subs[0].block_tables[:, 0].tolist() == [10, 10] and subs[1].block_tables[:, 0].tolist() == [13]
    assert subs[0].num_decodes == 1 and subs[1].num_decodes == 1
    assert [r.tolist() for r in rows] == [[1, 2], [0]]
    assert sp.block_rank[14] == sp.block_rank[15] == 0


def test_copied_block_follows_its_source_and_idle_rank_gets_scratch():
    sp = RankSplit(2)
    sp.split(_batch([([1, 2, 3, 4, 5, 6], 0, [20, 21])]))
    r = sp.block_rank[20]
    sp.copied(20, 30)  # a fork without the radix cache copies the parent's pages
    subs, rows = sp.split(_batch([([7], 6, [30, 31])]))
    assert subs[r] is not None and subs[1 - r] is None and rows[1 - r].numel() == 0
    assert step_capacity(subs) == 1
    s = scratch_batch(99, BS)
    assert s.slot_mapping.tolist() == [99 * BS] and s.logit_rows.numel() == 0


def test_split_covers_every_token_and_logit_once():
    torch.manual_seed(0)
    sp = RankSplit(3)
    seqs = [([int(x) for x in torch.randint(0, 50, (n,))], 0, [i * 2, i * 2 + 1]) for i, n in enumerate([3, 8, 1, 5, 2, 7])]
    b = _batch(seqs)
    subs, rows = sp.split(b)
    assert sorted(t for s in subs for t in s.input_ids.tolist()) == sorted(b.input_ids.tolist())
    assert sorted(torch.cat(rows).tolist()) == list(range(len(seqs)))
    assert max(s.num_tokens for s in subs) - min(s.num_tokens for s in subs) <= 8
