"""Qwen2: Llama with biases on the q/k/v projections (config.attention_bias, set by ModelConfig)."""

from deepinfer.engine.models.layers import DecoderForCausalLM
from deepinfer.engine.model_config import ModelConfig


class Qwen2ForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: ModelConfig):
        cfg.attention_bias = True  # Qwen2 always has q/k/v biases, whatever config.json says
        super().__init__(cfg)
