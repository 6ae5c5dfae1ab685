"""GGUF conversion: metadata -> config, dequantised + renamed + unpermuted weights, and the cache."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from deepinfer.engine.loader import cache as cache_mod
from deepinfer.engine.loader import load_model, model_loader
from deepinfer.engine.loader.gguf_model import permute_rows, unpermute_rows
from deepinfer.engine.loader.weight_spec import expected_shapes


@pytest.fixture(scope="module")
def tf_gguf(gguf_path):
    """transformers' own GGUF reader: (metadata, header, lazy tensors) — an independent reference."""
    pytest.importorskip("transformers")
    from transformers.integrations.gguf.reader import GgufHeader, load_gguf_state_dict, read_gguf_metadata

    meta, _ = read_gguf_metadata(str(gguf_path))
    header = GgufHeader.from_file(str(gguf_path))
    return meta, header, load_gguf_state_dict(header)


def test_default_config_matches_gguf_metadata(default_model, tf_gguf):
    meta, header, _ = tf_gguf
    c = default_model.config
    assert c.architecture == "LlamaForCausalLM"
    assert c.hidden_size == meta["llama.embedding_length"]
    assert c.intermediate_size == meta["llama.feed_forward_length"]
    assert c.num_hidden_layers == meta["llama.block_count"]
    assert c.num_attention_heads == meta["llama.attention.head_count"]
    assert c.num_key_value_heads == meta["llama.attention.head_count_kv"]
    assert c.head_dim == meta["llama.rope.dimension_count"]
    assert c.rope_theta == pytest.approx(meta["llama.rope.freq_base"])
    assert c.rms_norm_eps == pytest.approx(meta["llama.attention.layer_norm_rms_epsilon"], rel=1e-6)
    assert c.max_position_embeddings == meta["llama.context_length"]
    assert c.vocab_size == meta["llama.vocab_size"]
    assert c.tie_word_embeddings == all(t.name != "output.weight" for t in header.tensors)
    assert c.bos_token_id == meta["tokenizer.ggml.bos_token_id"]
    assert c.eos_token_ids[0] == meta["tokenizer.ggml.eos_token_id"]
    assert c.eos_token_ids == default_model.tokenizer.eos_token_ids
    assert "lm_head.weight" not in default_model.weights


def test_weights_are_fp32_with_expected_names(default_model):
    shapes = expected_shapes(default_model.config)
    assert set(default_model.weights) == set(shapes)
    for name, w in default_model.weights.items():
        assert w.dtype == torch.float32 and tuple(w.shape) == shapes[name], name
        assert w.is_contiguous()


TENSORS = [  # (GGUF name, HF name): covers Q8_0, Q4_1 and F32 tensors, first and last layers
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
    ("blk.29.ffn_gate.weight", "model.layers.29.mlp.gate_proj.weight"),
    ("blk.7.attn_v.weight", "model.layers.7.self_attn.v_proj.weight"),
    ("blk.3.attn_output.weight", "model.layers.3.self_attn.o_proj.weight"),
    ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
    ("blk.11.ffn_norm.weight", "model.layers.11.post_attention_layernorm.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("blk.17.attn_k.weight", "model.layers.17.self_attn.k_proj.weight"),
]


def _tf_dequant(tf_gguf, gguf_name):
    from transformers.integrations.gguf.dequant import GGML_BLOCK, dequantize

    _, header, sd = tf_gguf
    info = next(i for i in header.tensors if i.name == gguf_name)
    raw = sd[gguf_name][None]
    if info.ggml_type in GGML_BLOCK:
        raw = dequantize(raw.reshape(-1), info.ggml_type)
    return raw.float().reshape(info.shape)


@pytest.mark.parametrize("gguf_name, hf_name", TENSORS)
def test_dequantised_weights_match_transformers(default_model, tf_gguf, gguf_name, hf_name):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    ref = _tf_dequant(tf_gguf, gguf_name)
    c = default_model.config
    if ".attn_q." in gguf_name or ".attn_k." in gguf_name:  # transformers' own llama.cpp un-permutation
        proc = LlamaTensorProcessor({"num_attention_heads": c.num_attention_heads,
                                     "num_key_value_heads": c.num_key_value_heads})
        ref = torch.from_numpy(np.ascontiguousarray(proc.process(ref.numpy(), gguf_name).weights))
    torch.testing.assert_close(default_model.weights[hf_name], ref, rtol=1e-6, atol=1e-7)


def test_unpermute_inverts_permute():
    w = torch.randn(6 * 8, 5)
    for heads in (1, 2, 6):
        p = permute_rows(w, heads)
        assert not torch.equal(p, w)
        assert torch.equal(unpermute_rows(p, heads), w)


def test_real_model_prefers_unpermuted_qk(default_model):
    """Functional check: the model predicts English far better with the un-permuted q/k than without."""
    transformers = pytest.importorskip("transformers")
    c, tok = default_model.config, default_model.tokenizer
    hc = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, tie_word_embeddings=True, max_position_embeddings=c.max_position_embeddings)
    with torch.device("meta"):  # no random init: every weight is assigned below
        model = transformers.LlamaForCausalLM(hc)
    model.model.rotary_emb = type(model.model.rotary_emb)(hc)
    model.eval()
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog. Once upon a time, "
                                   "there was a little girl who lived in a village near the forest.")])

    def nll(weights):
        sd = dict(weights, **{"lm_head.weight": weights["model.embed_tokens.weight"]})
        model.load_state_dict(sd, strict=True, assign=True)
        with torch.no_grad():
            return model(ids, labels=ids).loss.item()

    good = nll(default_model.weights)
    bad = dict(default_model.weights)
    for k in bad:
        if k.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if "q_proj" in k else c.num_key_value_heads
            bad[k] = permute_rows(bad[k], heads)  # what a loader that forgot to un-permute would give
    assert good < 3.5
    assert nll(bad) > good + 0.5


# ------------------------------------------------------------------------------ tiny GGUFs: exact round trip
@pytest.mark.parametrize("arch, tie", [("llama", True), ("llama", False), ("qwen2", True), ("qwen3", False)])
def test_tiny_gguf_round_trips_to_hf_weights(tiny_gguf, tmp_path, arch, tie):
    path, sd = tiny_gguf(arch, tie=tie)
    m = load_model(path, cache_dir=tmp_path)
    expected = {k: v for k, v in sd.items() if not (tie and k == "lm_head.weight")}
    assert set(m.weights) == set(expected)
    for k, v in expected.items():
        assert torch.equal(m.weights[k], v.float()), k  # F32 file: exact, incl. q/k un-permutation
    c = m.config
    assert c.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                              "qwen3": "Qwen3ForCausalLM"}[arch]
    assert c.tie_word_embeddings == tie
    assert c.attention_bias == (arch == "qwen2") and c.qk_norm == (arch == "qwen3")
    assert c.rope_theta == 12345.0 and c.rms_norm_eps == 1e-5 and c.max_position_embeddings == 256


def test_tiny_gguf_tokenizer_matches_source(tiny_gguf, tiny_tok, tmp_path):
    m = load_model(tiny_gguf("llama", tie=True)[0], cache_dir=tmp_path)
    text = "<|im_start|>the theme: then 123 ü 😀<|im_end|>"
    assert m.tokenizer.encode(text) == tiny_tok.encode(text)
    assert m.tokenizer.special_token_ids == tiny_tok.special_token_ids
    assert m.tokenizer.chat_template == tiny_tok.chat_template
    assert m.config.eos_token_ids[0] == tiny_tok.token_to_id("<|im_end|>")


# ------------------------------------------------------------------------------ cache
def test_cold_conversion_leaves_one_complete_cache_entry(default_model, session_cache, gguf_path):
    entry = cache_mod.cache_entry(gguf_path, session_cache)
    assert sorted(p.name for p in entry.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert [p.name for p in session_cache.iterdir()] == [entry.name]  # no temporary dir left behind
    assert entry.name.startswith(f"{gguf_path.stem}-{gguf_path.stat().st_size}-")


def test_cached_load_is_equal_and_skips_the_gguf(default_model, session_cache, monkeypatch):
    def no_gguf(*a, **k):
        raise AssertionError("the cached load must not open the GGUF")

    monkeypatch.setattr(model_loader, "open_gguf", no_gguf)
    t = time.perf_counter()
    m = load_model(None, cache_dir=session_cache)
    cached_s = time.perf_counter() - t
    print(f"\ndefault model: cold GGUF load {default_model.cold_seconds:.2f} s, cached load {cached_s:.2f} s")
    assert m.config == default_model.config
    assert m.weights.keys() == default_model.weights.keys()
    for k, v in m.weights.items():
        assert torch.equal(v, default_model.weights[k]), k
    text = "Hi 123 😀 <|im_start|>"
    assert m.tokenizer.encode(text) == default_model.tokenizer.encode(text)
    assert m.tokenizer.eos_token_ids == default_model.tokenizer.eos_token_ids
    assert m.tokenizer.chat_template == default_model.tokenizer.chat_template
    assert m.source == default_model.source
    assert cached_s < 5.0  # target is < 1.5 s on an idle machine; generous for loaded CI hosts


def test_damaged_cache_is_rebuilt(tiny_gguf, tmp_path):
    path, sd = tiny_gguf("llama", tie=True)
    first = load_model(path, cache_dir=tmp_path)
    entry = cache_mod.cache_entry(path, tmp_path)
    st = entry / "model.safetensors"
    st.write_bytes(st.read_bytes()[:1000])  # truncate: as if the disk filled up mid-copy
    again = load_model(path, cache_dir=tmp_path)
    assert torch.equal(again.weights["model.embed_tokens.weight"], first.weights["model.embed_tokens.weight"])
    assert (entry / "model.safetensors").stat().st_size > 1000


def test_cache_dir_env_and_use_cache_false(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf("llama", tie=True)
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "envcache"))
    load_model(path, use_cache=False)
    assert not (tmp_path / "envcache").exists()
    load_model(path)
    assert cache_mod.cache_entry(path, None).parent == tmp_path / "envcache"
    assert cache_mod.cache_entry(path, None).is_dir()


def test_changed_file_gets_a_new_cache_entry(tiny_gguf, tmp_path):
    import os
    import shutil

    path = shutil.copy(tiny_gguf("llama", tie=True)[0], tmp_path / "copy.gguf")
    a = cache_mod.cache_entry(path, tmp_path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert cache_mod.cache_entry(path, tmp_path) != a
