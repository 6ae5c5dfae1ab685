"""Shared fixtures: the default GGUF is converted once per session (into a session cache dir)."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from deepinfer.engine.loader import default_model_path, load_model


@pytest.fixture(scope="session")
def gguf_path():
    return default_model_path()


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory):
    d = tmp_path_factory.mktemp("model_cache")
    yield d
    shutil.rmtree(d, ignore_errors=True)  # ~0.5 GB of fp32 weights: do not leave it in pytest's tmp


@pytest.fixture(scope="session")
def default_model(session_cache):
    """The default model, converted from GGUF (cold: nothing cached yet). Carries `cold_seconds`."""
    t = time.perf_counter()
    m = load_model(None, cache_dir=session_cache)
    m.cold_seconds = time.perf_counter() - t
    return m


@pytest.fixture(scope="session")
def tok(default_model):
    """The tokenizer converted from the default GGUF's metadata."""
    return default_model.tokenizer


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(gguf_path):
    """transformers' own conversion of the same GGUF tokenizer (the reference)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


# ---------------------------------------------------------------------------------------------- tiny models
TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _hf_tiny_model(arch: str, vocab_size: int, tie: bool, seed: int = 0):
    """A random tiny transformers model of `arch` ('llama', 'qwen2', 'qwen3')."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    extra = {"head_dim": 8} if arch == "qwen3" else {}
    cfg = cls_cfg(vocab_size=vocab_size, tie_word_embeddings=tie, rope_theta=12345.0, rms_norm_eps=1e-5,
                  max_position_embeddings=256, bos_token_id=1, eos_token_id=2, **TINY, **extra)
    model = cls_model(cfg).eval()
    with torch.no_grad():  # norms init to ones; randomise them so name mix-ups show
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return model


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order (the byte-level BPE spelling)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_MERGES = ["Ġ t", "h e", "Ġt he"]


@pytest.fixture(scope="session")
def tiny_tok(tmp_path_factory):
    """A 262-token byte-level BPE tokenizer (ChatML specials), saved and loaded via Tokenizer.from_dir."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    from deepinfer.engine.tokenizer import Tokenizer

    vocab = TINY_SPECIALS + _byte_alphabet() + ["Ġt", "he", "Ġthe"]
    hf = HFTokenizer(models.BPE({t: i for i, t in enumerate(vocab)}, [tuple(m.split(" ")) for m in TINY_MERGES]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TINY_SPECIALS])
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    t = Tokenizer(hf, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>",
                  unk_token="<|endoftext|>", chat_template=template)
    d = tmp_path_factory.mktemp("tiny_tok")
    t.save(d)
    return Tokenizer.from_dir(d)


@pytest.fixture(scope="session")
def hf_tiny_dir(tmp_path_factory, tiny_tok):
    """Factory: save a tiny random HF model (+ the default tokenizer) and return (dir, state_dict)."""
    made = {}

    def make(arch: str = "llama", tie: bool = False, shard: str | None = None):
        key = (arch, tie, shard)
        if key not in made:
            model = _hf_tiny_model(arch, tiny_tok.vocab_size, tie)
            d = tmp_path_factory.mktemp(f"hf_{arch}_{'tied' if tie else 'untied'}_{shard or 'single'}")
            model.save_pretrained(d, max_shard_size=shard) if shard else model.save_pretrained(d)
            tiny_tok.save(d)
            made[key] = (d, {k: v.detach().clone() for k, v in model.state_dict().items()})
        return made[key]

    return make


def llama_cpp_permute(w, n_heads: int):
    """llama.cpp convert_hf_to_gguf's q/k row permutation (written out here independently of the loader)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# GGUF standard tensor names (ggml docs/gguf.md) for the HF names of a decoder layer.
GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{GGUF_LAYER_NAMES[rest]}"


def write_tiny_gguf(path, arch: str, state_dict, tok, *, tie: bool, drop: tuple[str, ...] = (),
                    pre: str = "gpt2", tokenizer_model: str = "gpt2"):
    """Write `state_dict` (HF names) as an F32 GGUF the way llama.cpp's converter lays it out."""
    import gguf
    import numpy as np

    cfg = TINY
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(256)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    if arch == "qwen3":
        w.add_key_length(8)
        w.add_value_length(8)
    w.add_rope_freq_base(12345.0)
    w.add_layer_norm_rms_eps(1e-5)
    vocab = [tok.id_to_token(i) for i in range(tok.vocab_size)]
    merges = json.loads(tok.hf.to_str())["model"]["merges"]
    merges = [" ".join(m) if isinstance(m, list) else m for m in merges]
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(vocab)
    w.add_token_types([3 if i in tok.special_token_ids else 1 for i in range(len(vocab))])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(tok.chat_template)
    for name, t in state_dict.items():
        if name in drop or (tie and name == "lm_head.weight"):
            continue
        a = t.detach().float().numpy().copy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            a = llama_cpp_permute(a, cfg["num_attention_heads"])
        elif arch == "llama" and name.endswith("k_proj.weight"):
            a = llama_cpp_permute(a, cfg["num_key_value_heads"])
        w.add_tensor(_gguf_name(name), np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory, tiny_tok):
    """Factory: (gguf path, HF state dict) for a tiny random model of `arch` written as GGUF.

    Files without keyword options are shared across the session: treat them as read-only."""
    made = {}

    def make(arch: str = "llama", tie: bool = True, **kw):
        key = (arch, tie)
        if kw or key not in made:
            model = _hf_tiny_model(arch, tiny_tok.vocab_size, tie, seed=1)
            sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
            path = tmp_path_factory.mktemp(f"gguf_{arch}") / f"tiny-{arch}.gguf"
            out = (write_tiny_gguf(path, arch, sd, tiny_tok, tie=tie, **kw), sd)
            if kw:
                return out
            made[key] = out
        return made[key]

    return make
