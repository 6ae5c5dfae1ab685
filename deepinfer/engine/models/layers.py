"""Layers shared by every decoder architecture: RMSNorm, rotary embedding, gated MLP, GQA attention.

Weights are plain fp32 (CPU) or bf16 (CUDA) tensors loaded from HF-named state dicts; projections that
read the same input are fused (q|k|v, gate|up) so one matmul replaces three or two.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.engine.attention import ForwardContext, paged_attention
from deepinfer.engine.model_config import ModelConfig
from deepinfer.engine.loader.fp8_blocks import Fp8Weight
from deepinfer.engine.placeholder import cat_rows, is_placeholder, placeholder
from deepinfer.errors import ModelLoadError


def _torch_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _rows(x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    return x if keep is None else x.index_select(0, keep)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.impl = _torch_rmsnorm  # swapped for the batch-invariant version in that mode
        self.fused_add = None  # fn(x, residual, weight, eps) -> (normed, x + residual) when a kernel is selected

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.impl(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add fused with the norm: returns (norm(x + residual), x + residual)."""
        if self.fused_add is not None:
            return self.fused_add(x, residual, self.weight, self.eps)
        residual = x + residual
        return self.forward(residual), residual


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies, with HF's rope-scaling variants (linear, llama3, yarn's frequency blend)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv.float()
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv.float()
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return (inv / factor).float()
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled).float()
    raise ModelLoadError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """HF-style rotate-half rotary embedding with a precomputed cos/sin table.

    `tables(positions)` is computed once per forward and shared by every layer; `apply` rotates
    with x * cos + roll(x, D/2) * sin_signed (= HF's x * cos + rotate_half(x) * sin, bitwise)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        mag = 1.0  # YaRN scales cos and sin by its attention factor
        if scaling and scaling.get("rope_type") == "yarn":
            from deepinfer.engine.models.yarn import yarn_inv_freq

            inv, mag = yarn_inv_freq(head_dim, theta, scaling, max_positions)
        else:
            inv = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        cos, sin = freqs.cos() * mag, freqs.sin() * mag
        self.half = head_dim // 2
        self.register_buffer("cos", torch.cat([cos, cos], -1), persistent=False)  # [P, D]
        self.register_buffer("sin", torch.cat([-sin, sin], -1), persistent=False)  # sign of rotate_half folded in

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin), each [T, 1, D], for the tokens at `positions`."""
        return (self.cos.index_select(0, positions).unsqueeze(1).to(dtype),
                self.sin.index_select(0, positions).unsqueeze(1).to(dtype))

    def apply(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, heads, D] -> rotated copy."""
        cos, sin = tables
        return x * cos + x.roll(self.half, dims=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        self.scale = self.head_dim**-0.5
        qkv_out = self.q_size + 2 * self.kv_size
        self.qkv_weight = nn.Parameter(torch.empty(qkv_out, cfg.hidden_size), requires_grad=False)
        self.qkv_bias = nn.Parameter(torch.zeros(qkv_out), requires_grad=False) if cfg.attention_bias else None
        self.o_weight = nn.Parameter(torch.empty(cfg.hidden_size, self.q_size), requires_grad=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary

    def forward(self, rope, x, meta: ForwardContext, kv_cache, keep: torch.Tensor | None = None) -> torch.Tensor:
        """keep: return only these rows' outputs (every row's K and V still goes to the cache)."""
        qkv = meta.linear(x, self.qkv_weight, self.qkv_bias)
        T = x.shape[0]
        k_cache, v_cache = kv_cache
        if meta.rope_store_kv is not None:
            # one native call (Qwen3: norms q and k per head first) rotates q and k and writes k and v to the cache
            norms = {} if self.q_norm is None else \
                dict(q_norm=self.q_norm.weight, k_norm=self.k_norm.weight, eps=self.q_norm.eps)
            q = meta.rope_store_kv(qkv, self.n_heads, self.n_kv, rope[0], rope[1], meta.slot_mapping, k_cache, v_cache,
                                   **norms)
            o = paged_attention(q, None, None, k_cache, v_cache, meta, self.scale)
            return meta.linear(_rows(o.reshape(T, self.q_size), keep), self.o_weight, None)
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.n_kv, self.head_dim)
        if self.q_norm is None:
            # q and k are adjacent in the fused projection: rotate both heads at once
            qk = qkv[:, : self.q_size + self.kv_size].view(T, self.n_heads + self.n_kv, self.head_dim)
            q, k = self.rotary.apply(qk, rope).split([self.n_heads, self.n_kv], dim=1)
        else:
            q = self.q_norm(qkv[:, : self.q_size].view(T, self.n_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(T, self.n_kv, self.head_dim))
            q, k = self.rotary.apply(q, rope), self.rotary.apply(k, rope)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return meta.linear(_rows(o.reshape(T, self.q_size), keep), self.o_weight, None)

    def linear_weights(self) -> list[torch.Tensor]:
        return [self.qkv_weight.data, self.o_weight.data]

    def load(self, p: str, take, put) -> None:
        """p: 'model.layers.{i}.self_attn.'"""
        put(self.qkv_weight, cat_rows([take(p + f"{n}_proj.weight") for n in "qkv"], p + "qkv_proj.weight"),
            p + "qkv_proj.weight")
        if self.qkv_bias is not None:
            put(self.qkv_bias, torch.cat([take(p + f"{n}_proj.bias") for n in "qkv"], 0), p + "qkv bias")
        put(self.o_weight, take(p + "o_proj.weight"), p + "o_proj.weight")
        if self.q_norm is not None:
            put(self.q_norm.weight, take(p + "q_norm.weight"), p + "q_norm.weight")
            put(self.k_norm.weight, take(p + "k_norm.weight"), p + "k_norm.weight")


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_weight = nn.Parameter(torch.empty(2 * self.inter, cfg.hidden_size), requires_grad=False)
        self.down_weight = nn.Parameter(torch.empty(cfg.hidden_size, self.inter), requires_grad=False)
        self.kernel = None  # fn(x) -> the MLP's output, installed at load (expert_kernels.install_native_experts)

    def forward(self, x: torch.Tensor, meta: ForwardContext) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        if meta.silu_mul is not None:
            h = meta.silu_mul(x, self.gate_up_weight)
        else:
            g, u = meta.linear(x, self.gate_up_weight, None).split([self.inter, self.inter], dim=-1)
            h = F.silu(g) * u
        return meta.linear(h, self.down_weight, None)

    def linear_weights(self) -> list[torch.Tensor]:
        return [self.down_weight.data] if self.kernel is None else []

    def gated_weights(self) -> list[torch.Tensor]:
        return [self.gate_up_weight.data] if self.kernel is None else []

    def load(self, p: str, take, put) -> None:
        """p: 'model.layers.{i}.mlp.' (or a shared expert's prefix)"""
        put(self.gate_up_weight, cat_rows([take(p + "gate_proj.weight"), take(p + "up_proj.weight")],
                                          p + "gate_up_proj.weight"), p + "gate_up_proj.weight")
        put(self.down_weight, take(p + "down_proj.weight"), p + "down_proj.weight")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, attn: nn.Module | None = None,
                 mlp: nn.Module | None = None):
        """attn / mlp: other blocks with the same interface (MLA, MoE); default GQA attention, gated MLP."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attn if attn is not None else Attention(cfg, layer_idx, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp if mlp is not None else GatedMLP(cfg)

    def forward(self, rope, x, residual, meta, kv_cache, keep: torch.Tensor | None = None):
        """keep: compute the attention output and the MLP for these rows only (all rows' K and V are
        still cached); returns those rows, in keep's order."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        if keep is None:
            h = self.self_attn(rope, h, meta, kv_cache)
        else:
            h = self.self_attn(rope, h, meta, kv_cache, keep=keep)
            residual = residual.index_select(0, keep)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h, meta), residual


class DecoderForCausalLM(nn.Module):
    """A pre-norm decoder-only transformer; architecture files subclass it and set their quirks."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size), requires_grad=False)
        max_pos = max(cfg.max_position_embeddings, 1)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None if cfg.tie_word_embeddings else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size), requires_grad=False)
        )
        self.embed_impl = None  # fn(input_ids) -> [T, hidden] replacing F.embedding (quantised embeddings)
        # weights kept as FP8 (loader/fp8_blocks.Fp8Weight) by their placeholder's address, for the
        # runner's fp8 linear (engine/fp8_linear.py); filled as weights load
        self.fp8_weights: dict[int, Fp8Weight] = {}

    def make_layer(self, cfg: ModelConfig, i: int) -> DecoderLayer:
        """Layer i; architectures with other attention / MLP blocks override this."""
        return DecoderLayer(cfg, i, self.rotary)

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """(tensors per layer, heads, dim) of the paged KV cache: per-head K and V here."""
        return 2, self.config.num_key_value_heads, self.config.head_dim

    def forward(self, input_ids, positions, meta: ForwardContext, kv_caches) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]; with meta.keep_rows, [R, hidden]: those rows'
        only. Their last layer's attention output projection and MLP run on those rows alone (every
        row's K and V is still cached): at a prefill only the last token's state is read, and this
        skips most of a layer's FLOPs. Row-invariant kernels give those rows the same bits either way.
        benchmarks/moe.py's Qwen3-MoE-shaped model (8 layers), a 128 x 16-token prefill, 2 threads,
        runs alternating: 1.10-1.14 s per prefill with it, 1.20-1.23 s without."""
        x = self.embed(input_ids)
        rope = self.rotary.tables(positions, x.dtype)
        residual = None
        last = min(len(self.layers), len(kv_caches)) - 1
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            if i == last and meta.keep_rows is not None:
                x, residual = layer(rope, x, residual, meta, kv, keep=meta.keep_rows)
            else:
                x, residual = layer(rope, x, residual, meta, kv)
        x, _ = self.norm.add_forward(x, residual)
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings [T, hidden] (the first step of `forward`)."""
        return self.embed_impl(input_ids) if self.embed_impl is not None else F.embedding(input_ids, self.embed_tokens)

    def linear_weights(self) -> list[torch.Tensor]:
        """Every weight that goes through ForwardContext.linear (the projections and the lm_head)."""
        ws: list[torch.Tensor] = []
        for layer in self.layers:
            ws += layer.self_attn.linear_weights() + layer.mlp.linear_weights()
        ws.append((self.embed_tokens if self.lm_head is None else self.lm_head).data)
        return ws

    def projection_sources(self) -> list[tuple[nn.Parameter, list[str]]]:
        """Each projection parameter (and the embedding) with the HF tensors it is the row concatenation of."""
        out = [(self.embed_tokens, ["model.embed_tokens.weight"])]
        if self.lm_head is not None:
            out.append((self.lm_head, ["lm_head.weight"]))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            out += [(layer.self_attn.qkv_weight, [p + f"self_attn.{n}_proj.weight" for n in "qkv"]),
                    (layer.self_attn.o_weight, [p + "self_attn.o_proj.weight"]),
                    (layer.mlp.gate_up_weight, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                    (layer.mlp.down_weight, [p + "mlp.down_proj.weight"])]
        return out

    def set_embedding_impl(self, fn) -> None:
        """Use fn(input_ids) -> [T, hidden] for the token embedding lookup."""
        self.embed_impl = fn

    def gated_weights(self) -> list[torch.Tensor]:
        """The stacked [gate; up] weights (through ForwardContext.silu_mul when set, else linear)."""
        return [w for layer in self.layers for w in layer.mlp.gated_weights()]

    def set_fused_add_norm(self, fn) -> None:
        """Use fn(x, residual, weight, eps) -> (normed, x + residual) for every residual-add norm."""
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.fused_add = fn

    def set_norm_impl(self, fn) -> None:
        """Use fn(x, weight, eps) for every RMSNorm (e.g. the batch-invariant one)."""
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.impl = fn

    def compute_logits(self, hidden: torch.Tensor, meta: ForwardContext) -> torch.Tensor:
        w = self.embed_tokens if self.lm_head is None else self.lm_head
        return meta.linear(hidden, w, None).float()

    # ---- weight loading -------------------------------------------------------------------------
    def load_weights(self, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
        """Copy HF-named tensors in, fusing q|k|v and gate|up; raises ModelLoadError on a missing/misshapen one."""
        take, put = self.weight_loaders(weights, dtype, device)
        put(self.embed_tokens, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
        if self.lm_head is not None:
            put(self.lm_head, take("lm_head.weight"), "lm_head.weight")
        put(self.norm.weight, take("model.norm.weight"), "model.norm.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.self_attn.load(p + "self_attn.", take, put)
            layer.mlp.load(p + "mlp.", take, put)
            put(layer.input_layernorm.weight, take(p + "input_layernorm.weight"), p + "input_layernorm.weight")
            put(
                layer.post_attention_layernorm.weight,
                take(p + "post_attention_layernorm.weight"),
                p + "post_attention_layernorm.weight",
            )
        self.rotary.to(device)

    def weight_loaders(self, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device):
        """(take(name), put(param, value, name, dtype=...)): fetch a checkpoint tensor / copy it into a
        parameter, each raising ModelLoadError naming the tensor. A value kept as FP8
        (loader/fp8_blocks.Fp8Weight) moves to the device as it is, into `fp8_weights` under the address
        of the placeholder (placeholder.py) the parameter gets instead."""

        def take(name: str) -> torch.Tensor:
            t = weights.get(name)
            if t is None:
                raise ModelLoadError(f"weight {name!r} is missing from the checkpoint")
            return t

        def put(param: torch.Tensor, value: torch.Tensor, name: str, dtype: torch.dtype = dtype) -> None:
            if tuple(param.shape) != tuple(value.shape):
                raise ModelLoadError(
                    f"weight {name!r} has shape {tuple(value.shape)}, the config implies {tuple(param.shape)}"
                )
            if isinstance(value, Fp8Weight):
                ph = placeholder(value.shape)
                self.fp8_weights[ph.data_ptr()] = value.to(device)
                param.data = ph
                return
            # a placeholder (engine/placeholder.py) stays one: its blocks replace it after loading
            param.data = value if is_placeholder(value) else value.to(device=device, dtype=dtype).contiguous()

        return take, put
