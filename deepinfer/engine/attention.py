"""Attention over the paged KV cache (torch implementation; custom kernels plug in via the context).

A step's tokens are laid out flat: first one token per decoding sequence, then each prefill chunk.
New keys/values are written to their cache slots first; decodes then read their whole context from
the cache in one batched gather, and each prefill chunk attends to its cached prefix plus itself.

The cache may hold a narrower type than the queries (a bf16 KV cache under fp32 compute,
EngineConfig.kv_cache_dtype): keys and values are rounded as they are written and widened as they
are read, and a chunk attending to its own new keys sees them rounded too, so every path sees the
values the cache holds.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# SDPA's backends on CUDA: every one but cuDNN's. torch 2.11 tries cuDNN first for bf16 SDPA on
# Hopper (a profile of our prefill on an H200 showed aten::_cudnn_attention_forward), and cuDNN
# builds an execution plan for each new shape: a decode step's context length is new at every step,
# and so is each new prompt length. On that H200 (scripts/gpu_engine_check.py, bf16), the two models
# whose decode attention went through SDPA ran at 9-13 tok/s at batch 1 (the DeepSeek-V3-shaped
# one's latent attention; the Qwen3-MoE-shaped one without TileLang), against 77 tok/s for the
# Qwen3-MoE one on the paged decode kernel, and slower per step at batch 32 than at batch 128;
# FunASR issue 3704 reports the same per-shape plan builds (0.44 s each, torch 2.11, B200). Flash and
# memory-efficient attention keep no per-shape state. The cure is inferred from these, not yet timed.
CUDA_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def sdpa_scope(device: torch.device):
    """The context a forward pass runs its SDPA calls in: on CUDA, CUDA_SDPA_BACKENDS only."""
    return sdpa_kernel(list(CUDA_SDPA_BACKENDS)) if device.type == "cuda" else contextlib.nullcontext()


@dataclass
class PrefillChunk:
    q_start: int  # offset of the chunk's first token in the flat batch
    q_len: int
    ctx_len: int  # tokens of context after this chunk (cached prefix + chunk)
    gather_idx: torch.Tensor | None  # [ctx_len] cache slots, None when the chunk is the whole context
    native: bool = False  # computed by ForwardContext.token_attention with the decodes
    grouped: bool = False  # computed in one of ForwardContext.prefill_groups


@dataclass
class PrefillGroup:
    """Prefill chunks attended in one SDPA call (group_prefills): B chunks' queries padded to Lq rows
    and their contexts' cache slots to Lk; padding is masked out and its outputs dropped."""

    q_rows: torch.Tensor  # [B * Lq] int64 rows of q (a padding row repeats its chunk's first row)
    kv_slots: torch.Tensor  # [B * Lk] int64 cache slots of each chunk's context (padding: slot 0)
    mask: torch.Tensor  # [B, 1, Lq, Lk] bool: query i of a chunk sees its context's keys up to its position
    src: torch.Tensor  # [n] int64 rows of the padded [B * Lq] output that are real queries
    dst: torch.Tensor  # [n] int64 their rows in the step's output
    shape: tuple[int, int, int]  # (B, Lq, Lk)


@dataclass
class TokenAttentionInputs:
    """Per-token view of the batch for deepinfer_kernels.native.token_attention: token t attends to
    cache slots ctx_idx[row[t], :lens[t]] (lens 0: the token is left to the per-chunk path)."""

    ctx_idx: torch.Tensor  # [num_seqs, max_len] int64 cache slots of each sequence's context
    row: torch.Tensor  # [T] int64
    lens: torch.Tensor  # [T] int64
    max_len: int


@dataclass
class ForwardContext:
    """Everything a forward pass needs besides token ids and positions."""

    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    num_decode: int = 0
    decode_gather_idx: torch.Tensor | None = None  # [Bd, Lmax] cache slots (padded with 0)
    decode_valid: torch.Tensor | None = None  # [Bd, Lmax] bool
    decode_block_tables: torch.Tensor | None = None  # [Bd, max_blocks] int32 (for the decode kernel)
    decode_context_lens: torch.Tensor | None = None  # [Bd] int32
    block_size: int = 0
    decode_kernel: Callable | None = None  # deepinfer_kernels.paged_decode_attention when selected
    prefills: list[PrefillChunk] = field(default_factory=list)
    linear: Callable = F.linear
    silu_mul: Callable | None = None  # fn(x, [gate; up] weight) -> silu(x @ gate.T) * (x @ up.T), when fused
    attention_fn: Callable | None = None  # overrides paged_attention's math (batch-invariant mode)
    token_attention: Callable | None = None  # deepinfer_kernels.native.token_attention when selected
    tokens: TokenAttentionInputs | None = None
    # deepinfer_kernels.native.rope_store_kv when selected: rotary + cache write in one call, after
    # which paged_attention is called with k = v = None (they are already in the cache)
    rope_store_kv: Callable | None = None
    # [R] int64: the flat rows whose final hidden states the step needs (its logit rows), when fewer
    # than all: the last layer computes its attention output projection and MLP for these rows only,
    # and the model returns [R, hidden] in this order (DecoderForCausalLM.forward)
    keep_rows: torch.Tensor | None = None
    # prefill chunks batched into single SDPA calls (CUDA: model_runner.prepare), the rest one call each
    prefill_groups: list[PrefillGroup] = field(default_factory=list)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor):
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


def as_cached(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x as the cache holds it, in x's dtype (rounded to a narrower cache's type and widened back)."""
    return x if cache.dtype == x.dtype else x.to(cache.dtype).to(x.dtype)


def paged_attention(q, k, v, k_cache, v_cache, ctx: ForwardContext, scale: float) -> torch.Tensor:
    """q [T,H,D], k/v [T,Hkv,D] (None: already written to the cache); caches [num_slots, Hkv, D].
    Returns [T,H,D]."""
    if k is not None:
        write_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
    if ctx.attention_fn is not None:
        return ctx.attention_fn(q, k, v, k_cache, v_cache, ctx, scale)
    T, H, D = q.shape
    Hkv = k_cache.shape[1]
    nd = ctx.num_decode
    if ctx.token_attention is not None:
        # decodes and short prefill chunks in one native call; long chunks below through SDPA
        ta = ctx.tokens
        out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
        ctx.token_attention(q, k_cache, v_cache, ta.ctx_idx, ta.row, ta.lens, scale, ta.max_len, out=out)
        for c in ctx.prefills:
            if not c.native:
                qs, ks, vs = chunk_qkv(c, q, k, v, k_cache, v_cache, ctx.slot_mapping)
                out[c.q_start : c.q_start + c.q_len] = prefill_attention(qs, ks, vs, scale)
        return out
    out = torch.empty_like(q)
    if nd and ctx.decode_kernel is not None:
        nb = k_cache.shape[0] // ctx.block_size
        kc = k_cache.view(nb, ctx.block_size, Hkv, D)
        vc = v_cache.view(nb, ctx.block_size, Hkv, D)
        out[:nd] = ctx.decode_kernel(q[:nd].contiguous(), kc, vc, ctx.decode_block_tables, ctx.decode_context_lens, scale)
    elif nd:
        out[:nd] = decode_attention(q[:nd], k_cache, v_cache, ctx.decode_gather_idx, ctx.decode_valid, scale)
    for g in ctx.prefill_groups:
        out.index_copy_(0, g.dst, grouped_prefill_attention(q, k_cache, v_cache, g, scale))
    for c in ctx.prefills:
        if not c.grouped:
            qs, ks, vs = chunk_qkv(c, q, k, v, k_cache, v_cache, ctx.slot_mapping)
            out[c.q_start : c.q_start + c.q_len] = prefill_attention(qs, ks, vs, scale)
    return out


# A group's padded sizes, in elements: its scores (B * heads * Lq * Lk, what SDPA's math backend would
# hold in fp32) and its gathered keys at full heads (B * Lk * heads * head_dim, likewise the values)
GROUP_SCORES_MAX = 1 << 26
GROUP_KEYS_MAX = 1 << 26


def group_prefills(chunks: list[PrefillChunk], block_rows: torch.Tensor, block_size: int, device, heads: int,
                   head_dim: int) -> list[PrefillGroup]:
    """Batch prefill chunks (block_rows[i]: chunk i's block table) into groups for one SDPA call each,
    in order of context length, while a group's padded sizes stay within GROUP_SCORES_MAX and
    GROUP_KEYS_MAX; marks the grouped chunks. Why (CUDA): one SDPA call per chunk and layer cost
    ~77 us of host time each on an H200 machine here (a batch-64 prefill of a 28-layer model: 1792
    calls, ~0.14 s)."""
    order = sorted(range(len(chunks)), key=lambda i: chunks[i].ctx_len)
    groups, cur = [], []

    def fits(idx):
        n, lq, lk = len(idx), max(chunks[i].q_len for i in idx), max(chunks[i].ctx_len for i in idx)
        return n * heads * lq * lk <= GROUP_SCORES_MAX and n * lk * heads * head_dim <= GROUP_KEYS_MAX

    for i in order:
        if cur and not fits(cur + [i]):
            groups.append(cur)
            cur = []
        cur.append(i)
    groups.append(cur)
    return [_group(idx, chunks, block_rows, block_size, device) for idx in groups if len(idx) > 1]


def _group(idx: list[int], chunks: list[PrefillChunk], block_rows: torch.Tensor, bs: int, device) -> PrefillGroup:
    for i in idx:
        chunks[i].grouped = True
    qs = torch.tensor([chunks[i].q_start for i in idx])
    ql = torch.tensor([chunks[i].q_len for i in idx])
    cl = torch.tensor([chunks[i].ctx_len for i in idx])
    B, Lq, Lk = len(idx), int(ql.max()), int(cl.max())
    qi, kj = torch.arange(Lq), torch.arange(Lk)
    q_valid = qi[None, :] < ql[:, None]  # [B, Lq]
    q_rows = torch.where(q_valid, qs[:, None] + qi[None, :], qs[:, None])
    pos = (cl - ql)[:, None] + qi[None, :]  # each query's position in its context
    mask = (kj[None, None, :] <= pos[:, :, None]) & (kj[None, None, :] < cl[:, None, None])
    mask |= ~q_valid[:, :, None] & (kj == 0)  # a padding query sees key 0 (no empty softmax row)
    rows = block_rows[idx]
    slots = rows[:, (kj // bs).clamp(max=rows.shape[1] - 1)] * bs + kj % bs
    slots = torch.where(kj[None, :] < cl[:, None], slots, 0)
    src = q_valid.reshape(-1).nonzero().squeeze(1)
    return PrefillGroup(q_rows.reshape(-1).to(device), slots.reshape(-1).to(device), mask[:, None].to(device),
                        src.to(device), q_rows.reshape(-1)[src].to(device), (B, Lq, Lk))


def grouped_prefill_attention(q, k_cache, v_cache, g: PrefillGroup, scale: float) -> torch.Tensor:
    """The real query rows of group g (in g.src order), attending to their contexts in the cache."""
    B, Lq, Lk = g.shape
    H, D = q.shape[1], q.shape[2]
    Hkv, Dv = k_cache.shape[1], v_cache.shape[2]
    qb = q.index_select(0, g.q_rows).view(B, Lq, H, D).transpose(1, 2)
    kb = k_cache.index_select(0, g.kv_slots).to(q.dtype).view(B, Lk, Hkv, D).transpose(1, 2)
    vb = v_cache.index_select(0, g.kv_slots).to(q.dtype).view(B, Lk, Hkv, Dv).transpose(1, 2)
    if Hkv != H:  # as full heads: the memory-efficient kernel takes a mask, not always enable_gqa
        kb, vb = kb.repeat_interleave(H // Hkv, dim=1), vb.repeat_interleave(H // Hkv, dim=1)
    o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=g.mask, scale=scale)  # [B, H, Lq, Dv]
    return o.transpose(1, 2).reshape(B * Lq, H, Dv).index_select(0, g.src)


def chunk_qkv(c: PrefillChunk, q, k, v, k_cache, v_cache, slot_mapping=None):
    """A prefill chunk's queries and the keys/values of its whole context (cached prefix + chunk);
    with k = v = None the chunk's own keys are read back from their cache slots."""
    qs = q[c.q_start : c.q_start + c.q_len]
    if c.gather_idx is None:  # the chunk is the whole context: its own new keys
        if k is None:
            own = slot_mapping[c.q_start : c.q_start + c.q_len]
            return qs, k_cache.index_select(0, own).to(q.dtype), v_cache.index_select(0, own).to(q.dtype)
        ks, vs = k[c.q_start : c.q_start + c.q_len], v[c.q_start : c.q_start + c.q_len]
        return qs, as_cached(ks, k_cache), as_cached(vs, v_cache)
    return qs, k_cache.index_select(0, c.gather_idx).to(q.dtype), v_cache.index_select(0, c.gather_idx).to(q.dtype)


def causal_mask(q_len: int, ctx_len: int, device) -> torch.Tensor:
    """Bool [q_len, ctx_len]: query i (at absolute position ctx_len - q_len + i) sees keys <= it."""
    qpos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    kpos = torch.arange(ctx_len, device=device)[None, :]
    return kpos <= qpos


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence: q [q_len,H,D] are the last q_len positions of the ctx_len keys k/v [ctx,Hkv,D]."""
    q_len, ctx_len = q.shape[0], k.shape[0]
    qh = q.transpose(0, 1).unsqueeze(0)
    kh = k.transpose(0, 1).unsqueeze(0)
    vh = v.transpose(0, 1).unsqueeze(0)
    if q_len == ctx_len:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        mask = causal_mask(q_len, ctx_len, q.device)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def decode_attention(q, k_cache, v_cache, gather_idx, valid, scale) -> torch.Tensor:
    """Batched single-token attention: q [B,H,D] over each row's context gathered from the cache.

    index_select + SDPA on strided views: 2.7x faster at batch 128 than advanced indexing and
    permuted matmuls (measured), as nothing is copied after the gather."""
    B, H, D = q.shape
    L = gather_idx.shape[1]
    Hkv = k_cache.shape[1]
    flat = gather_idx.reshape(-1)
    K = k_cache.index_select(0, flat).to(q.dtype).view(B, L, Hkv, D).transpose(1, 2)  # [B,Hkv,L,D]
    V = v_cache.index_select(0, flat).to(q.dtype).view(B, L, Hkv, D).transpose(1, 2)
    o = F.scaled_dot_product_attention(
        q.view(B, H, 1, D), K, V, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True
    )
    return o.view(B, H, D)


def paged_attention_batch_invariant(q, k, v, k_cache, v_cache, ctx: ForwardContext, scale: float) -> torch.Tensor:
    """paged_attention's math through deepinfer.engine.batch_invariant: a query's output depends only
    on its own values and the keys it sees (fixed split size over the KV length), bitwise, so
    decode, prefill, chunked prefill and cached-prefix paths agree and batch composition is irrelevant.
    (K/V were already written to the cache by paged_attention.)"""
    from deepinfer.engine.batch_invariant import bi_attention, bi_attention_decode

    if ctx.token_attention is not None:  # every token natively: one fixed reduction order per token
        ta = ctx.tokens
        return ctx.token_attention(q, k_cache, v_cache, ta.ctx_idx, ta.row, ta.lens, scale, ta.max_len)
    out = torch.empty_like(q)
    nd = ctx.num_decode
    if nd:
        B, L = ctx.decode_gather_idx.shape
        Hkv, D = k_cache.shape[1], k_cache.shape[2]
        K = k_cache.index_select(0, ctx.decode_gather_idx.reshape(-1)).to(q.dtype).view(B, L, Hkv, D)
        V = v_cache.index_select(0, ctx.decode_gather_idx.reshape(-1)).to(q.dtype).view(B, L, Hkv, D)
        out[:nd] = bi_attention_decode(q[:nd], K, V, ctx.decode_valid.sum(1), scale=scale)
    for c in ctx.prefills:
        qs, ks, vs = chunk_qkv(c, q, k, v, k_cache, v_cache, ctx.slot_mapping)
        out[c.q_start : c.q_start + c.q_len] = bi_attention(qs, ks, vs, scale=scale, causal_offset=c.ctx_len - c.q_len)
    return out
