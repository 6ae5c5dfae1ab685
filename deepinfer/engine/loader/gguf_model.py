"""Converting a GGUF checkpoint to a ModelConfig and fp32 HF-named weights.

llama.cpp's converter renames tensors (blk.N.attn_q ...) and, for the llama architecture only,
permutes the rows of q_proj/k_proj so its interleaved-pair RoPE equals HF's rotate-half RoPE. We
run HF-style RoPE, so that permutation is undone here. qwen2/qwen3 files are not permuted.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from deepinfer.engine.loader.gguf_meta import field
from deepinfer.engine.model_config import ModelConfig
from deepinfer.errors import ModelLoadError, UnsupportedArchitectureError

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """HF tensor name for a GGUF tensor name, or None when it has no HF counterpart we know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Invert llama.cpp's q/k row permutation: per head, rows (pair, 2) were interleaved from (2, half)."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def permute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's own q/k permutation (the inverse of `unpermute_rows`); used by tests and converters."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _f32(value: Any) -> float:
    # GGUF stores floats as float32; print-shortest recovers the decimal the converter was given (1e-05).
    return float(str(np.float32(value)))


def gguf_architecture(reader: Any) -> str:
    """The file's `general.architecture`, or UnsupportedArchitectureError when we cannot run it."""
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    return arch


def config_from_gguf(reader: Any, *, bos_token_id: int | None, eos_token_ids: list[int]) -> ModelConfig:
    """ModelConfig from GGUF metadata and tensor inventory."""
    arch = gguf_architecture(reader)
    names = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ModelLoadError("GGUF has per-dimension rope frequency factors (llama-3.1 style); load the HF checkpoint instead")
    emb = names.get("token_embd.weight")
    if emb is None:
        raise ModelLoadError("GGUF lacks tensor 'token_embd.weight'")
    hidden = int(field(reader, f"{arch}.embedding_length"))
    n_heads = int(field(reader, f"{arch}.attention.head_count"))
    kv = field(reader, f"{arch}.attention.head_count_kv", n_heads)
    scaling = None
    kind = field(reader, f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", None):
        scaling = {"rope_type": kind, "factor": _f32(field(reader, f"{arch}.rope.scaling.factor", 1.0))}
        orig = field(reader, f"{arch}.rope.scaling.original_context_length", None)
        if orig is not None:
            scaling["original_max_position_embeddings"] = int(orig)
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=int(emb.shape[-1]),  # GGUF shapes are (cols, rows): the row count is the vocabulary
        hidden_size=hidden,
        intermediate_size=int(field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(field(reader, f"{arch}.block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(kv),
        head_dim=int(field(reader, f"{arch}.attention.key_length", hidden // n_heads)),
        rms_norm_eps=_f32(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_f32(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(field(reader, f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm=arch == "qwen3",
        bos_token_id=bos_token_id,
        eos_token_ids=list(eos_token_ids),
    )


def weights_from_gguf(reader: Any, config: ModelConfig, keep: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Dequantise every tensor to fp32 under its HF name (q/k unpermuted for llama files); the HF
    names in `keep` (kept as stored by the caller) get a placeholder of their shape instead."""
    from gguf.quants import dequantize

    from deepinfer.engine.placeholder import placeholder

    unpermute = config.architecture == "LlamaForCausalLM"
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise ModelLoadError(f"GGUF tensor {t.name!r} has no counterpart in {config.architecture}")
        if name in keep:
            out[name] = placeholder(tuple(int(d) for d in reversed(t.shape)))  # GGUF shapes are (cols, rows)
            continue
        try:
            arr = dequantize(t.data, t.tensor_type)
        except (NotImplementedError, ValueError) as e:
            raise ModelLoadError(f"cannot dequantise GGUF tensor {t.name!r} ({t.tensor_type.name}): {e}") from e
        # Dequantised arrays are fresh; F32 tensors are read-only views of the file mapping: copy those only.
        w = torch.from_numpy(np.require(arr, dtype=np.float32, requirements=["C", "W"]))
        if unpermute and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            w = unpermute_rows(w, heads)
        out[name] = w
    return out
