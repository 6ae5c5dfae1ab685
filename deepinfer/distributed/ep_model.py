"""A worker's model under expert parallelism: each MoeBlock keeps only its rank's experts and
dispatches its tokens to the others' (dispatch.py).

Attention is *replicated* in this version: every rank runs attention (and the dense layers) for the
whole batch, with a full copy of the KV cache, so the engine's one block pool, radix cache and
preemption work unchanged. What is data-parallel is the MoE layer's token side: rank r takes its
contiguous share of the batch's rows (sharding.token_split), routes and dispatches only those, runs
the shared expert on them, and an all-gather gives every rank the whole layer output again. So the
expert GEMMs and the all-to-all traffic are what true attention data parallelism would have (each
token dispatched once, by one rank); the attention work and KV memory are N times theirs, and the
all-gather is the cost of replicating attention.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from deepinfer.distributed.dispatch import CommStats, make_dispatcher
from deepinfer.distributed.sharding import ExpertPlacement, token_split
from deepinfer.engine.models.moe import MoeBlock


class ExpertParallelMoe(nn.Module):
    """Stands in a decoder layer for its MoeBlock on one rank (same interface: forward, load, weights)."""

    def __init__(self, block: MoeBlock, shard, stats: CommStats, group=None):
        super().__init__()
        self.block = block
        self.shard = shard
        self.stats = stats
        self.group = group

    def forward(self, x: torch.Tensor, meta) -> torch.Tensor:
        t0 = time.perf_counter()
        N, r = self.shard.world_size, self.shard.rank
        sizes = token_split(x.shape[0], N)
        lo = sum(sizes[:r])
        own = x[lo : lo + sizes[r]]
        cap = max(sizes)
        self.block.dispatcher.capacity = cap
        if sizes[r]:
            y = self.block(own, meta)
        else:  # no rows here: still take part in the layer's collectives
            self.block.dispatcher(self.block, own, torch.empty(0, self.block.moe.top_k, dtype=torch.long,
                                                               device=x.device), meta)
            y = own
        t1 = time.perf_counter()
        pad = x.new_zeros(cap, x.shape[1])
        pad[: sizes[r]] = y
        parts = [torch.empty_like(pad) for _ in range(N)]
        dist.all_gather(parts, pad, group=self.group)
        out = torch.cat([p[:n] for p, n in zip(parts, sizes)], 0)
        t2 = time.perf_counter()
        self.stats.gather_bytes += (N - 1) * pad.numel() * pad.element_size()
        self.stats.gather_s += t2 - t1
        self.stats.moe_s += t2 - t0
        return out

    def load(self, prefix: str, take, put) -> None:
        self.block.load(prefix, take, put)

    def linear_weights(self) -> list[torch.Tensor]:
        return self.block.linear_weights()

    def gated_weights(self) -> list[torch.Tensor]:
        return self.block.gated_weights()


def shard_model(model: nn.Module, rank: int, world_size: int, mode: str, stats: CommStats, group=None,
                redundant: int = 0) -> int:
    """Before load: every decoder layer's MoeBlock keeps rank's experts (its home experts plus its
    initial redundant copies) and dispatches through `mode`; returns how many MoE layers were sharded
    (0: the model has none)."""
    n = 0
    for layer in getattr(model, "layers", []):
        block = getattr(layer, "mlp", None)
        if not isinstance(block, MoeBlock):
            continue
        placement = ExpertPlacement.initial(block.moe.num_experts, world_size, rank, redundant)
        block.hold_experts(placement.expert_ids)
        block.dispatcher = make_dispatcher(mode, placement, stats, group)
        layer.mlp = ExpertParallelMoe(block, placement, stats, group)
        n += 1
    return n


def moe_layers(model: nn.Module) -> list[tuple[int, "ExpertParallelMoe"]]:
    return [(i, layer.mlp) for i, layer in enumerate(getattr(model, "layers", []))
            if isinstance(layer.mlp, ExpertParallelMoe)]
