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


@dataclass(frozen=True)
class ExpertPlacement:
    """Where every copy of every routed expert lives (redundant experts, EPLB-style): N * S physical
    slots, rank r holding slots [r*S, (r+1)*S); `slots[p]` is the expert in slot p. Each rank's first
    E/N slots are its home experts (ExpertShard), the other R/N copies of experts it does not hold.
    With R = 0 this is ExpertShard. Each copy has a share of its expert's pairs (`shares`: set from
    the measured load so the ranks' loads level out; equal before any load), and a (token, slot) pair
    goes to the copy its place in the batch picks (`choose`): deterministic, in proportion to the
    shares. All copies have the same weights, so with a row-invariant expert GEMM the output is
    bitwise that of any other copy."""

    num_experts: int
    world_size: int
    rank: int
    slots: tuple[int, ...]
    shares: tuple[float, ...] | None = None  # per slot: its part of its expert's pairs (None: equal parts)

    @staticmethod
    def initial(num_experts: int, world_size: int, rank: int, redundant: int = 0) -> "ExpertPlacement":
        ExpertShard(num_experts, world_size, rank)  # the same checks
        E, N = num_experts, world_size
        if isinstance(redundant, bool) or not isinstance(redundant, int) or redundant < 0 or redundant % N:
            raise ExpertParallelConfigError(
                f"expert_parallel_redundant must be a multiple of expert_parallel_size={N} (>= 0), got {redundant!r}")
        if redundant and (N == 1 or redundant // N > E - E // N):
            raise ExpertParallelConfigError(
                f"expert_parallel_redundant={redundant}: a rank can hold at most {E - E // N} copies of experts "
                f"it does not own ({E} experts over {N} ranks)")
        return ExpertPlacement(E, N, rank, *_place(E, N, redundant, [0.0] * E))

    def rebalanced(self, load) -> "ExpertPlacement":
        """The placement for a measured per-expert load (tokens routed to each expert): the same
        number of copies, given to the hottest experts, on the least loaded ranks."""
        E = self.num_experts
        return ExpertPlacement(E, self.world_size, self.rank,
                               *_place(E, self.world_size, len(self.slots) - E, [float(x) for x in load]))

    @property
    def per_rank(self) -> int:
        return len(self.slots) // self.world_size

    @property
    def redundant(self) -> int:
        return len(self.slots) - self.num_experts

    def rank_experts(self, rank: int) -> list[int]:
        S = self.per_rank
        return list(self.slots[rank * S : (rank + 1) * S])

    @property
    def expert_ids(self) -> list[int]:
        return self.rank_experts(self.rank)

    def copies(self) -> dict[int, list[int]]:
        """expert -> the physical slots holding it, ascending."""
        out: dict[int, list[int]] = {}
        for p, e in enumerate(self.slots):
            out.setdefault(e, []).append(p)
        return out

    def choose(self, idx):
        """Physical slot [T, k] for each routed (row, slot) pair idx [T, k] of global expert ids: pair
        number i = row * k + slot takes the copy whose share interval holds frac((i + 1/2) * phi^-1)
        (a low-discrepancy sequence: the copies get their shares of a batch's pairs, evenly spread)."""
        import torch

        table, cum = self._tables(idx.device)
        T, k = idx.shape
        i = torch.arange(T * k, device=idx.device, dtype=torch.float64).view(T, k)
        u = torch.frac((i + 0.5) * 0.6180339887498949)
        pick = (u[..., None] >= cum[idx]).sum(-1)
        return table[idx, pick]

    def _tables(self, device):
        import torch

        cached = self.__dict__.get("_t")
        if cached is None or cached[0].device != device:
            c = self.copies()
            width = max(len(v) for v in c.values())
            table = torch.zeros(self.num_experts, width, dtype=torch.long)
            cum = torch.full((self.num_experts, width), 2.0, dtype=torch.float64)  # (2: never reached)
            for e, ps in c.items():
                table[e, : len(ps)] = torch.tensor(ps)
                part = [self.shares[p] for p in ps] if self.shares is not None else [1.0 / len(ps)] * len(ps)
                edges = torch.tensor(part, dtype=torch.float64).cumsum(0)[:-1]  # upper edges but the last
                cum[e, : len(ps) - 1] = edges
            cached = (table.to(device), cum.to(device))
            object.__setattr__(self, "_t", cached)  # (frozen dataclass: a derived cache)
        return cached


def _place(E: int, N: int, R: int, load: list[float]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Slots for R copies beyond the home experts: repeatedly, the rank with a free copy slot and the
    least load takes a copy of the hottest expert (load per copy) it does not hold; ties go to the
    expert with fewer copies, then the lower rank / expert id, so every rank computes the same
    placement from the same load (and with no load yet, the copies spread over distinct experts)."""
    home, extra = E // N, R // N
    S = home + extra
    held = [list(range(r * home, (r + 1) * home)) for r in range(N)]
    copies = [1] * E

    def rank_load(r: int) -> float:
        return sum(load[e] / copies[e] for e in held[r])

    for _ in range(R):
        r = min((r for r in range(N) if len(held[r]) < S), key=lambda r: (rank_load(r), r))
        mine = set(held[r])
        e = max((e for e in range(E) if e not in mine), key=lambda e: (load[e] / copies[e], -copies[e], -e))
        copies[e] += 1
        held[r].append(e)
    slots = tuple(e for r in range(N) for e in held[r])
    return slots, _shares(slots, S, N, load)


def _shares(slots: tuple[int, ...], S: int, N: int, load: list[float]) -> tuple[float, ...]:
    """Each copy's part of its expert's pairs: experts with one copy load their rank fully; then each
    copied expert, hottest first, is water-filled over its copies' ranks (the least loaded ranks take
    its pairs until their loads meet), so the busiest rank carries as little as the copies allow."""
    where: dict[int, list[int]] = {}
    for p, e in enumerate(slots):
        where.setdefault(e, []).append(p)
    rank_load = [0.0] * N
    for e, ps in where.items():
        if len(ps) == 1:
            rank_load[ps[0] // S] += load[e]
    shares = [1.0] * len(slots)
    for e in sorted((e for e, ps in where.items() if len(ps) > 1), key=lambda e: (-load[e], e)):
        ps = where[e]
        if load[e] <= 0:
            for p in ps:
                shares[p] = 1.0 / len(ps)
            continue
        got = _water_fill([rank_load[p // S] for p in ps], load[e])
        for p, a in zip(ps, got):
            rank_load[p // S] += a
            shares[p] = a / load[e]
    return tuple(shares)


def _water_fill(levels: list[float], total: float) -> list[float]:
    """Amounts a_i >= 0 summing to total that raise the lowest levels to one common height."""
    order = sorted(range(len(levels)), key=lambda i: levels[i])
    height, left, filled = levels[order[0]], total, 1
    for n in range(1, len(order) + 1):
        filled = n
        nxt = levels[order[n]] if n < len(order) else float("inf")
        step = min(left / n, nxt - height)
        height += step
        left -= step * n
        if left <= 1e-12 * max(1.0, total):
            break
    raised = set(order[:filled])
    return [height - levels[i] if i in raised else 0.0 for i in range(len(levels))]


def token_split(num_tokens: int, world_size: int) -> list[int]:
    """Rows of a batch each rank dispatches: contiguous, sizes differ by at most one (empty ranks
    when num_tokens < world_size)."""
    q, r = divmod(num_tokens, world_size)
    return [q + (i < r) for i in range(world_size)]


_EXPERT_TENSOR = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def expert_weight_filter(rank: int, world_size: int, redundant: int = 0):
    """For load_model(tensor_filter=): a rank reads the checkpoint's tensors except other ranks' routed
    experts (so no process ever holds the whole model; MTP layers, which expert parallelism does
    not run, are read whole). With redundant copies: its initial copies too."""

    def for_config(config):
        moe = getattr(config, "moe", None)
        if moe is None:
            return lambda name: True
        held = set(ExpertPlacement.initial(moe.num_experts, world_size, rank, redundant).expert_ids)
        L = config.num_hidden_layers

        def keep(name: str) -> bool:
            m = _EXPERT_TENSOR.match(name)
            return m is None or int(m.group(1)) >= L or int(m.group(2)) in held

        return keep

    return for_config


def no_weights(config):
    """For load_model(tensor_filter=): config and tokenizer only (the engine process of spawned workers)."""
    return lambda name: False
