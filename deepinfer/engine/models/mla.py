"""Multi-head latent attention (DeepSeek-V2/V3) on the paged cache, in the latent space.

Per token the cache holds one entry of kv_lora_rank + qk_rope_head_dim floats: the normed latent c
(kv_a_layernorm of the first kv_lora_rank outputs of kv_a_proj_with_mqa) and the rotated rope key
shared by all heads; not per-head K and V. With W_uk / W_uv the per-head slices of kv_b_proj,

    score_h = q_nope_h . (W_uk_h c) + q_pe_h . k_pe = [W_uk_h^T q_nope_h, q_pe_h] . [c, k_pe]
    out_h   = W_uv_h (sum_s p_s c_s)

so every query token attends as one multi-query head of dimension kv_lora_rank + rope over the
cache entries (the absorbed form), for decode and prefill alike. That is ordinary paged attention
with one KV head, so the existing paths (native token attention, SDPA, the batch-invariant ops, the
radix cache, chunked prefill, fork) run on latent pages unchanged: the value is the same entry
(its rope tail is computed and dropped: rope/(kv_lora_rank + rope) extra work, 11% at V3's sizes).
The absorbed projections run per head through ForwardContext.linear (packed, row-invariant), so
the batch-invariant mode holds; otherwise as one torch.bmm each way: on CUDA always, on CPU below
PER_HEAD_MIN_ROWS rows and not on the native panels (where `absorb_per_head` keeps the decode
stack's way). On CPU with the native norms the rope parts and the cache entries are one native call
(native.mla_rope_latent), the one the decode stack makes.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.engine.attention import ForwardContext, paged_attention
from deepinfer.engine.model_config import ModelConfig
from deepinfer.engine.models.layers import RMSNorm, RotaryEmbedding
from deepinfer.errors import ModelLoadError
from deepinfer_kernels import native

# From this many tokens up the absorbed per-head projections run as one linear per head (row-strided
# views in, no copies) instead of one batched bmm: at 2048 rows (a batch-128 prefill of 16-token
# prompts) torch's bmm on the transposed head views took 15-19 ms a projection where the H linears
# took 2-3 ms (V3-shaped model, 2 threads, the same bits), 1.05x end to end (benchmarks/moe.py's
# V3 model, batch 128, in-process A/B, quiet window); at 1024 rows 0.9-1.0x of the bmm's time, at
# 512 even, and below it the bmm wins (H calls' overhead: 0.11 vs 0.04 ms at 32 rows).
PER_HEAD_MIN_ROWS = 1024


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): DeepSeek's interleaved rope pairs in the
    rotate-half layout (q and k get the same permutation, so their dot products are unchanged)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MlaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        a = cfg.mla
        self.layer_idx = layer_idx
        self.n_heads = H = cfg.num_attention_heads
        self.nope, self.rope_dim, self.r, self.v_dim = a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank, a.v_head_dim
        self.qk = self.nope + self.rope_dim
        self.q_lora = a.q_lora_rank
        self.interleave = a.rope_interleave
        self.scale = a.softmax_scale
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        w = lambda *s: nn.Parameter(torch.empty(*s), requires_grad=False)  # noqa: E731
        if self.q_lora is None:
            self.q_weight = w(H * self.qk, h)
        else:
            self.q_a_weight = w(self.q_lora, h)
            self.q_a_layernorm = RMSNorm(self.q_lora, eps)
            self.q_b_weight = w(H * self.qk, self.q_lora)
        self.kv_a_weight = w(self.r + self.rope_dim, h)
        self.kv_a_layernorm = RMSNorm(self.r, eps)
        # kv_b_proj split per head at load: absorbed into the query (W_uk_h^T, [r, nope]) and the output (W_uv_h, [v, r])
        self.uk_t = nn.ParameterList(w(self.r, self.nope) for _ in range(H))
        self.uv = nn.ParameterList(w(self.v_dim, self.r) for _ in range(H))
        self.o_weight = w(h, H * self.v_dim)
        self.rotary = rotary
        # the absorbed projections one linear per head at every row count (as the batch-invariant mode and
        # long chunks do): set by the runner on the native panels (row-invariant, and the decode stack's
        # way), so a token's bits do not depend on the step's rows or on which path computed it
        self.absorb_per_head = False

    def _down(self, x: torch.Tensor, meta: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_a(x) or q(x), kv_a(x))"""
        q = self.q_weight if self.q_lora is None else self.q_a_weight
        return meta.linear(x, q, None), meta.linear(x, self.kv_a_weight, None)

    def latent(self, x: torch.Tensor, rope, meta: ForwardContext, ckv: torch.Tensor | None = None) -> torch.Tensor:
        """[T, kv_lora_rank + rope]: the cache entry of each token (normed latent, rotated rope key);
        ckv: kv_a(x) when already computed."""
        if ckv is None:
            ckv = meta.linear(x, self.kv_a_weight, None)
        c = self.kv_a_layernorm(ckv[:, : self.r].contiguous())
        k_pe = ckv[:, None, self.r :]
        if self.interleave:
            k_pe = deinterleave(k_pe)
        return torch.cat([c, self.rotary.apply(k_pe, rope)[:, 0]], dim=-1)

    def _norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """norm(x), on the native kernel where the model's norms run on it (the decode stack's bits)."""
        if norm.fused_add is native.add_rmsnorm:
            return native.add_rmsnorm(x, None, norm.weight, norm.eps)[0]
        return norm(x.contiguous())

    def _native_latent(self, x: torch.Tensor, cache: torch.Tensor) -> bool:
        """Whether the rope and the cache entries go through native.mla_rope_latent (CPU fp32 with the
        native norms: the latent's norm is then that kernel's) rather than torch ops."""
        return (x.device.type == "cpu" and x.dtype == torch.float32 and cache.dtype in native.KV_DTYPES
                and self.kv_a_layernorm.fused_add is native.add_rmsnorm)

    def forward(self, rope, x, meta: ForwardContext, kv_cache, keep: torch.Tensor | None = None) -> torch.Tensor:
        """keep: return only these rows' outputs (every row's latent still goes to the cache)."""
        T, H = x.shape[0], self.n_heads
        q, ckv = self._down(x, meta)
        if self.q_lora is not None:
            q = meta.linear(self._norm(self.q_a_layernorm, q), self.q_b_weight, None)
        q = q.contiguous().view(T, H, self.qk)
        cache = kv_cache[0]  # [slots, 1, kv_lora_rank + rope]
        q_full = torch.empty(T, H, self.r + self.rope_dim, dtype=x.dtype, device=x.device)
        native_latent = self._native_latent(x, cache)
        if native_latent:  # the rotated rope parts into q_full, the entries into the cache, one call
            native.mla_rope_latent(q, ckv, rope[0], rope[1], self.kv_a_layernorm.weight, self.kv_a_layernorm.eps,
                                   self.interleave, meta.slot_mapping, cache, q_full, self.nope)
        else:
            q_pe = q[..., self.nope :]
            if self.interleave:
                q_pe = deinterleave(q_pe)
            q_full[..., self.r :] = self.rotary.apply(q_pe, rope)
        # batch-invariant mode, the decode stack's way, or many rows on CPU. On CUDA one bmm each way at any
        # rows: per head it is 2H launches a layer (a launch cost 8.8-9.7 us on an H200 machine here: 15k
        # launches, ~0.15 s, a DeepSeek-V3 decode step), and cuBLAS's bits depend on the rows either way
        per_head = (meta.attention_fn is not None or self.absorb_per_head
                    or (x.device.type == "cpu" and T >= PER_HEAD_MIN_ROWS))
        if per_head:  # each head through the packed, row-invariant linear
            for h in range(H):
                q_full[:, h, : self.r] = meta.linear(q[:, h, : self.nope], self.uk_t[h], None)
        else:  # one batched GEMM over the heads (2H calls cost 25% of a batch-8 decode step as linears)
            # into a fresh [H, T, r], then copied: bmm's out= into the transposed view measured 2.5x slower
            q_full[..., : self.r] = torch.bmm(q[..., : self.nope].transpose(0, 1), self.uk_stack).transpose(0, 1)
        if not native_latent:
            cache.index_copy_(0, meta.slot_mapping, self.latent(x, rope, meta, ckv).unsqueeze(1))
        o = paged_attention(q_full, None, None, cache, cache, meta, self.scale)  # [T, H, r + rope]
        if keep is not None:
            o, T = o.index_select(0, keep), keep.numel()
        out = torch.empty(T, H, self.v_dim, dtype=x.dtype, device=x.device)
        if per_head:
            for h in range(H):
                out[:, h] = meta.linear(o[:, h, : self.r], self.uv[h], None)
        else:
            out = torch.bmm(o[..., : self.r].transpose(0, 1), self.uv_stack).transpose(0, 1).contiguous()
        return meta.linear(out.view(T, H * self.v_dim), self.o_weight, None)

    def linear_weights(self) -> list[torch.Tensor]:
        ws = [self.q_weight if self.q_lora is None else self.q_a_weight, self.kv_a_weight]
        if self.q_lora is not None:
            ws.append(self.q_b_weight)
        ws += [self.o_weight, *self.uk_t, *self.uv]
        return [t.data for t in ws]

    def load(self, p: str, take, put) -> None:
        """p: 'model.layers.{i}.self_attn.'"""
        if self.q_lora is None:
            put(self.q_weight, take(p + "q_proj.weight"), p + "q_proj.weight")
        else:
            put(self.q_a_weight, take(p + "q_a_proj.weight"), p + "q_a_proj.weight")
            put(self.q_a_layernorm.weight, take(p + "q_a_layernorm.weight"), p + "q_a_layernorm.weight")
            put(self.q_b_weight, take(p + "q_b_proj.weight"), p + "q_b_proj.weight")
        put(self.kv_a_weight, take(p + "kv_a_proj_with_mqa.weight"), p + "kv_a_proj_with_mqa.weight")
        put(self.kv_a_layernorm.weight, take(p + "kv_a_layernorm.weight"), p + "kv_a_layernorm.weight")
        name = p + "kv_b_proj.weight"
        kvb = take(name)
        H, per = self.n_heads, self.nope + self.v_dim
        if tuple(kvb.shape) != (H * per, self.r):
            raise ModelLoadError(f"weight {name!r} has shape {tuple(kvb.shape)}, the config implies {(H * per, self.r)}")
        kvb = kvb.view(H, per, self.r)
        for h in range(H):
            put(self.uk_t[h], kvb[h, : self.nope].t(), f"{name}[head {h}, k]")
            put(self.uv[h], kvb[h, self.nope :], f"{name}[head {h}, v]")
        put(self.o_weight, take(p + "o_proj.weight"), p + "o_proj.weight")
        # the same slices stacked for the batched path: [H, nope, r] and [H, r, v]
        self.uk_stack = torch.stack([w.data.t() for w in self.uk_t])
        self.uv_stack = torch.stack([w.data.t() for w in self.uv])
