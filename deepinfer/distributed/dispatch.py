"""Dispatch / combine of MoE tokens across expert-parallel ranks, with all-to-all.

A dispatcher is set on a MoeBlock (`block.dispatcher`) and replaces its local expert step: called as
`dispatcher(block, x, idx, meta)` with this rank's tokens x [T, H] and their routed global expert
ids idx [T, k] (from `block.route`), it returns [T, k, H], the output of expert idx[t, j] on token t,
computed on the rank that owns that expert (`block.grouped_experts` there, over the local experts'
indices). The block then sums the slots in top-k slot order as it always does, so the sum never
depends on the order in which outputs arrive, nor on the number of ranks: with a row-invariant
expert GEMM (`batch_invariant=True`) an expert's output row does not depend on which other rows
share its GEMM, and the result is bitwise that of the single-process block.

Two modes:
Which rank computes a (token, slot) pair: the one holding the copy of its expert that the layer's
placement (sharding.ExpertPlacement) picks; without redundant experts, the expert's owner.

* normal: the ranks first exchange how many tokens each sends to each (one all_to_all of N counts),
  then each token travels once to every rank that holds a copy picked for one of its slots, carrying the
  expert ids of the slots it needs there (-1 elsewhere, packed bit-for-bit behind the hidden state
  in the same message), with `all_to_all_single` and uneven splits. The receiver runs one GEMM per
  local expert over its (row, slot) pairs and sends the pair outputs back in the order it got them;
  the sender knows that order (row-major over its own routing), so no counts travel back.
* low_latency: fixed-size per-slot buffers [E + R, capacity + 1, H] (the first row of each carries
  the count of valid rows), one fixed all_to_all each way and no count exchange. capacity bounds the
  rows any rank dispatches in this call (every rank knows it from the batch size); the buffers
  are sized by it, not by the routing, so the bytes are fixed and larger than normal mode's.

`CommStats` counts the bytes each rank sends to other ranks and the time spent in collectives
versus the expert GEMM.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from deepinfer.distributed.sharding import ExpertPlacement, ExpertShard


@dataclass
class CommStats:
    """Per-rank counters; bytes count only what leaves this rank (the self-chunk stays local)."""

    moe_layers: int = 0  # MoE layer calls on this rank
    tokens: int = 0  # tokens this rank dispatched (summed over MoE layer calls)
    dispatch_bytes: int = 0
    combine_bytes: int = 0
    count_bytes: int = 0  # normal mode's count exchange
    dispatch_s: float = 0.0
    combine_s: float = 0.0
    expert_s: float = 0.0  # the local expert GEMMs
    moe_s: float = 0.0  # whole MoE layers (routing, shared expert, dispatch, experts, combine)
    forward_s: float = 0.0  # whole forward passes on this rank
    remote_token_ranks: int = 0  # normal mode: (token, other rank) pairs this rank's routing sent
    remote_slots: int = 0  # (token, slot) pairs whose expert lives on another rank
    rebalances: int = 0  # redundant-expert re-placements done (eplb.py)
    expert_pairs: int = 0  # (token, slot) pairs this rank's experts computed (its share of the expert work)
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}

    def reset(self) -> None:
        self.__init__()


def _pack_ids(ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int ids [n, k] as columns of `dtype` holding their int32 bits (moved, never computed on)."""
    return ids.to(torch.int32).contiguous().view(dtype)


def _unpack_ids(cols: torch.Tensor) -> torch.Tensor:
    return cols.contiguous().view(torch.int32).long()


class _Dispatcher:
    mode = ""

    def __init__(self, placement: ExpertPlacement | ExpertShard, stats: CommStats | None = None, group=None):
        if isinstance(placement, ExpertShard):
            placement = ExpertPlacement.initial(placement.num_experts, placement.world_size, placement.rank)
        self.placement = placement
        self.stats = stats if stats is not None else CommStats()
        self.group = group
        self.capacity = None  # low_latency: rows any rank dispatches in this call (set per call)
        # tokens routed to each expert by this rank since the last rebalance (eplb.py)
        self.load = torch.zeros(placement.num_experts, dtype=torch.long)

    def _count(self, idx: torch.Tensor) -> None:
        self.load += torch.bincount(idx.reshape(-1).cpu(), minlength=self.placement.num_experts)

    def _a2a(self, out, inp, out_splits=None, in_splits=None):
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)

    def _experts(self, block, xs: torch.Tensor, ids: torch.Tensor, meta) -> torch.Tensor:
        """[P, H]: expert ids[p] (a global id this rank holds) on row xs[p]."""
        t0 = time.perf_counter()
        if xs.shape[0] == 0:
            y = xs.new_empty(0, xs.shape[1])
        else:
            y = block.grouped_experts(xs, ids[:, None], meta)[:, 0]
        self.stats.expert_pairs += xs.shape[0]
        self.stats.expert_s += time.perf_counter() - t0
        return y


class NormalDispatcher(_Dispatcher):
    mode = "normal"

    def __call__(self, block, x: torch.Tensor, idx: torch.Tensor, meta) -> torch.Tensor:
        pl, st = self.placement, self.stats
        N, r = pl.world_size, pl.rank
        T, k = idx.shape
        H = x.shape[1]
        t0 = time.perf_counter()
        self._count(idx)
        dest = pl.choose(idx) // pl.per_rank  # [T, k] the rank holding the copy each slot goes to
        hit = torch.zeros(T, N, dtype=torch.bool, device=x.device)
        hit.scatter_(1, dest, True)  # token t goes to rank d once if any of its slots lives there
        send_counts = hit.sum(0)  # [N]
        d_of, t_of = hit.t().nonzero(as_tuple=True)  # by destination, tokens ascending
        slot_ids = torch.where(dest[t_of] == d_of[:, None], idx[t_of], torch.full_like(idx[t_of], -1))
        payload = torch.cat([x.index_select(0, t_of), _pack_ids(slot_ids, x.dtype)], 1)
        recv_counts = torch.empty_like(send_counts)
        self._a2a(recv_counts, send_counts)  # the count exchange
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        recv = payload.new_empty(sum(rc), payload.shape[1])
        self._a2a(recv, payload, rc, sc)
        t1 = time.perf_counter()
        # this rank's experts over the (row, slot) pairs it received, row-major
        rids = _unpack_ids(recv[:, H:])  # [R, k]
        rows, slots = (rids >= 0).nonzero(as_tuple=True)
        y = self._experts(block, recv[:, :H].index_select(0, rows), rids[rows, slots], meta)
        t2 = time.perf_counter()
        src = torch.repeat_interleave(torch.arange(N, device=x.device), recv_counts)
        back_splits = torch.bincount(src[rows], minlength=N).tolist()
        flat_dest = dest.reshape(-1)
        order = torch.argsort(flat_dest, stable=True)  # (dest, token, slot): the receivers' pair order
        pair_counts = torch.bincount(flat_dest, minlength=N).tolist()
        got = y.new_empty(T * k, H)
        self._a2a(got, y, pair_counts, back_splits)
        per_slot = torch.empty_like(got)
        per_slot.index_copy_(0, order, got)
        t3 = time.perf_counter()
        es = x.element_size()
        st.moe_layers += 1
        st.tokens += T
        st.count_bytes += (N - 1) * send_counts.element_size()
        st.remote_token_ranks += int(hit.sum()) - sc[r]
        st.remote_slots += int((dest != r).sum())
        st.dispatch_bytes += (sum(sc) - sc[r]) * payload.shape[1] * es
        st.combine_bytes += (sum(back_splits) - back_splits[r]) * H * es
        st.dispatch_s += t1 - t0
        st.combine_s += t3 - t2
        return per_slot.view(T, k, H)


class LowLatencyDispatcher(_Dispatcher):
    mode = "low_latency"

    def __call__(self, block, x: torch.Tensor, idx: torch.Tensor, meta) -> torch.Tensor:
        pl, st = self.placement, self.stats
        N, n_loc, E = pl.world_size, pl.per_rank, len(pl.slots)  # (E: physical slots, one buffer each)
        T, k = idx.shape
        H = x.shape[1]
        cap = self.capacity if self.capacity is not None else T
        if T > cap:
            raise ValueError(f"low_latency dispatch: {T} tokens exceed the buffer capacity {cap}")
        t0 = time.perf_counter()
        self._count(idx)
        flat = pl.choose(idx).reshape(-1)
        order = torch.argsort(flat, stable=True)
        e_sorted = flat[order]
        counts = torch.bincount(flat, minlength=E)
        pos = torch.arange(T * k, device=x.device) - (torch.cumsum(counts, 0) - counts)[e_sorted]
        buf = x.new_zeros(E, cap + 1, H)  # row 0 of each slot's buffer: its count
        hw = max(1, 4 // x.element_size())
        buf[:, 0, :hw] = _pack_ids(counts[:, None], x.dtype)
        buf[e_sorted, 1 + pos] = x.index_select(0, order // k)
        recv = torch.empty_like(buf)
        self._a2a(recv, buf)  # equal splits: rank d gets experts [d*n_loc, (d+1)*n_loc) of every sender
        t1 = time.perf_counter()
        recv = recv.view(N, n_loc, cap + 1, H)
        rcount = _unpack_ids(recv[:, :, 0, :hw])[..., 0]  # [N (source), n_loc]
        valid = torch.arange(cap, device=x.device)[None, None, :] < rcount[..., None]
        s_i, e_i, p_i = valid.nonzero(as_tuple=True)
        mine = torch.tensor(pl.expert_ids, dtype=torch.long, device=x.device)  # this rank's slots' experts
        y = self._experts(block, recv[s_i, e_i, 1 + p_i], mine[e_i], meta)
        t2 = time.perf_counter()
        back = x.new_zeros(N, n_loc, cap, H)
        back[s_i, e_i, p_i] = y
        got = torch.empty_like(back)
        self._a2a(got, back)
        per_slot = torch.empty(T * k, H, dtype=x.dtype, device=x.device)
        per_slot[order] = got.view(E, cap, H)[e_sorted, pos]
        t3 = time.perf_counter()
        es = x.element_size()
        st.moe_layers += 1
        st.tokens += T
        st.dispatch_bytes += (N - 1) * n_loc * (cap + 1) * H * es
        st.combine_bytes += (N - 1) * n_loc * cap * H * es
        st.dispatch_s += t1 - t0
        st.combine_s += t3 - t2
        return per_slot.view(T, k, H)


DISPATCH_MODES = {"normal": NormalDispatcher, "low_latency": LowLatencyDispatcher}


def make_dispatcher(mode: str, shard: ExpertPlacement | ExpertShard, stats: CommStats | None = None,
                    group=None) -> _Dispatcher:
    if mode not in DISPATCH_MODES:
        from deepinfer.errors import ExpertParallelConfigError

        raise ExpertParallelConfigError(f"expert-parallel dispatch mode must be one of {sorted(DISPATCH_MODES)}, got {mode!r}")
    return DISPATCH_MODES[mode](shard, stats, group)
