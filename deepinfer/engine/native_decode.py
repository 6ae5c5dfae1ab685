"""The native decode stack (deepinfer_kernels.decode_stack) for a model on GGUF block weights or on
the native panel GEMM (fp32 / 16-bit checkpoints): which models it binds, and binding it.

A step of few query tokens (decodes, drafts to verify, short prefill chunks; up to max_num_seqs
rows, or fewer than quant.PANEL_M where the CPU lacks AVX2 in the exact modes) runs every decoder
layer in one C call instead of ~10-40 Python-driven ops per layer (ModelRunner._forward), with the
same kernels in the same order: the same bits as the per-op path, so the batch-invariant mode holds
through it. Bound for the plain decoder (Llama, Qwen2, Qwen3: GQA attention with rotate-half rope,
optional q|k|v bias, optional per-head q/k RMSNorm) and, on panels, DeepSeek-V2 / V3's latent attention
(models/mla.py, its absorbed projections one linear a head: MlaAttention.absorb_per_head, which the
runner sets on the native panels, so the per-op path computes them so too), whose every projection has
blocks (QuantLinear) or native panels (CpuLinear's native backend) and whose norms, rotary + KV store
and attention are the native kernels; each MLP a gated MLP on those projections or (panels) an MoE
block routed and run by the native kernels, a shared expert fused into the routed experts' call
(DeepSeek-V3; Qwen2-MoE with its gate, where the shared expert's width is a multiple of the routed
experts', as Qwen1.5-MoE's 5632 = 4 x 1408). Anything else (a shared expert that does not fuse,
expert parallelism, oneDNN or F.linear projections) keeps the per-op path.

Why for MoE models: at a batch-128 decode step of benchmarks/moe.py's Qwen3-MoE-shaped model the
per-op path spent ~13 of ~90 ms in Python between the kernels (ctypes calls, checks, allocations;
~1 ms per layer), each op slowed 3-30x by running right after a kernel that streamed ~100 MB of
expert weights through the caches (measured: a 20-iteration Python loop 0.6 us back to back, 18 us
after such a stream). The DeepSeek-V3-shaped model's latent attention took ~40 torch ops a layer: with
the stack its decode ran 1.40x the tokens/s at batch 1, 1.36x at 8, 1.15x at 32, 1.03x at 128
(benchmarks/moe.py, fp32 checkpoint, best of 3, the run before against the run after).
"""

from __future__ import annotations

import torch

from deepinfer.engine.cpu_linear import CpuLinear
from deepinfer.engine.expert_kernels import NativeExperts, NativeGatedMlp
from deepinfer.engine.models.layers import Attention, DecoderForCausalLM, DecoderLayer, GatedMLP, RMSNorm
from deepinfer.engine.models.mla import MlaAttention
from deepinfer.engine.models.moe import MoeBlock
from deepinfer.engine.quant_linear import BF16_M, INT8_OUTER_M, INT8_OUTER_M_Q4, OUTER_M, QuantLinear
from deepinfer_kernels import moe_gemm, moe_route, native, quant
from deepinfer_kernels.decode_stack import DecodeStack, StackLayer, StackMla, StackMoe


def bind_decode_stack(model: DecoderForCausalLM, linear: QuantLinear | CpuLinear,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                      max_seqs: int = 1, mtp_depth: int | None = None) -> DecodeStack | None:
    """The stack over `model`'s layers and caches, or None when the model is not one it computes
    exactly as the per-op path does (see the module docstring). It takes steps of up to max_seqs rows
    (see `stack_kernels`). mtp_depth: over the model's MTP layer of that depth instead (models/mtp.py:
    its decoder block, then its shared head's norm; kv_caches: its cache), for the rows eh_proj made."""
    blocks = isinstance(linear, QuantLinear)
    panels = isinstance(linear, CpuLinear) and linear.backend == "native"
    if not (blocks or panels) or type(model).forward is not DecoderForCausalLM.forward:
        return None
    stack_layers = model.layers if mtp_depth is None else [model.mtp[mtp_depth].block]
    final = model.norm if mtp_depth is None else model.mtp[mtp_depth].head_norm
    if type(model).embed is not DecoderForCausalLM.embed or len(kv_caches) != len(stack_layers) or not kv_caches:
        return None
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    if any(n.fused_add is not native.add_rmsnorm or n.eps != model.norm.eps for n in norms):
        return None  # the per-op path's norms are another kernel (or another eps)
    rot = model.rotary
    if rot.cos.dtype != torch.float32 or not rot.cos.is_contiguous() or not rot.sin.is_contiguous():
        return None

    def weight(w: torch.Tensor, gated: bool = False):
        """w's blocks or panels, as the per-op path projects it (meta.linear / meta.silu_mul), or None"""
        if blocks:
            return linear.table.get(w.data_ptr())
        return (linear.packed_gated if gated else linear.packed).get(w.data_ptr())

    layers = [_layer(layer, kv, weight, rot, panels) for layer, kv in zip(stack_layers, kv_caches)]
    if any(ly is None for ly in layers):
        return None
    heads = stack_layers[0].self_attn.n_heads
    if panels:  # (the panel GEMMs take any row count with the same bits)
        return DecodeStack(layers, final.weight.data, rot.cos, rot.sin, final.eps, heads, block_size, "exact",
                           max(max_seqs, 1))
    rows, many = stack_kernels(linear, max_seqs)
    return DecodeStack(layers, final.weight.data, rot.cos, rot.sin, final.eps, heads, block_size, linear.row_mode, rows,
                       many, (INT8_OUTER_M, INT8_OUTER_M_Q4))


def _layer(layer, kv, weight, rot, panels: bool) -> StackLayer | None:
    """The stack's view of one decoder layer and its cache, or None where the stack does not compute
    it as the per-op path does."""
    attn, mlp = layer.self_attn, layer.mlp
    if type(layer) is not DecoderLayer or attn.rotary is not rot:
        return None
    mla = None
    if type(attn) is MlaAttention and panels and len(kv) == 1:  # the latent cache, one tensor
        mla, (kc,) = _mla(attn, weight), kv
        vc = kc
        if mla is None:
            return None
    elif type(attn) is not Attention or attn.scale != attn.head_dim**-0.5 or len(kv) != 2:
        return None
    else:
        kc, vc = kv
    moe = None
    if type(mlp) is GatedMLP and mlp.kernel is None:
        mlp_weights = [weight(mlp.gate_up_weight, gated=panels), weight(mlp.down_weight)]
    elif panels and type(mlp) is GatedMLP and _one_expert(mlp.kernel):  # an MoE model's dense layer
        moe, mlp_weights = StackMoe(None, mlp.kernel._packed, 1), [None, None]
    elif panels and type(mlp) is MoeBlock:
        moe, mlp_weights = _moe(mlp, weight), [None, None]
        if moe is None:
            return None
    else:
        return None
    proj = [weight(attn.qkv_weight) if mla is None else None, weight(attn.o_weight)]
    if proj[1] is None or (mla is None and proj[0] is None) or (moe is None and any(w is None for w in mlp_weights)):
        return None  # a projection without blocks or panels (through F.linear)
    bias = attn.qkv_bias.data if mla is None and attn.qkv_bias is not None else None
    norms = (attn.q_norm.weight.data, attn.k_norm.weight.data) if mla is None and attn.q_norm is not None else (None, None)
    return StackLayer(layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data,
                      proj[0], bias, proj[1], *mlp_weights, kc, vc, *norms, moe=moe, mla=mla)


def _one_expert(kernel) -> bool:
    """kernel: expert_kernels.NativeGatedMlp over one expert (its forward: every row to it, no combine)"""
    return (type(kernel) is NativeGatedMlp and kernel._kernel is moe_gemm.moe_experts
            and kernel._packed.num_experts == 1)


def _moe(block: MoeBlock, weight) -> StackMoe | None:
    """The stack's view of an MoE block that MoeBlock.forward runs as router panels -> moe_route.route ->
    one native experts call with the slot combine (and a shared expert's chunks in it, where
    NativeExperts.can_fuse it; all experts local), else None."""
    kernel, m = block.expert_kernel, block.moe
    if (type(block).forward is not MoeBlock.forward or type(block).route is not MoeBlock.route
            or block.dispatcher is not None or block._global_to_local is not None
            or block.route_kernel is not moe_route.route
            or type(kernel) is not NativeExperts or kernel._kernel is not moe_gemm.moe_experts
            or block.gate_weight.dtype != torch.float32):
        return None
    shared = gate = None
    if block.shared is not None:  # only the fused form (MoeBlock.forward's: chunks in the experts' call)
        if not kernel.can_fuse(block.shared):
            return None
        shared = block.shared.kernel.chunks
        if block.shared_gate_weight is not None:  # Qwen2-MoE: its gate's panels
            gate = weight(block.shared_gate_weight)
            if gate is None:
                return None
    router = weight(block.gate_weight)
    if router is None:
        return None
    bias = block.score_bias.data if block.score_bias is not None else None
    return StackMoe(router, kernel._packed, m.top_k, m.scoring, bias, m.n_group, m.topk_group, m.group_score,
                    bool(m.norm_topk_prob), float(m.routed_scaling_factor), shared, gate)


def _mla(attn: MlaAttention, weight) -> StackMla | None:
    """The stack's view of a latent attention block whose projections are all panels and whose per-op path
    computes the absorbed projections one linear a head (absorb_per_head: the stack's bits), else None."""
    if not attn.absorb_per_head:
        return None
    q_b = weight(attn.q_b_weight) if attn.q_lora is not None else None
    q_a = weight(attn.q_weight if attn.q_lora is None else attn.q_a_weight)
    kv_a = weight(attn.kv_a_weight)
    uk, uv = [weight(w) for w in attn.uk_t], [weight(w) for w in attn.uv]
    if q_a is None or kv_a is None or (attn.q_lora is not None and q_b is None) or None in uk or None in uv:
        return None
    q_norm = attn.q_a_layernorm if attn.q_lora is not None else None
    return StackMla(q_a, q_b, kv_a, q_norm.weight.data if q_norm is not None else None,
                    attn.kv_a_layernorm.weight.data, uk, uv, attn.nope, attn.rope_dim, attn.v_dim, attn.interleave,
                    float(attn.scale), q_norm.eps if q_norm is not None else 1e-6, attn.kv_a_layernorm.eps)


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
