"""Block-FP8 checkpoints (weight + weight_scale_inv per 128 x 128 block) dequantised at load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from deepinfer.engine.loader.fp8_blocks import dequantize_block, dequantize_checkpoint
from deepinfer.errors import ModelLoadError


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference block quantisation: scale = amax / 448 per block, q = fp8(w / scale)."""
    br, bc = block
    R, C = -(-w.shape[0] // br), -(-w.shape[1] // bc)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(R, C)
    for i in range(R):
        for j in range(C):
            blk = w[i * br : (i + 1) * br, j * bc : (j + 1) * bc]
            scale[i, j] = blk.abs().max().clamp(min=1e-12) / 448.0
            q[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (blk / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_loop(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    br, bc = block
    out = torch.empty(q.shape)
    for r in range(q.shape[0]):
        for c in range(q.shape[1]):
            out[r, c] = q[r, c].float() * scale[r // br, c // bc]
    return out


def test_dequantize_matches_per_element_reference_with_partial_blocks():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g) * torch.linspace(0.1, 3, 200)  # blocks of different ranges
    q, s = quantize(w, (128, 128))
    assert s.shape == (3, 2)
    got = dequantize_block(q, s, (128, 128))
    assert torch.equal(got, dequantize_loop(q, s, (128, 128)))
    assert (got - w).abs().max() <= 0.07 * w.abs().max()  # fp8 e4m3: 3 mantissa bits


def test_bad_scale_shape_and_missing_scale_are_named():
    q, s = quantize(torch.randn(130, 64), (128, 128))
    with pytest.raises(ModelLoadError, match=r"w_scale_inv has shape \(2, 1\); .* needs \(1, 1\)"):
        dequantize_block(q, s, (256, 128), "w")
    with pytest.raises(ModelLoadError, match="is FP8 but has no x_scale_inv"):
        dequantize_checkpoint({"x": q}, (128, 128))
    with pytest.raises(ModelLoadError, match="no y"):
        dequantize_checkpoint({"y_scale_inv": s}, (128, 128))


def test_fp8_deepseek_checkpoint_runs_like_its_dequantised_weights(tmp_path):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    from deepinfer import Engine, SamplingParams
    from moe_factory import make_moe_model

    src = make_moe_model(tmp_path / "src", "deepseek_v3", seed=21)
    block = (16, 16)  # small blocks so the tiny weights span several
    w = load_file(str(src / "model.safetensors"))
    fp8, ref = {}, {}
    for name, t in w.items():
        quantised = t.dim() == 2 and "proj" in name  # as DeepSeek ships: projections yes; embeddings, norms, router no
        if quantised:
            q, s = quantize(t, block)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            ref[name] = dequantize_loop(q, s, block)
        else:
            fp8[name] = ref[name] = t
    dirs = {}
    for kind, tensors in (("fp8", fp8), ("ref", ref)):
        d = tmp_path / kind
        shutil.copytree(src, d)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        dirs[kind] = d
    cfg = json.loads((dirs["fp8"] / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block), "fmt": "e4m3"}
    (dirs["fp8"] / "config.json").write_text(json.dumps(cfg))
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = ["The quick brown fox", "Hello world"]
    a = Engine(str(dirs["fp8"]), kv_cache_memory=2 << 20).generate(prompts, sp)
    b = Engine(str(dirs["ref"]), kv_cache_memory=2 << 20).generate(prompts, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [[x.logprob for x in o.logprobs] for o in a] == [[x.logprob for x in o.logprobs] for o in b]
