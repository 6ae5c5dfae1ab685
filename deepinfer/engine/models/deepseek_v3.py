"""DeepSeek-V3: latent attention (models/mla.py) in every layer, the dense gated MLP in the first
`first_k_dense_replace` layers and the sigmoid-routed MoE with shared experts (models/moe.py) after;
the checkpoint's multi-token-prediction layers (models/mtp.py) are loaded and exposed through
`mtp_logits` for a speculative drafter."""

import logging

import torch
from torch import nn

from deepinfer.engine.attention import ForwardContext
from deepinfer.engine.model_config import ModelConfig
from deepinfer.engine.models.layers import DecoderForCausalLM, DecoderLayer
from deepinfer.engine.models.mla import MlaAttention
from deepinfer.engine.models.moe import MoeBlock
from deepinfer.engine.models.mtp import MtpModule

logger = logging.getLogger(__name__)


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: ModelConfig):
        cfg.head_dim = cfg.mla.qk_rope_head_dim  # the rotary tables cover the rope part of a head only
        super().__init__(cfg)
        self.mtp = nn.ModuleList()  # filled at load from the checkpoint's MTP layers

    def make_layer(self, cfg: ModelConfig, i: int, sparse: bool | None = None) -> DecoderLayer:
        if sparse is None:
            sparse = i in cfg.moe.sparse_layers
        moe = MoeBlock(cfg.hidden_size, cfg.moe, shared_name="shared_experts") if sparse else None
        return DecoderLayer(cfg, i, self.rotary, attn=MlaAttention(cfg, i, self.rotary), mlp=moe)

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """One cache tensor per layer, one 'head' of kv_lora_rank + qk_rope_head_dim floats per token
        (an MTP layer's cache has the same shape)."""
        a = self.config.mla
        return 1, 1, a.kv_lora_rank + a.qk_rope_head_dim

    def load_weights(self, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
        super().load_weights(weights, dtype, device)
        cfg = self.config
        take, put = self.weight_loaders(weights, dtype, device)
        L = cfg.num_hidden_layers
        for k in range(cfg.mla.num_nextn_predict_layers):
            p = f"model.layers.{L + k}."
            if not any(n.startswith(p) for n in weights):
                logger.warning("config.json declares %d MTP layer(s) but the checkpoint has no %s* tensors: "
                               "MTP drafting is unavailable", cfg.mla.num_nextn_predict_layers, p)
                break
            m = MtpModule(cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps, self.make_layer(cfg, L + k, sparse=True))
            m.load(p, weights, take, put, dtype, device)
            self.mtp.append(m)

    def linear_weights(self) -> list[torch.Tensor]:
        return super().linear_weights() + [w for m in self.mtp for w in m.linear_weights()]

    def gated_weights(self) -> list[torch.Tensor]:
        return super().gated_weights() + [w for m in self.mtp for w in m.gated_weights()]

    # ---- the MTP drafter's entry point ------------------------------------------------------------
    @property
    def num_mtp_layers(self) -> int:
        return len(self.mtp)

    def mtp_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                   meta: ForwardContext, kv_cache, depth: int = 0, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [T, vocab] (fp32) of MTP layer `depth` for the token after input_ids[i], given the main
        model's final hidden state `hidden[i]` (this model's forward output) at positions[i], the position
        of the token before input_ids[i]. kv_cache: the MTP layer's own cache, shaped as a layer's of the
        main cache (kv_cache_spec); meta addresses it like a layer's. rows: only these rows' logits."""
        if not 0 <= depth < len(self.mtp):
            raise IndexError(f"MTP layer {depth} requested; the checkpoint has {len(self.mtp)}")
        m = self.mtp[depth]
        rope = self.rotary.tables(positions, hidden.dtype)
        h = m(input_ids, positions, hidden, meta, kv_cache, rope, self.embed)
        if rows is not None:
            h = h.index_select(0, rows)
        return self.mtp_head(h, depth, meta.linear)

    def mtp_head(self, h: torch.Tensor, depth: int, linear) -> torch.Tensor:
        """Logits (fp32) of MTP layer `depth`'s normed hidden states h (its own head, else the model's)."""
        m = self.mtp[depth]
        head = m.head if m.head is not None else (self.embed_tokens if self.lm_head is None else self.lm_head)
        return linear(h, head, None).float()


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V2: V3's layers with softmax greedy / group-limited routing (engine/moe_config.py),
    interleaved rope always, no MTP layers."""
