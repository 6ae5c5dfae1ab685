"""Attention data parallelism: which rank runs each sequence of a step, and the step's batch cut
into one ForwardBatch per rank (each rank attends for its own sequences and dispatches its own
tokens to their experts; only the experts are shared).

A sequence runs on the rank that wrote its first KV block, so its prefix-cache hits and forks read
KV that rank holds: every block of a sequence is recorded as written by the sequence's rank, a
radix-cache path is always written by the rank of its first block (every sequence extending it
starts with that block), and a KV copy (fork) gives the copy its source block's rank. A sequence
whose first block no rank has written yet goes to the rank with the fewest tokens in this step.
Block ids stay global (one block pool in the engine), so every rank's pool has the engine's size.

A rank with no sequence in a step still takes part in every MoE layer's collectives: it runs a
one-token step on a scratch block the engine never hands out (`scratch_batch`), whose logits
nobody reads.
"""

from __future__ import annotations

import torch

from deepinfer.engine.forward_batch import ForwardBatch


class RankSplit:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self.block_rank: dict[int, int] = {}  # KV block id -> the rank that wrote it last

    def copied(self, src_block: int, dst_block: int) -> None:
        r = self.block_rank.get(src_block)
        if r is not None:
            self.block_rank[dst_block] = r

    def split(self, batch: ForwardBatch) -> tuple[list[ForwardBatch | None], list[torch.Tensor]]:
        """Per rank: its sub-batch (None: no sequence here) and, for each of its logit rows, that
        row's index in the whole batch's logits."""
        N, bs = self.world_size, batch.block_size
        lens = batch.query_lens.tolist()
        ctx = batch.context_lens.tolist()
        tables = batch.block_tables.tolist()
        B = len(lens)
        rank_of = [self.block_rank.get(tables[i][0]) for i in range(B)]
        load = [0] * N
        for i, r in enumerate(rank_of):
            if r is not None:
                load[r] += lens[i]
        for i in range(B):
            if rank_of[i] is None:
                r = min(range(N), key=lambda r: (load[r], r))
                rank_of[i] = r
                load[r] += lens[i]
            for b in tables[i][: -(-ctx[i] // bs)]:
                self.block_rank[b] = rank_of[i]
        starts = [0] * B
        for i in range(1, B):
            starts[i] = starts[i - 1] + lens[i - 1]
        where = {int(row): k for k, row in enumerate(batch.logit_rows.tolist())}  # flat row -> logits row
        subs: list[ForwardBatch | None] = []
        gathers: list[torch.Tensor] = []
        for r in range(N):
            seqs = [i for i in range(B) if rank_of[i] == r]
            if not seqs:
                subs.append(None)
                gathers.append(torch.empty(0, dtype=torch.long))
                continue
            rows = torch.cat([torch.arange(starts[i], starts[i] + lens[i]) for i in seqs])
            mine = [(new, where[int(old)]) for new, old in enumerate(rows.tolist()) if int(old) in where]
            sel = torch.tensor(seqs, dtype=torch.long)
            subs.append(ForwardBatch(
                input_ids=batch.input_ids[rows], positions=batch.positions[rows], slot_mapping=batch.slot_mapping[rows],
                query_lens=batch.query_lens[sel], context_lens=batch.context_lens[sel],
                block_tables=batch.block_tables[sel], logit_rows=torch.tensor([n for n, _ in mine], dtype=torch.long),
                num_decodes=sum(1 for i in seqs if i < batch.num_decodes), block_size=bs))
            gathers.append(torch.tensor([k for _, k in mine], dtype=torch.long))
        return subs, gathers


def scratch_batch(scratch_block: int, block_size: int) -> ForwardBatch:
    """One token at position 0 in the scratch block, no logits: an idle rank's share of a step."""
    return ForwardBatch.build([[0]], [0], [[scratch_block]], [], block_size)


def step_capacity(subs: list[ForwardBatch | None]) -> int:
    """The most tokens any rank dispatches in this step (an idle rank's scratch token counts 1)."""
    return max(s.num_tokens if s is not None else 1 for s in subs)
