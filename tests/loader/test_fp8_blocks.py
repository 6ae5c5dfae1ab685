"""Block-FP8 checkpoints (weight + weight_scale_inv per 128 x 128 block): dequantised at load, or kept as
stored (Fp8Weight, keep_checkpoint)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.loader.fp8_blocks import Fp8Weight, dequantize_block, dequantize_checkpoint, keep_checkpoint
from deepinfer.errors import ModelLoadError
from fp8_factory import dequantize_loop, make_fp8_pair, quantize


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
    from deepinfer import Engine, SamplingParams
    from moe_factory import make_moe_model

    fp8_dir, ref_dir, _ = make_fp8_pair(make_moe_model(tmp_path / "src", "deepseek_v3", seed=21), tmp_path)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = ["The quick brown fox", "Hello world"]
    a = Engine(str(fp8_dir), kv_cache_memory=2 << 20).generate(prompts, sp)  # CPU "auto": dequantised at load
    b = Engine(str(ref_dir), kv_cache_memory=2 << 20).generate(prompts, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [[x.logprob for x in o.logprobs] for o in a] == [[x.logprob for x in o.logprobs] for o in b]


def _fp8(rows, cols, block, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.linspace(0.1, 3, cols)
    return quantize(w, block)


def test_kept_weight_holds_the_load_time_values_with_rows_expanded():
    block = (128, 64)
    q, s = _fp8(300, 200, block, 1)
    f = Fp8Weight.from_blocks(q, s, block, "w")
    assert f.shape == (300, 200) and f.scale.shape == (300, 4) and f.block_k == 64 and f.dtype == torch.float8_e4m3fn
    assert torch.equal(f.dequantize(), dequantize_block(q, s, block))  # the fp32 values, bit for bit
    assert torch.equal(f.dequantize(torch.bfloat16), dequantize_block(q, s, block).to(torch.bfloat16))
    assert f.nbytes == 300 * 200 + 300 * 4 * 4
    whole = Fp8Weight.from_blocks(*_fp8(300, 200, (128, 40), 2), (128, 40))  # K whole blocks: the broadcast path
    q2, s2 = _fp8(300, 200, (128, 40), 2)
    assert torch.equal(whole.dequantize(), dequantize_block(q2, s2, (128, 40)))


def test_kept_weights_concatenate_by_rows_across_partial_blocks():
    block = (16, 16)
    parts = [_fp8(rows, 40, block, seed) for seed, rows in enumerate((20, 7, 33))]  # row blocks cut mid-way
    fused = Fp8Weight.cat_rows([Fp8Weight.from_blocks(q, s, block) for q, s in parts], "qkv")
    want = torch.cat([dequantize_block(q, s, block) for q, s in parts], 0)
    assert torch.equal(fused.dequantize(), want)
    other = Fp8Weight.from_blocks(*_fp8(8, 40, (16, 8), 9), (16, 8))
    with pytest.raises(ModelLoadError, match="qkv: its FP8 parts differ"):
        Fp8Weight.cat_rows([Fp8Weight.from_blocks(*parts[0], block), other], "qkv")


def test_keep_checkpoint_keeps_what_the_predicate_selects_and_dequantises_the_rest():
    block = (16, 16)
    (qa, sa), (qb, sb) = _fp8(40, 24, block, 3), _fp8(24, 40, block, 4)
    e5 = torch.randn(16, 16).to(torch.float8_e5m2)
    tensors = {"a.weight": qa, "a.weight_scale_inv": sa, "b.weight": qb, "b.weight_scale_inv": sb,
               "e5.weight": e5, "e5.weight_scale_inv": torch.ones(1, 1), "norm.weight": torch.ones(24)}
    out = keep_checkpoint(tensors, block, lambda n: n != "b.weight")
    assert sorted(out) == ["a.weight", "b.weight", "e5.weight", "norm.weight"]  # scales consumed
    assert isinstance(out["a.weight"], Fp8Weight) and torch.equal(out["a.weight"].codes.view(torch.uint8), qa.view(torch.uint8))
    assert torch.equal(out["b.weight"], dequantize_block(qb, sb, block))  # not selected: fp32 as before
    assert out["e5.weight"].dtype == torch.float32  # only e4m3 stays FP8 (the kernels decode e4m3)
    assert torch.equal(out["norm.weight"], tensors["norm.weight"])


def test_kept_weight_errors_name_the_tensor():
    q, s = _fp8(40, 24, (16, 16), 5)
    with pytest.raises(ModelLoadError, match=r"a.weight_scale_inv has shape \(3, 2\); .* needs \(2, 2\)"):
        Fp8Weight.from_blocks(q, s, (32, 16), "a.weight")
    with pytest.raises(ModelLoadError, match="only float8_e4m3fn"):
        Fp8Weight.from_blocks(q.to(torch.float8_e5m2), s, (16, 16), "a.weight")
