"""DeepSeek-V3: latent attention (models/mla.py) in every layer, the dense gated MLP in the first
`first_k_dense_replace` layers and the sigmoid-routed MoE with shared experts (models/moe.py) after."""

from deepinfer.engine.model_config import ModelConfig
from deepinfer.engine.models.layers import DecoderForCausalLM, DecoderLayer
from deepinfer.engine.models.mla import MlaAttention
from deepinfer.engine.models.moe import MoeBlock


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: ModelConfig):
        cfg.head_dim = cfg.mla.qk_rope_head_dim  # the rotary tables cover the rope part of a head only
        super().__init__(cfg)

    def make_layer(self, cfg: ModelConfig, i: int) -> DecoderLayer:
        moe = MoeBlock(cfg.hidden_size, cfg.moe, shared_name="shared_experts") if i in cfg.moe.sparse_layers else None
        return DecoderLayer(cfg, i, self.rotary, attn=MlaAttention(cfg, i, self.rotary), mlp=moe)

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """One cache tensor per layer, one 'head' of kv_lora_rank + qk_rope_head_dim floats per token."""
        a = self.config.mla
        return 1, 1, a.kv_lora_rank + a.qk_rope_head_dim
