"""A rank's model under expert parallelism: each MoeBlock keeps only its rank's experts (and
redundant copies) and dispatches this rank's tokens to the ranks holding their experts (dispatch.py).

Attention is data-parallel: a rank runs the whole model (embedding, attention, dense layers, router,
shared experts) only for its own sequences (dp_split.py cuts the engine's step), and its MoE layers
dispatch only its own rows, so no rank repeats another's work and no all-gather is needed. The KV
block ids stay global, so every rank's KV pool has the engine's size (a rank writes only its
sequences' blocks).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from deepinfer.distributed.dispatch import CommStats, make_dispatcher
from deepinfer.distributed.sharding import ExpertPlacement
from deepinfer.engine.models.moe import MoeBlock


class ExpertParallelMoe(nn.Module):
    """Stands in a decoder layer for its MoeBlock on one rank (same interface: forward, load, weights)."""

    def __init__(self, block: MoeBlock, shard, stats: CommStats, group=None):
        super().__init__()
        self.block = block
        self.shard = shard
        self.stats = stats
        self.group = group
        self.capacity = None  # the most rows any rank dispatches in this step (low_latency buffers)

    def forward(self, x: torch.Tensor, meta) -> torch.Tensor:
        t0 = time.perf_counter()
        self.block.dispatcher.capacity = self.capacity
        if x.shape[0]:
            y = self.block(x, meta)
        else:  # no rows here: still take part in the layer's collectives (and compute for the others)
            self.block.dispatcher(self.block, x, torch.empty(0, self.block.moe.top_k, dtype=torch.long,
                                                           device=x.device), meta)
            y = x
        self.stats.moe_s += time.perf_counter() - t0
        return y

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


def set_step_capacity(model: nn.Module, capacity: int) -> None:
    for _, m in moe_layers(model):
        m.capacity = capacity
