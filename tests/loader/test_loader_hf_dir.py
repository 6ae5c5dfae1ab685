"""HF model directories saved by transformers: single and sharded safetensors, Llama/Qwen2/Qwen3."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.engine.loader import load_model
from deepinfer.engine.model_config import ModelConfig

ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@pytest.mark.parametrize(
    "arch, tie, shard",
    [("llama", False, None), ("llama", False, "20KB"), ("qwen2", True, None), ("qwen3", False, "50KB"),
     ("qwen3", True, None)],
)
def test_round_trip_equals_saved_state_dict(hf_tiny_dir, tiny_tok, arch, tie, shard):
    d, sd = hf_tiny_dir(arch, tie, shard)
    if shard:
        assert (d / "model.safetensors.index.json").is_file() and not (d / "model.safetensors").exists()
    m = load_model(d)
    expected = {k: v for k, v in sd.items() if not (tie and k == "lm_head.weight")}
    assert set(m.weights) == set(expected)
    for k, v in expected.items():
        assert m.weights[k].dtype == torch.float32
        assert torch.equal(m.weights[k], v), k
    saved = json.loads((d / "config.json").read_text())
    c = m.config
    assert c.architecture == ARCHS[arch] == saved["architectures"][0]
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (
        saved["hidden_size"], saved["num_hidden_layers"], saved["num_attention_heads"], saved["num_key_value_heads"])
    assert c.head_dim == saved.get("head_dim", saved["hidden_size"] // saved["num_attention_heads"])
    assert c.rope_theta == saved["rope_parameters"]["rope_theta"] == 12345.0  # transformers 5 layout
    assert c.rope_scaling is None
    assert c.tie_word_embeddings == tie
    assert c.attention_bias == (arch == "qwen2") and c.qk_norm == (arch == "qwen3")
    assert m.source == str(d)
    assert m.tokenizer.encode("the theme") == tiny_tok.encode("the theme")
    # generation_config.json's eos (2) joins the tokenizer's end-of-generation ids
    assert c.eos_token_ids == m.tokenizer.eos_token_ids
    assert set(c.eos_token_ids) >= {tiny_tok.token_to_id("<|im_end|>"), saved["eos_token_id"]}


def test_transformers_cache_format_reads_back_in_transformers(default_model, session_cache, gguf_path):
    """The cached conversion is a valid HF directory: transformers builds the same config from it."""
    transformers = pytest.importorskip("transformers")
    from deepinfer.engine.loader.cache import cache_entry

    entry = cache_entry(gguf_path, session_cache)
    hc = transformers.AutoConfig.from_pretrained(str(entry))
    c = default_model.config
    assert hc.model_type == "llama" and hc.num_hidden_layers == c.num_hidden_layers
    assert hc.num_key_value_heads == c.num_key_value_heads and hc.tie_word_embeddings is True


def test_legacy_rope_fields_and_scaling():
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    old = ModelConfig.from_hf_config(dict(base, rope_theta=500000.0,
                                          rope_scaling={"type": "linear", "factor": 2.0}))
    assert old.rope_theta == 500000.0 and old.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    new = ModelConfig.from_hf_config(dict(base, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))
    assert new.rope_theta == 500000.0
    assert new.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    plain = ModelConfig.from_hf_config(dict(base, rope_parameters={"rope_type": "default", "rope_theta": 7.0}))
    assert plain.rope_theta == 7.0 and plain.rope_scaling is None
    assert ModelConfig.from_hf_config(base).rope_theta == 10000.0


def test_bf16_checkpoint_loads_as_fp32(hf_tiny_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    src, sd = hf_tiny_dir("llama", False, None)
    d = shutil.copytree(src, tmp_path / "bf16")
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(d / "model.safetensors")).items()},
              str(d / "model.safetensors"))
    m = load_model(d)
    w = m.weights["model.layers.0.mlp.up_proj.weight"]
    assert w.dtype == torch.float32
    assert torch.equal(w, sd["model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16).float())
    # keep_16bit: the same tensors as stored (the runner keeps or converts them, engine/weights16.py)
    kept = load_model(d, keep_16bit=True).weights["model.layers.0.mlp.up_proj.weight"]
    assert kept.dtype == torch.bfloat16 and torch.equal(kept.float(), w)
