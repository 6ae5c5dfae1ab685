"""Redundant experts, re-placed from measured load (EPLB-style), on every rank at once.

Each MoE layer's dispatcher counts the tokens this rank routed to each expert since the last
rebalance. `rebalance` (a command every rank runs between two forward steps, in the same order)
sums those counts over the group (one all_reduce), computes each layer's new placement
(sharding.ExpertPlacement.rebalanced: the same answer on every rank from the same sums), reads the
copies this rank must now hold from the checkpoint (only those tensors), swaps them into the
layer's block (MoeBlock.swap_experts, which repacks its expert kernel) and starts counting anew.
Outputs do not change: every copy has the same weights and the expert GEMM is row-invariant.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from deepinfer.distributed.ep_model import moe_layers


def rebalance(model, model_source: str, cache_dir=None, group=None) -> dict:
    """Re-place every MoE layer's redundant copies; returns {layer: {"slots": [...], "load": [...]}}
    (the placement each layer now has and the load it was computed from)."""
    layers = moe_layers(model)
    if not layers:
        return {}
    loads = torch.stack([m.block.dispatcher.load for _, m in layers]).to(torch.float64)
    dist.all_reduce(loads, group=group)
    plans = []
    need: dict[int, list[int]] = {}
    for (i, m), load in zip(layers, loads):
        p = m.block.dispatcher.placement
        new = p.rebalanced(load.tolist()) if p.redundant else p
        plans.append(new)
        held = set(m.block.local_experts)
        missing = [e for e in new.expert_ids if e not in held]
        if missing:
            need[i] = missing
    weights = _read_experts(model_source, cache_dir, need) if need else {}
    layers[0][1].block.dispatcher.stats.rebalances += 1
    report = {}
    for (i, m), new, load in zip(layers, plans, loads):
        if i in need:
            prefix = f"model.layers.{i}.mlp.experts."

            def fetch(e, prefix=prefix):
                p = f"{prefix}{e}."
                return (torch.cat([weights[p + "gate_proj.weight"], weights[p + "up_proj.weight"]], 0),
                        weights[p + "down_proj.weight"])

            m.block.swap_experts(new.expert_ids, fetch)
        m.block.dispatcher.placement = new
        m.shard = new
        m.block.dispatcher.load.zero_()
        report[i] = {"slots": list(new.slots), "load": [int(x) for x in load.tolist()]}
    return report


def _read_experts(model_source: str, cache_dir, need: dict[int, list[int]]) -> dict[str, torch.Tensor]:
    """Just the tensors of the (layer, expert) pairs in `need`, from the checkpoint."""
    from deepinfer.engine.loader import load_model

    want = {f"model.layers.{i}.mlp.experts.{e}." for i, es in need.items() for e in es}

    def tensor_filter(config):
        return lambda name: any(name.startswith(w) for w in want)

    return load_model(model_source, cache_dir=cache_dir, tensor_filter=tensor_filter).weights
