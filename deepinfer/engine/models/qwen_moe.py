"""Qwen2-MoE and Qwen3-MoE: Qwen2 / Qwen3 attention with a mixture-of-experts MLP (models/moe.py) on
the layers `decoder_sparse_step` and `mlp_only_layers` select (the rest keep the dense gated MLP)."""

from deepinfer.engine.model_config import ModelConfig
from deepinfer.engine.models.layers import DecoderForCausalLM, DecoderLayer
from deepinfer.engine.models.moe import MoeBlock


class _QwenMoe(DecoderForCausalLM):
    def make_layer(self, cfg: ModelConfig, i: int) -> DecoderLayer:
        mlp = MoeBlock(cfg.hidden_size, cfg.moe, shared_name="shared_expert") if i in cfg.moe.sparse_layers else None
        return DecoderLayer(cfg, i, self.rotary, mlp=mlp)


class Qwen2MoeForCausalLM(_QwenMoe):
    """q/k/v biases (config `qkv_bias`), a shared expert scaled by sigmoid(shared_expert_gate)."""


class Qwen3MoeForCausalLM(_QwenMoe):
    def __init__(self, cfg: ModelConfig):
        cfg.qk_norm = True  # per-head RMSNorm on q and k, as Qwen3
        super().__init__(cfg)
