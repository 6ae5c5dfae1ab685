"""The native decode stack for a model on GGUF block weights (deepinfer_kernels.decode_stack): which
models it binds, and binding it.

A step of few query tokens (decodes, drafts to verify, short prefill chunks; up to max_num_seqs
rows, or fewer than quant.PANEL_M where the CPU lacks AVX2 in the exact modes) runs every decoder
layer in one C call instead of ~10 Python-driven ops per layer (ModelRunner._forward), with the same kernels in the same order:
the same bits as the per-op path, so the batch-invariant mode holds through it. Bound only for the
plain dense decoder (Llama, Qwen2, Qwen3: GQA attention with rotate-half rope, optional q|k|v bias,
optional per-head q/k RMSNorm, gated MLP) whose every projection has blocks and whose norms, rotary +
KV store and attention are the native kernels; anything else (MoE, MLA, fp32 projections) keeps the
per-op path.
"""

from __future__ import annotations

import torch

from deepinfer.engine.models.layers import Attention, DecoderForCausalLM, DecoderLayer, GatedMLP, RMSNorm
from deepinfer.engine.quant_linear import BF16_M, INT8_OUTER_M, INT8_OUTER_M_Q4, OUTER_M, QuantLinear
from deepinfer_kernels import native, quant
from deepinfer_kernels.decode_stack import DecodeStack, StackLayer


def bind_decode_stack(model: DecoderForCausalLM, linear: QuantLinear, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      block_size: int, max_seqs: int = 1) -> DecodeStack | None:
    """The stack over `model`'s layers and caches, or None when the model is not one it computes
    exactly as the per-op path does (see the module docstring). It takes steps of up to max_seqs rows
    (see `stack_kernels`)."""
    if not isinstance(linear, QuantLinear) or type(model).forward is not DecoderForCausalLM.forward:
        return None
    if type(model).embed is not DecoderForCausalLM.embed or len(kv_caches) != len(model.layers) or not kv_caches:
        return None
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    if any(n.fused_add is not native.add_rmsnorm or n.eps != model.norm.eps for n in norms):
        return None  # the per-op path's norms are another kernel (or another eps)
    rot = model.rotary
    if rot.cos.dtype != torch.float32 or not rot.cos.is_contiguous() or not rot.sin.is_contiguous():
        return None
    layers = []
    for layer, (kc, vc) in zip(model.layers, kv_caches):
        attn, mlp = layer.self_attn, layer.mlp
        if (type(layer) is not DecoderLayer or type(attn) is not Attention or type(mlp) is not GatedMLP
                or len(attn.kernels) or mlp.kernel is not None or attn.rotary is not rot
                or attn.scale != attn.head_dim**-0.5):
            return None
        blocks = [linear.table.get(w.data_ptr()) for w in (attn.qkv_weight, attn.o_weight, mlp.gate_up_weight,
                                                          mlp.down_weight)]
        if any(b is None for b in blocks):
            return None  # a projection without blocks (fp32 through F.linear)
        bias = attn.qkv_bias.data if attn.qkv_bias is not None else None
        norms = (attn.q_norm.weight.data, attn.k_norm.weight.data) if attn.q_norm is not None else (None, None)
        layers.append(StackLayer(layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data,
                                 blocks[0], bias, blocks[1], blocks[2], blocks[3], kc, vc, *norms))
    rows, many = stack_kernels(linear, max_seqs)
    return DecodeStack(layers, model.norm.weight.data, rot.cos, rot.sin, model.norm.eps, model.layers[0].self_attn.n_heads,
                       block_size, linear.row_mode, rows, many, (INT8_OUTER_M, INT8_OUTER_M_Q4))


def stack_kernels(linear: QuantLinear, max_seqs: int) -> tuple[int, str]:
    """(the most rows the stack takes, the exact modes' kernel from PANEL_M rows): every step of up to
    max_seqs rows, with QuantLinear's kernels at each row count. In the int8 mode those are the row
    kernel and from INT8_OUTER_M rows the vpdpbusd outer kernel (its bits); in the exact and bf16 modes
    the row kernel and from PANEL_M rows the panel kernel (batch-invariant mode), the outer-product
    kernel (exact) or the bf16 one (bf16 mode). Without AVX2, QuantLinear dequantises many rows for
    oneDNN instead, which the stack does not: there it stops below PANEL_M rows in those modes.
    SmolLM2-135M Q4_1 at 128 decode rows, the per-op path spent ~17 us of Python and a fresh torch
    output (page faults on the MB-sized ones) per op, ~10 ops per layer."""
    rows = max(max_seqs, quant.PANEL_M - 1)
    if linear.mode == "int8":
        return rows, "panel"
    if not linear.avx2 or not OUTER_M == BF16_M == quant.PANEL_M:
        return quant.PANEL_M - 1, "panel"
    return rows, "panel" if linear.invariant else "bf16" if linear.mode == "bf16" else "outer"
