"""DeepSeek-V3's multi-token-prediction (MTP) module, loaded from checkpoint layer
`num_hidden_layers + k` and exposed for a speculative drafter (not run by the engine loop).

Row i combines the main model's final (normed) hidden state at position p_i with the embedding of
the token at p_i + 1 and predicts the token at p_i + 2:

    h' = eh_proj([enorm(embed(x_{i+1})); hnorm(h_i)])
    h' = decoder_block(h', position p_i)        (latent attention + MoE, its own KV cache)
    logits = shared_head.head(shared_head.norm(h'))

Checkpoint names: model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.norm,shared_head.head,
embed_tokens} plus a full decoder layer under the same prefix; the module's own embed_tokens and
head are optional (DeepSeek's checkpoints repeat the main model's; when absent those are shared).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.engine.attention import ForwardContext
from deepinfer.engine.models.layers import DecoderLayer, RMSNorm


class MtpModule(nn.Module):
    def __init__(self, hidden: int, vocab: int, eps: float, block: DecoderLayer):
        super().__init__()
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_weight = nn.Parameter(torch.empty(hidden, 2 * hidden), requires_grad=False)
        self.block = block
        self.head_norm = RMSNorm(hidden, eps)
        self.embed: torch.Tensor | None = None  # own copies when the checkpoint has them
        self.head: torch.Tensor | None = None

    def forward(self, input_ids, positions, prev_hidden, meta: ForwardContext, kv_cache, rope, embed) -> torch.Tensor:
        """The normed hidden state [T, hidden] whose logits predict the token after input_ids; embed: the
        main model's token embedding (ids -> [T, hidden]), used where this layer has none of its own."""
        x = self.mix(input_ids, prev_hidden, meta.linear, embed)
        h, residual = self.block(rope, x, None, meta, kv_cache)
        out, _ = self.head_norm.add_forward(h, residual)
        return out

    def mix(self, input_ids, prev_hidden, linear, embed) -> torch.Tensor:
        """eh_proj([enorm(embed(x_{i+1})); hnorm(h_i)]): the rows its decoder block takes (the native
        decode stack runs the block and head norm from here, model_runner.forward_mtp)."""
        e = self.enorm(F.embedding(input_ids, self.embed) if self.embed is not None else embed(input_ids))
        return linear(torch.cat([e, self.hnorm(prev_hidden)], dim=-1), self.eh_weight, None)

    def linear_weights(self) -> list[torch.Tensor]:
        ws = [self.eh_weight.data] + self.block.self_attn.linear_weights() + self.block.mlp.linear_weights()
        return ws + ([self.head] if self.head is not None else [])

    def gated_weights(self) -> list[torch.Tensor]:
        return self.block.mlp.gated_weights()

    def load(self, p: str, weights: dict, take, put, dtype, device) -> None:
        """p: 'model.layers.{num_hidden_layers + k}.'"""
        for norm, n in ((self.enorm, "enorm"), (self.hnorm, "hnorm"), (self.head_norm, "shared_head.norm")):
            put(norm.weight, take(p + n + ".weight"), p + n + ".weight")
        put(self.eh_weight, take(p + "eh_proj.weight"), p + "eh_proj.weight")
        self.block.self_attn.load(p + "self_attn.", take, put)
        self.block.mlp.load(p + "mlp.", take, put)
        put(self.block.input_layernorm.weight, take(p + "input_layernorm.weight"), p + "input_layernorm.weight")
        put(self.block.post_attention_layernorm.weight, take(p + "post_attention_layernorm.weight"),
            p + "post_attention_layernorm.weight")
        if p + "embed_tokens.weight" in weights:
            self.embed = weights[p + "embed_tokens.weight"].to(device=device, dtype=dtype).contiguous()
        if p + "shared_head.head.weight" in weights:
            self.head = weights[p + "shared_head.head.weight"].to(device=device, dtype=dtype).contiguous()
