"""Every bad input gets a typed error that names the problem (and the path)."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from deepinfer.engine.loader import load_model
from deepinfer.engine.tokenizer import Tokenizer
from deepinfer.errors import ModelLoadError, UnsupportedArchitectureError


@pytest.fixture
def llama_dir(hf_tiny_dir, tmp_path):
    """A private, writable copy of the tiny Llama directory."""
    src, _ = hf_tiny_dir("llama", False, None)
    return shutil.copytree(src, tmp_path / "model")


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist: .*nope"):
        load_model(tmp_path / "nope")


def test_neither_dir_nor_gguf(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="neither a model directory nor a .gguf"):
        load_model(f)


def test_missing_config(llama_dir):
    (llama_dir / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json at .*config.json"):
        load_model(llama_dir)


def test_unknown_architecture(llama_dir):
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="MambaForCausalLM"):
        load_model(llama_dir)


def test_bad_config_field(llama_dir):
    cfg = json.loads((llama_dir / "config.json").read_text())
    del cfg["hidden_size"]
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="hidden_size"):
        load_model(llama_dir)


def test_missing_safetensors(llama_dir):
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors or model.safetensors.index.json in"):
        load_model(llama_dir)


def test_truncated_safetensors(llama_dir):
    st = llama_dir / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="corrupt or unreadable safetensors file .*model.safetensors"):
        load_model(llama_dir)


def test_missing_shard(hf_tiny_dir, tmp_path):
    src, _ = hf_tiny_dir("llama", False, "20KB")
    d = shutil.copytree(src, tmp_path / "sharded")
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"missing weights file .*{shard.name}"):
        load_model(d)


def test_missing_tensor(llama_dir):
    st = llama_dir / "model.safetensors"
    tensors = load_file(str(st))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(st))
    with pytest.raises(ModelLoadError, match=r"lacks tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        load_model(llama_dir)


def test_unexpected_tensor(llama_dir):
    st = llama_dir / "model.safetensors"
    tensors = load_file(str(st))
    tensors["model.layers.0.mlp.extra.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, str(st))
    with pytest.raises(ModelLoadError, match="does not explain: .*mlp.extra.weight"):
        load_model(llama_dir)


def test_shape_mismatch(llama_dir):
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"gate_proj.weight has shape \[48, 32\], config implies \[56, 32\]"):
        load_model(llama_dir)


def test_tokenizer_larger_than_embedding(llama_dir):
    cfg = json.loads((llama_dir / "config.json").read_text())
    st = llama_dir / "model.safetensors"
    tensors = load_file(str(st))
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[k] = tensors[k][:100].clone()
    save_file(tensors, str(st))
    cfg["vocab_size"] = 100
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="tokenizer has 262 tokens but the embedding only 100 rows"):
        load_model(llama_dir)


def test_missing_tokenizer(llama_dir):
    (llama_dir / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer.json in"):
        load_model(llama_dir)


def test_corrupt_tokenizer_json(llama_dir, tmp_path):
    (llama_dir / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot parse .*tokenizer.json"):
        Tokenizer.from_dir(llama_dir)


def test_unreadable_gguf(tmp_path):
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"GGUF" + b"\x00" * 7)
    with pytest.raises(ModelLoadError, match="cannot read GGUF file .*broken.gguf"):
        load_model(f, cache_dir=tmp_path / "c")
    g = tmp_path / "not-gguf.gguf"
    g.write_text("hello world, not a gguf file at all")
    with pytest.raises(ModelLoadError, match="cannot read GGUF file .*not-gguf.gguf"):
        load_model(g, cache_dir=tmp_path / "c")
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_truncated_gguf(tiny_gguf, tmp_path):
    path, _ = tiny_gguf("llama", tie=True)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size - 5000])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        load_model(cut, cache_dir=tmp_path / "c")


def test_gguf_missing_tensor(tiny_gguf, tmp_path):
    path, _ = tiny_gguf("llama", tie=True, drop=("model.layers.1.self_attn.v_proj.weight",))
    with pytest.raises(ModelLoadError, match=r"lacks tensors \['model.layers.1.self_attn.v_proj.weight'\]"):
        load_model(path, cache_dir=tmp_path)
    assert not any(tmp_path.iterdir())  # nothing cached for a model that failed to load


def test_gguf_unknown_architecture(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitectureError, match="GGUF architecture 'mamba' is not supported"):
        load_model(tmp_path / "mamba.gguf", cache_dir=tmp_path / "c")


def test_gguf_unsupported_tokenizer(tiny_gguf, tmp_path):
    path, _ = tiny_gguf("llama", tie=True, pre="mystery-pre")
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'mystery-pre' is not supported"):
        load_model(path, cache_dir=tmp_path)
    path, _ = tiny_gguf("llama", tie=True, tokenizer_model="t5")
    with pytest.raises(ModelLoadError, match="tokenizer model 't5' is not supported"):
        load_model(path, cache_dir=tmp_path)
