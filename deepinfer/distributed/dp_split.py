"""Attention data parallelism: the step's batch cut into one ForwardBatch per rank (each rank
attends for its own sequences and dispatches its own tokens to their experts; only the experts are
shared).

Each rank has its own KV pool: the engine's block ids are partitioned (engine/kv_pools.py, rank r
holds ids r * stride .. r * stride + stride - 1, its scratch block last), so a sequence's blocks name
its rank, and a rank's sub-batch carries local ids (global - r * stride). Which rank runs a sequence
is decided when it is admitted (kv_pools.RankedKV): the KV pool it gets is the rank it runs on.

A rank with no sequence in a step still takes part in every MoE layer's collectives: it runs a
one-token step on its scratch block (`scratch_batch`), whose logits nobody reads.
"""

from __future__ import annotations

import torch

from deepinfer.engine.forward_batch import ForwardBatch


class RankSplit:
    def __init__(self, world_size: int, stride: int):
        self.world_size = world_size
        self.stride = stride  # blocks per rank's pool, its scratch block included

    def local(self, block: int) -> tuple[int, int]:
        """(rank, local id) of a global block id."""
        return divmod(block, self.stride)

    def split(self, batch: ForwardBatch) -> tuple[list[ForwardBatch | None], list[torch.Tensor]]:
        """Per rank: its sub-batch in local block ids (None: no sequence here) and, for each of its
        logit rows, that row's index in the whole batch's logits."""
        N, bs, P = self.world_size, batch.block_size, self.stride
        lens = batch.query_lens.tolist()
        B = len(lens)
        rank_of = (batch.block_tables[:, 0] // P).tolist()
        used = -(-batch.context_lens // bs)  # blocks each sequence's context covers
        cols = torch.arange(batch.block_tables.shape[1])
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
            sel = torch.tensor(seqs, dtype=torch.long)
            tables = batch.block_tables[sel]
            live = cols[None, :] < used[sel][:, None]
            if bool(((tables // P != r) & live).any()):
                raise RuntimeError(f"a sequence run on rank {r} has KV blocks of another rank's pool: {tables.tolist()}")
            rows = torch.cat([torch.arange(starts[i], starts[i] + lens[i]) for i in seqs])
            mine = [(new, where[int(old)]) for new, old in enumerate(rows.tolist()) if int(old) in where]
            subs.append(ForwardBatch(
                input_ids=batch.input_ids[rows], positions=batch.positions[rows],
                slot_mapping=batch.slot_mapping[rows] - r * P * bs,
                query_lens=batch.query_lens[sel], context_lens=batch.context_lens[sel],
                block_tables=torch.where(live, tables - r * P, 0),
                logit_rows=torch.tensor([n for n, _ in mine], dtype=torch.long),
                num_decodes=sum(1 for i in seqs if i < batch.num_decodes), block_size=bs))
            gathers.append(torch.tensor([k for _, k in mine], dtype=torch.long))
        return subs, gathers


def scratch_batch(scratch_block: int, block_size: int) -> ForwardBatch:
    """One token at position 0 in the scratch block, no logits: an idle rank's share of a step."""
    return ForwardBatch.build([[0]], [0], [[scratch_block]], [], block_size)


def step_capacity(subs: list[ForwardBatch | None]) -> int:
    """The most tokens any rank dispatches in this step (an idle rank's scratch token counts 1)."""
    return max(s.num_tokens if s is not None else 1 for s in subs)
