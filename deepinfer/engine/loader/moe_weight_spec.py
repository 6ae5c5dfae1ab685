"""Tensor names and shapes of the mixture-of-experts MLPs and the latent-attention (MLA) blocks,
as `save_pretrained` writes them (weight_spec.py asks here for MoE / MLA configs)."""

from __future__ import annotations

from deepinfer.engine.model_config import ModelConfig


def mlp_shapes(config: ModelConfig, i: int, p: str) -> dict[str, tuple[int, ...]]:
    """The MLP tensors of layer i (prefix p = 'model.layers.{i}.'): experts + router on sparse layers."""
    h, m = config.hidden_size, config.moe
    if m is None or i not in m.sparse_layers:
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
