"""Qwen3: Llama with per-head RMSNorm on q and k before rope (and explicit head_dim)."""

from deepinfer.engine.models.layers import DecoderForCausalLM
from deepinfer.engine.model_config import ModelConfig


class Qwen3ForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: ModelConfig):
        cfg.qk_norm = True
        super().__init__(cfg)
