"""An expert-parallel rank reads only its share of the checkpoint (its routed experts plus everything
else), and the engine process of spawned workers reads none of the weights; the checks on what the
checkpoint holds still run on every rank (a tensor missing from the file fails them all)."""

from __future__ import annotations

import re

import pytest
from safetensors.torch import load_file, save_file

from deepinfer.distributed.sharding import expert_weight_filter, no_weights
from deepinfer.engine.loader import load_model
from deepinfer.errors import ExpertParallelConfigError, ModelLoadError
from moe_factory import make_moe_model

pytest.importorskip("transformers")
EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_moe_model(tmp_path_factory.mktemp("epw") / "qwen3_moe", "qwen3_moe", seed=2)


def test_rank_reads_its_experts_only(model):
    full = load_model(str(model), use_cache=False).weights
    for rank in range(2):
        part = load_model(str(model), use_cache=False, tensor_filter=expert_weight_filter(rank, 2)).weights
        experts = {int(m.group(1)) for n in part if (m := EXPERT.match(n))}
        assert experts == set(range(4 * rank, 4 * rank + 4))  # 8 experts over 2 ranks
        others = {n for n in full if not EXPERT.match(n)}
        assert others <= set(part)  # attention, norms, router, shared parts: all read
        assert all(part[n].equal(full[n]) for n in part)
        assert 0 < sum(t.numel() for t in part.values()) < sum(t.numel() for t in full.values())


def test_engine_process_reads_no_weights(model):
    loaded = load_model(str(model), use_cache=False, tensor_filter=no_weights)
    assert loaded.weights == {} and loaded.config.moe is not None and loaded.tokenizer.vocab_size > 0


def test_checks_still_run_on_a_filtered_load(model, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    for f in model.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    w = load_file(str(d / "model.safetensors"))
    del w["model.layers.0.mlp.experts.5.up_proj.weight"]  # rank 1's expert, gone from the file
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    for rank in (0, 1):  # rank 0 never reads it, but a checkpoint missing it fails on every rank
        with pytest.raises(ModelLoadError, match="experts.5.up_proj"):
            load_model(str(d), use_cache=False, tensor_filter=expert_weight_filter(rank, 2))
    with pytest.raises(ExpertParallelConfigError, match="does not divide"):
        load_model(str(model), use_cache=False, tensor_filter=expert_weight_filter(0, 3))
