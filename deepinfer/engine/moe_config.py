"""Mixture-of-experts and multi-head-latent-attention hyper-parameters, read from an HF config.json.

`parse_moe` / `parse_mla` turn the architecture-specific fields of Qwen2-MoE, Qwen3-MoE and
DeepSeek-V3 into two small dataclasses the model files read; a missing or unsupported field is a
ModelLoadError that names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer.errors import ModelLoadError

MOE_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


class MoeConfigError(ModelLoadError):
    """A mixture-of-experts / latent-attention config field is missing, malformed or unsupported."""


@dataclass
class MoeConfig:
    num_experts: int
    top_k: int
    expert_intermediate_size: int  # moe_intermediate_size
    scoring: str  # "softmax" (Qwen) or "sigmoid" (DeepSeek-V3)
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]  # layer indices whose MLP is the MoE block; the others are dense
    routed_scaling_factor: float = 1.0
    n_group: int = 1  # group-limited routing: keep the topk_group best groups
    topk_group: int = 1
    group_score: str = "top2_sum"  # a group's score: the sum of its two best (V3) or its best ("max", V2)
    correction_bias: bool = False  # e_score_correction_bias added to the scores for choosing only
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(x @ g) scales the shared expert


@dataclass
class MlaConfig:
    q_lora_rank: int | None  # None: a plain q projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) ** 2
    num_nextn_predict_layers: int = 0


def _req(cfg: dict[str, Any], name: str, kind=int):
    if cfg.get(name) is None:
        raise MoeConfigError(f"config.json lacks {name!r}, which {cfg.get('architectures')} needs")
    try:
        v = kind(cfg[name])
    except (TypeError, ValueError) as e:
        raise MoeConfigError(f"config.json field {name!r} = {cfg[name]!r} is not a valid {kind.__name__}") from e
    if kind is int and v < 0:
        raise MoeConfigError(f"config.json field {name!r} = {v} must not be negative")
    return v


def _experts(cfg: dict[str, Any], name: str) -> int:
    """The routed-expert count: `name` in released configs, `num_local_experts` as transformers 5 writes it."""
    return _req(cfg, name if cfg.get(name) is not None or cfg.get("num_local_experts") is None else "num_local_experts")


def parse_moe(arch: str, cfg: dict[str, Any], num_layers: int) -> MoeConfig | None:
    """The MoE settings of `arch` (None for a dense architecture)."""
    if arch not in MOE_ARCHITECTURES:
        return None
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise MoeConfigError(f"config.json hidden_act {act!r} is not supported (only 'silu')")
    if arch == "DeepseekV3ForCausalLM":
        n = _experts(cfg, "n_routed_experts")
        method = cfg.get("topk_method") or "noaux_tc"
        if method != "noaux_tc":
            raise MoeConfigError(f"config.json topk_method {method!r} is not supported (DeepSeek-V3 routing is 'noaux_tc')")
        scoring_func = cfg.get("scoring_func") or "sigmoid"
        if scoring_func != "sigmoid":
            raise MoeConfigError(f"config.json scoring_func {scoring_func!r} is not supported (only 'sigmoid')")
        first_dense = _req(cfg, "first_k_dense_replace")
        m = MoeConfig(
            num_experts=n, top_k=_req(cfg, "num_experts_per_tok"),
            expert_intermediate_size=_req(cfg, "moe_intermediate_size"), scoring="sigmoid",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            sparse_layers=tuple(range(first_dense, num_layers)),
            routed_scaling_factor=_req(cfg, "routed_scaling_factor", float),
            n_group=_req(cfg, "n_group"), topk_group=_req(cfg, "topk_group"), correction_bias=True,
            shared_intermediate_size=_req(cfg, "moe_intermediate_size") * int(cfg.get("n_shared_experts") or 0),
        )
    elif arch == "DeepseekV2ForCausalLM":
        # DeepSeek-V2: softmax scores, greedy or group-limited (a group scores its best expert) top-k,
        # weights times routed_scaling_factor, never renormalised (transformers' V2 ignores norm_topk_prob)
        n = _experts(cfg, "n_routed_experts")
        method = cfg.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise MoeConfigError(f"config.json topk_method {method!r} is not supported for DeepSeek-V2 "
                                 "(greedy, group_limited_greedy)")
        grouped = method == "group_limited_greedy"
        m = MoeConfig(
            num_experts=n, top_k=_req(cfg, "num_experts_per_tok"),
            expert_intermediate_size=_req(cfg, "moe_intermediate_size"), scoring="softmax", norm_topk_prob=False,
            sparse_layers=tuple(range(_req(cfg, "first_k_dense_replace"), num_layers)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
            n_group=_req(cfg, "n_group") if grouped else 1, topk_group=_req(cfg, "topk_group") if grouped else 1,
            group_score="max",
            shared_intermediate_size=_req(cfg, "moe_intermediate_size") * int(cfg.get("n_shared_experts") or 0),
        )
    else:
        n = _experts(cfg, "num_experts")
        step = _req(cfg, "decoder_sparse_step") if "decoder_sparse_step" in cfg else 1
        if step < 1:
            raise MoeConfigError(f"config.json decoder_sparse_step = {step} must be >= 1")
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
            raise MoeConfigError(f"config.json mlp_only_layers must be a list of layer indices, got {only!r}")
        sparse = tuple(i for i in range(num_layers) if i not in only and n > 0 and (i + 1) % step == 0)
        shared = int(cfg.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
        m = MoeConfig(
            num_experts=n, top_k=_req(cfg, "num_experts_per_tok"),
            expert_intermediate_size=_req(cfg, "moe_intermediate_size"), scoring="softmax",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), sparse_layers=sparse,
            shared_intermediate_size=shared, shared_expert_gate=shared > 0,
        )
    if m.top_k < 1 or m.top_k > m.num_experts:
        raise MoeConfigError(f"config.json num_experts_per_tok = {m.top_k} must be in 1..{m.num_experts} (the experts)")
    if m.n_group < 1 or m.num_experts % m.n_group:
        raise MoeConfigError(f"config.json n_group = {m.n_group} must divide the {m.num_experts} experts")
    per_group = m.num_experts // m.n_group
    if m.n_group > 1 and per_group < 2 and m.group_score == "top2_sum":
        raise MoeConfigError(f"config.json n_group = {m.n_group} leaves fewer than 2 experts per group (groups are scored by their top 2)")
    if not 1 <= m.topk_group <= m.n_group or m.topk_group * per_group < m.top_k:
        raise MoeConfigError(
            f"config.json topk_group = {m.topk_group} must be in 1..n_group ({m.n_group}) and keep at least "
            f"num_experts_per_tok ({m.top_k}) experts"
        )
    return m


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    import math

    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def parse_mla(arch: str, cfg: dict[str, Any], rope_scaling: dict[str, Any] | None) -> MlaConfig | None:
    if arch not in MLA_ARCHITECTURES:
        return None
    q_lora = cfg.get("q_lora_rank")
    if q_lora is not None:
        q_lora = _req(cfg, "q_lora_rank")
    nope, rope = _req(cfg, "qk_nope_head_dim"), _req(cfg, "qk_rope_head_dim")
    if rope % 2:
        raise MoeConfigError(f"config.json qk_rope_head_dim = {rope} must be even")
    scale = (nope + rope) ** -0.5
    if rope_scaling:
        mad = rope_scaling.get("mscale_all_dim") or 0
        if mad:
            m = yarn_mscale(float(rope_scaling["factor"]), float(mad))
            scale *= m * m
    return MlaConfig(
        q_lora_rank=q_lora, kv_lora_rank=_req(cfg, "kv_lora_rank"), qk_nope_head_dim=nope, qk_rope_head_dim=rope,
        v_head_dim=_req(cfg, "v_head_dim"),
        # V2's complex-number rope rotates interleaved pairs, as V3's rope_interleave
        rope_interleave=arch == "DeepseekV2ForCausalLM" or bool(cfg.get("rope_interleave", True)),
        softmax_scale=scale, num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
    )
