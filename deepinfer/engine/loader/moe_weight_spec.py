"""Tensor names and shapes of the mixture-of-experts MLPs and the latent-attention (MLA) blocks,
as `save_pretrained` writes them (weight_spec.py asks here for MoE / MLA configs)."""

from __future__ import annotations

from deepinfer.engine.model_config import ModelConfig


def mlp_shapes(config: ModelConfig, i: int, p: str, sparse: bool | None = None) -> dict[str, tuple[int, ...]]:
    """The MLP tensors of layer i (prefix p = 'model.layers.{i}.'): experts + router on sparse layers
    (`sparse` overrides the config's choice: the MTP layer is always sparse)."""
    h, m = config.hidden_size, config.moe
    if sparse is None:
        sparse = m is not None and i in m.sparse_layers
    if not sparse:
        ff = config.intermediate_size
        return {p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h), p + "mlp.down_proj.weight": (h, ff)}
    e_ff = m.expert_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {p + "mlp.gate.weight": (m.num_experts, h)}
    if m.correction_bias:
        shapes[p + "mlp.gate.e_score_correction_bias"] = (m.num_experts,)
    for e in range(m.num_experts):
        q = f"{p}mlp.experts.{e}."
        shapes.update({q + "gate_proj.weight": (e_ff, h), q + "up_proj.weight": (e_ff, h), q + "down_proj.weight": (h, e_ff)})
    if m.shared_intermediate_size:
        s_ff = m.shared_intermediate_size
        q = p + ("mlp.shared_expert." if m.shared_expert_gate else "mlp.shared_experts.")
        shapes.update({q + "gate_proj.weight": (s_ff, h), q + "up_proj.weight": (s_ff, h), q + "down_proj.weight": (h, s_ff)})
    if m.shared_expert_gate:
        shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
    return shapes


def mla_shapes(config: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """The latent-attention tensors of one layer (prefix p = 'model.layers.{i}.')."""
    h, a, n = config.hidden_size, config.mla, config.num_attention_heads
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    q = p + "self_attn."
    shapes: dict[str, tuple[int, ...]] = {
        q + "kv_a_proj_with_mqa.weight": (a.kv_lora_rank + a.qk_rope_head_dim, h),
        q + "kv_a_layernorm.weight": (a.kv_lora_rank,),
        q + "kv_b_proj.weight": (n * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
        q + "o_proj.weight": (h, n * a.v_head_dim),
    }
    if a.q_lora_rank is None:
        shapes[q + "q_proj.weight"] = (n * qk, h)
    else:
        shapes.update({q + "q_a_proj.weight": (a.q_lora_rank, h), q + "q_a_layernorm.weight": (a.q_lora_rank,),
                       q + "q_b_proj.weight": (n * qk, a.q_lora_rank)})
    return shapes


def mtp_shapes(config: ModelConfig, weights) -> dict[str, tuple[int, ...]]:
    """The multi-token-prediction layers (model.layers.{num_hidden_layers + k}) the checkpoint carries:
    none when it has no tensor under that prefix (transformers' save_pretrained drops them); all of
    one layer's tensors once it has any (so a partial MTP layer is reported, not half loaded)."""
    a = config.mla
    if a is None or not a.num_nextn_predict_layers:
        return {}
    h, L = config.hidden_size, config.num_hidden_layers
    shapes: dict[str, tuple[int, ...]] = {}
    for k in range(a.num_nextn_predict_layers):
        p = f"model.layers.{L + k}."
        if not any(n.startswith(p) for n in weights):
            continue
        shapes.update({p + "enorm.weight": (h,), p + "hnorm.weight": (h,), p + "eh_proj.weight": (h, 2 * h),
                       p + "shared_head.norm.weight": (h,), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
        for optional in ("embed_tokens.weight", "shared_head.head.weight"):
            if p + optional in weights:
                shapes[p + optional] = (config.vocab_size, h)
        shapes.update(mla_shapes(config, p))
        shapes.update(mlp_shapes(config, L + k, p, sparse=True))
    return shapes
