"""The model hyper-parameters every architecture file reads, normalised from HF config.json or GGUF."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.errors import ModelLoadError, UnsupportedArchitectureError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM",
                           "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    moe: Any = None  # moe_config.MoeConfig for mixture-of-experts architectures
    mla: Any = None  # moe_config.MlaConfig for multi-head latent attention (DeepSeek-V3)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedArchitectureError(
                f"unsupported architecture {archs!r}; DeepInfer supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            n_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            eos = cfg.get("eos_token_id")
            eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
            from deepinfer.engine.moe_config import parse_mla, parse_moe

            layers = int(cfg["num_hidden_layers"])
            return cls(
                moe=parse_moe(arch, cfg, layers),
                mla=parse_mla(arch, cfg, _rope_scaling(cfg)),
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=n_heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or n_heads),
                head_dim=int(cfg.get("head_dim") or hidden // n_heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=_rope_theta(cfg),
                rope_scaling=_rope_scaling(cfg),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=(bool(cfg.get("qkv_bias", True)) if arch == "Qwen2MoeForCausalLM"
                                else bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM"))),
                qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"config.json is missing or has a bad field: {e}") from e


def _rope_theta(cfg: dict[str, Any]) -> float:
    """rope_theta: top-level (transformers < 5) or inside `rope_parameters` (transformers 5 writes that)."""
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    return float(theta)


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """RoPE scaling dict with a `rope_type` key, or None for plain RoPE.

    Old configs have `rope_scaling` ({"type"|"rope_type": ..., "factor": ...}); transformers 5 folds it
    into `rope_parameters` together with rope_theta and writes rope_type "default" when unscaled.
    """
    src = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not src:
        return None
    scaling = {k: v for k, v in src.items() if k != "rope_theta"}
    rope_type = scaling.pop("type", None) or scaling.get("rope_type")
    if rope_type in (None, "default"):
        return None
    scaling["rope_type"] = rope_type
    return scaling
