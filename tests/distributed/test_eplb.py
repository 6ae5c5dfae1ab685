"""Redundant experts (EPLB-style): placements, dispatch to copies (2 gloo processes against the
single-process block, both modes, bitwise), and an engine that re-places its copies from measured
load with unchanged outputs."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer.distributed.dispatch import CommStats, make_dispatcher
from deepinfer.distributed.ep_model import ExpertParallelMoe
from deepinfer.distributed.sharding import ExpertPlacement, ExpertShard, token_split
from deepinfer.errors import ExpertParallelConfigError


def test_initial_placement_is_the_shard_plus_copies():
    p = ExpertPlacement.initial(8, 2, 0, redundant=2)
    assert p.per_rank == 5 and p.rank_experts(0)[:4] == [0, 1, 2, 3] and p.rank_experts(1)[:4] == [4, 5, 6, 7]
    for r in range(2):  # a copy lives on a rank that does not own the expert
        assert len(set(p.rank_experts(r))) == 5
    four = ExpertPlacement.initial(8, 4, 0, redundant=4)  # no load yet: four distinct experts copied
    assert len({e for r in range(4) for e in four.rank_experts(r)[2:]}) == 4
    assert ExpertPlacement.initial(8, 2, 1).rank_experts(1) == list(ExpertShard(8, 2, 1).expert_ids)


def test_rebalanced_copies_go_to_the_hottest_experts_on_the_coldest_ranks():
    p = ExpertPlacement.initial(8, 4, 0, redundant=4)
    load = [1, 1, 1, 1, 1, 1, 400, 300]  # rank 3 (experts 6, 7) carries almost everything
    q = p.rebalanced(load)
    copies = q.copies()
    # copies of 6, 7, 6 on ranks 0, 1, 2; rank 3 owns both and can only take a cold one
    assert len(copies[6]) == 3 and len(copies[7]) == 2 and sum(len(copies[e]) for e in range(6)) == 7

    def busiest(pl):  # a rank's load: each copy's share of its expert's tokens
        c = pl.copies()
        share = pl.shares or [1.0 / len(c[e]) for e in pl.slots]
        return max(sum(load[e] * share[p] for p, e in enumerate(pl.slots) if p // pl.per_rank == r) for r in range(4))

    assert busiest(p) >= 700 and busiest(q) < 0.37 * 700  # (even splits would leave 0.41)
    assert abs(sum(q.shares[s] for s in copies[6]) - 1) < 1e-9
    assert all(len(set(q.rank_experts(r))) == q.per_rank for r in range(4))
    assert q.rebalanced(load) == q  # the same answer from the same load, on every rank
    # the routed pairs of expert 6 go to its copies in proportion to their shares, deterministically
    idx = torch.full((400, 1), 6)
    phys = q.choose(idx)[:, 0].tolist()
    assert phys == q.choose(idx)[:, 0].tolist()
    for s in copies[6]:
        assert abs(phys.count(s) / 400 - q.shares[s]) < 0.01
    even = ExpertPlacement.initial(8, 4, 0, redundant=4)  # no load yet: equal shares
    two = even.copies()[even.rank_experts(0)[2]]
    picks = even.choose(torch.full((100, 1), even.slots[two[0]]))[:, 0].tolist()
    assert sorted(picks.count(s) for s in two) == [50, 50]


def test_placement_errors_name_the_problem():
    with pytest.raises(ExpertParallelConfigError, match="multiple of expert_parallel_size=2"):
        ExpertPlacement.initial(8, 2, 0, redundant=3)
    with pytest.raises(ExpertParallelConfigError, match="at most 4 copies"):
        ExpertPlacement.initial(8, 2, 0, redundant=10)
    with pytest.raises(ExpertParallelConfigError, match="does not divide"):
        ExpertPlacement.initial(8, 3, 0, redundant=3)


def _worker(rank: int, world: int, rdv: str) -> None:
    import test_ep_dispatch as td  # the single-process block and contexts of the dispatch test

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    try:
        hot = ExpertShard(8, world, world - 1).expert_ids  # a router biased onto the last rank's experts
        initial = ExpertPlacement.initial(8, world, rank, redundant=2)
        moved = initial.rebalanced([0, 0, 0, 0, 50, 40, 30, 20])
        assert set(moved.rank_experts(0)) & set(hot)  # rank 0 now holds a copy of a hot expert
        for kind, T in (("sigmoid", 9), ("sigmoid", 4)):  # (softmax routers have no choice bias to skew)
            torch.manual_seed(200 + T)
            x = torch.randn(T, td.H)
            ctx = td._ctx(True)
            with torch.inference_mode():
                ref = td._block(kind, hot)(x, ctx)
                for placement in (ExpertPlacement.initial(8, world, rank), initial, moved):
                    for mode in ("normal", "low_latency"):
                        stats = CommStats()
                        b = td._block(kind, hot)
                        b.hold_experts(placement.expert_ids)
                        b.dispatcher = make_dispatcher(mode, placement, stats)
                        sizes = token_split(T, world)  # each rank brings its own rows
                        lo = sum(sizes[:rank])
                        layer = ExpertParallelMoe(b, placement, stats)
                        layer.capacity = max(sizes)
                        out = layer(x[lo : lo + sizes[rank]], ctx)
                        assert torch.equal(out, ref[lo : lo + sizes[rank]]), (kind, T, mode, placement.slots)
                        if mode == "normal" and rank == 0 and placement is not initial:
                            # rank 0 computes for rank 1 only once it holds a hot copy (moved: all of expert 4's pairs)
                            assert (stats.combine_bytes > 0) == (placement is moved)
    finally:
        dist.destroy_process_group()


def test_dispatch_to_copies_matches_single_process_block(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "rdv")), nprocs=2, join=True)


KW = dict(kv_cache_memory=8 << 20, block_size=4, max_num_batched_tokens=24, batch_invariant=True)


@pytest.fixture(scope="module")
def biased_model(tmp_path_factory):
    """The tiny DeepSeek-V3 with a router biased onto experts 4..7 (rank 1's at EP = 2)."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    from moe_factory import make_moe_model

    d = make_moe_model(tmp_path_factory.mktemp("eplb") / "deepseek_v3_biased", "deepseek_v3", seed=3)
    w = load_file(str(d / "model.safetensors"))
    for n in w:
        if n.endswith("e_score_correction_bias"):
            w[n][4:] += 10.0
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def _outputs(eng):
    from deepinfer import SamplingParams

    prompts = ["The quick brown fox", "Hello world! How are you today my", "one two three four five six seven"]
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1))
    return [(o.token_ids, [t.logprob for t in o.logprobs]) for o in outs]


def test_engine_moves_copies_to_measured_hot_experts_outputs_unchanged(biased_model):
    from deepinfer import Engine

    ref = _outputs(Engine(str(biased_model), **KW))
    with Engine(str(biased_model), expert_parallel_size=2, expert_parallel_redundant=2, **KW) as eng:
        assert _outputs(eng) == ref
        report = eng.rebalance_experts()
        assert report
        for layer in report.values():
            load, slots = layer["load"], layer["slots"]
            assert sum(load[:4]) == 0 and sum(load[4:]) > 0  # what the biased router did
            hottest = max(range(8), key=lambda e: (load[e], -e))
            assert slots[4] == hottest  # rank 0's copy slot (slots 0-4 are rank 0's) took it
        assert _outputs(eng) == ref  # the same bits from the moved copies
    with Engine(str(biased_model), expert_parallel_size=2, expert_parallel_redundant=2,
                expert_parallel_rebalance_interval=3, **KW) as eng:  # re-placed during the run, every 3 steps
        assert _outputs(eng) == ref
        assert all(s["rebalances"] >= 2 for s in eng.runner.comm_stats())
