"""The tensor names and shapes a ModelConfig implies, and the check every loaded checkpoint passes."""

from __future__ import annotations

import torch

from deepinfer.engine.loader import moe_weight_spec
from deepinfer.engine.model_config import ModelConfig
from deepinfer.errors import ModelLoadError


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for every weight the model files of DeepInfer read."""
    h, d = config.hidden_size, config.head_dim
    q, kv, ff = config.num_attention_heads * d, config.num_key_value_heads * d, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        if config.moe is not None or config.mla is not None:  # experts / latent attention: moe_weight_spec.py
            shapes.update(moe_weight_spec.mlp_shapes(config, i, p))
            if config.mla is not None:
                shapes.update(moe_weight_spec.mla_shapes(config, p))
                continue
        else:
            shapes.update({p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h),
                           p + "mlp.down_proj.weight": (h, ff)})
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
        })
        if config.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if config.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return shapes


def is_ignorable(name: str, config: ModelConfig) -> bool:
    """Tensors checkpoints carry that we do not need: cached rotary tables and a tied lm_head copy."""
    return name.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight")


def check_weights(weights: dict[str, torch.Tensor], config: ModelConfig, source: str,
                  skipped: set[str] | None = None) -> None:
    """Raise ModelLoadError naming missing, unexpected or wrongly shaped tensors of `source`;
    `skipped`: tensors in the checkpoint deliberately not read (an expert-parallel rank's others')."""
    shapes = expected_shapes(config)
    shapes.update(moe_weight_spec.mtp_shapes(config, weights))  # DeepSeek's MTP layers, when shipped
    for name in skipped or ():
        shapes.pop(name, None)
    missing = sorted(set(shapes) - set(weights))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ModelLoadError(f"{source} lacks tensors {missing[:5]}{more}")
    unexpected = sorted(set(weights) - set(shapes))
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise ModelLoadError(
            f"{source} has tensors the {config.architecture} config does not explain: {unexpected[:5]}{more}"
        )
    for name, shape in shapes.items():
        got = tuple(weights[name].shape)
        if got != shape:
            raise ModelLoadError(f"{source}: tensor {name} has shape {list(got)}, config implies {list(shape)}")
