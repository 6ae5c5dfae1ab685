"""Expert-parallel dispatch / combine alone: 2 gloo processes, each with its share of the rows (as
data-parallel attention gives them), against the single-process MoeBlock."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer.distributed.dispatch import CommStats
from deepinfer.distributed.ep_model import ExpertParallelMoe
from deepinfer.distributed.sharding import ExpertShard, token_split
from deepinfer.engine import batch_invariant as bi
from deepinfer.engine.attention import ForwardContext
from deepinfer.engine.models.moe import MoeBlock
from deepinfer.engine.moe_config import MoeConfig
from deepinfer.errors import ExpertParallelConfigError

H = 32


def _moe(kind: str) -> MoeConfig:
    if kind == "softmax":
        return MoeConfig(num_experts=8, top_k=2, expert_intermediate_size=16, scoring="softmax",
                         norm_topk_prob=True, sparse_layers=(0,))
    return MoeConfig(num_experts=8, top_k=3, expert_intermediate_size=16, scoring="sigmoid", norm_topk_prob=True,
                     sparse_layers=(0,), routed_scaling_factor=2.5, n_group=4, topk_group=2, correction_bias=True,
                     shared_intermediate_size=24)


def _block(kind: str, bias_to: range | None = None) -> MoeBlock:
    torch.manual_seed(7)
    b = MoeBlock(H, _moe(kind))
    with torch.no_grad():
        for p in b.parameters():
            p.normal_(0, 0.3)
        if bias_to is not None:  # a router that chooses only these experts (the choice bias)
            b.score_bias[list(bias_to)] += 10.0
    return b


def _tiled(x, w, b=None):
    return bi.bi_matmul(x, w)


def _ctx(invariant: bool) -> ForwardContext:
    return ForwardContext(slot_mapping=torch.empty(0, dtype=torch.long), linear=_tiled if invariant else torch.nn.functional.linear)


CASES = [  # (router kind, tokens, invariant GEMM, biased onto rank 1's experts)
    ("softmax", 7, True, False),
    ("sigmoid", 9, True, False),
    ("softmax", 7, False, False),
    ("sigmoid", 5, True, True),  # uneven load: rank 0's experts get nothing
    ("softmax", 1, True, False),  # one token: rank 1 dispatches nothing
]


def _worker(rank: int, world: int, rdv: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    try:
        for kind, T, invariant, biased in CASES:
            shard = ExpertShard(8, world, rank)
            bias_to = ExpertShard(8, world, world - 1).expert_ids if biased else None
            torch.manual_seed(100 + T)
            x = torch.randn(T, H)
            ctx = _ctx(invariant)
            with torch.inference_mode():
                ref = _block(kind, bias_to)(x, ctx)  # the single-process block over all experts
                w_ref, idx_ref = _block(kind, bias_to).route(x, ctx)
                outs = {}
                for mode in ("normal", "low_latency"):
                    from deepinfer.distributed.dispatch import make_dispatcher

                    stats = CommStats()
                    b = _block(kind, bias_to)
                    b.hold_experts(shard.expert_ids)
                    assert len(b.expert_gate_up) == 8 // world
                    b.dispatcher = make_dispatcher(mode, shard, stats)
                    sizes = token_split(T, world)  # data-parallel attention: each rank brings its own rows
                    lo = sum(sizes[:rank])
                    layer = ExpertParallelMoe(b, shard, stats)
                    layer.capacity = max(sizes)
                    out = layer(x[lo : lo + sizes[rank]], ctx)
                    outs[mode] = out
                    if mode == "normal":  # bytes sent off this rank, from the routing of its own rows
                        sizes = token_split(T, world)
                        lo = sum(sizes[:rank])
                        own = (idx_ref[lo : lo + sizes[rank]] // shard.per_rank)
                        ranks_per_token = sum(int((own == d).any(1).sum()) for d in range(world) if d != rank)
                        k = own.shape[1]
                        assert stats.dispatch_bytes == ranks_per_token * (H + k) * 4
                        others = torch.cat([idx_ref[:lo], idx_ref[lo + sizes[rank]:]]) // shard.per_rank
                        assert stats.combine_bytes == int((others == rank).sum()) * H * 4  # pair outputs sent back
                if biased:
                    assert (idx_ref // shard.per_rank == world - 1).all()
                sizes = token_split(T, world)
                lo = sum(sizes[:rank])
                mine = ref[lo : lo + sizes[rank]]
                for mode, out in outs.items():
                    if invariant:
                        assert torch.equal(out, mine), (kind, T, mode, (out - mine).abs().max())
                    else:
                        torch.testing.assert_close(out, mine, rtol=1e-5, atol=1e-5)
                if invariant:
                    assert torch.equal(outs["normal"], outs["low_latency"])
    finally:
        dist.destroy_process_group()


def test_dispatch_combine_matches_single_process_block(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "rdv")), nprocs=2, join=True)


def test_sharding_ranges_and_errors():
    assert [ExpertShard(8, 4, r).expert_ids for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert ExpertShard(8, 4, 3).owner(7) == 3 and ExpertShard(8, 4, 0).owner(1) == 0
    with pytest.raises(ExpertParallelConfigError, match="does not divide the model's 8 routed experts"):
        ExpertShard(8, 3, 0)
    with pytest.raises(ExpertParallelConfigError):
        ExpertShard(8, 0, 0)
    assert token_split(5, 2) == [3, 2] and token_split(1, 4) == [1, 0, 0, 0]


def test_init_reads_torchrun_env(monkeypatch):
    from deepinfer.distributed import init, shutdown

    for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    with pytest.raises(ExpertParallelConfigError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set"):
        init()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    with pytest.raises(ExpertParallelConfigError, match="timeout"):
        init(timeout_s=0)
    info = init(timeout_s=5, device="cpu")
    try:
        assert (info.rank, info.world_size, info.backend) == (0, 1, "gloo")
        assert dist.get_world_size() == 1
    finally:
        shutdown()
    assert not dist.is_initialized()


def test_routing_sigmoid_is_row_invariant():
    """DeepSeek's sigmoid scores: a row's bits do not depend on its place in the batch (plain
    torch.sigmoid's scalar tail broke this; EP ranks route parts of a batch)."""
    from deepinfer.engine.models.moe import _sigmoid_rows

    torch.manual_seed(0)
    for E in (8, 64, 256):
        x = torch.randn(600, E)
        full = _sigmoid_rows(x)
        torch.testing.assert_close(full, torch.sigmoid(x), rtol=0, atol=1e-6)
        for lo, n in ((0, 9), (9, 9), (17, 1), (250, 300), (599, 1), (3, 597)):
            assert torch.equal(_sigmoid_rows(x[lo : lo + n]), full[lo : lo + n]), (E, lo, n)
