"""Which experts a rank owns: rank r of N holds the routed experts [r*E/N, (r+1)*E/N); shared experts
are replicated on every rank. E must divide evenly (a clear error otherwise), so every expert id
maps to its owner by one integer division and the low-latency buffers have one shape on all ranks."""

from __future__ import annotations

import re
from dataclasses import dataclass

from deepinfer.errors import ExpertParallelConfigError


@dataclass(frozen=True)
class ExpertShard:
    num_experts: int
    world_size: int
    rank: int

    def __post_init__(self) -> None:
        E, N = self.num_experts, self.world_size
        if isinstance(N, bool) or not isinstance(N, int) or N < 1:
            raise ExpertParallelConfigError(f"expert_parallel_size must be an int >= 1, got {N!r}")
        if E % N:
            raise ExpertParallelConfigError(
                f"expert_parallel_size={N} does not divide the model's {E} routed experts; "
                f"use a divisor of {E}")
        if not 0 <= self.rank < N:
            raise ExpertParallelConfigError(f"rank {self.rank} outside [0, {N})")

    @property
    def per_rank(self) -> int:
        return self.num_experts // self.world_size

    @property
    def expert_ids(self) -> range:
        n = self.per_rank
        return range(self.rank * n, (self.rank + 1) * n)

    def owner(self, expert: int) -> int:
        return expert // self.per_rank


def token_split(num_tokens: int, world_size: int) -> list[int]:
    """Rows of a batch each rank dispatches: contiguous, sizes differ by at most one (empty ranks
    when num_tokens < world_size)."""
    q, r = divmod(num_tokens, world_size)
    return [q + (i < r) for i in range(world_size)]


_EXPERT_TENSOR = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def expert_weight_filter(rank: int, world_size: int):
    """For load_model(tensor_filter=): a rank reads the checkpoint's tensors except other ranks' routed
    experts (so no process ever holds the whole model; MTP layers, which expert parallelism does
    not run, are read whole)."""

    def for_config(config):
        moe = getattr(config, "moe", None)
        if moe is None:
            return lambda name: True
        held = set(ExpertShard(moe.num_experts, world_size, rank).expert_ids)
        L = config.num_hidden_layers

        def keep(name: str) -> bool:
            m = _EXPERT_TENSOR.match(name)
            return m is None or int(m.group(1)) >= L or int(m.group(2)) in held

        return keep

    return for_config


def no_weights(config):
    """For load_model(tensor_filter=): config and tokenizer only (the engine process of spawned workers)."""
    return lambda name: False
