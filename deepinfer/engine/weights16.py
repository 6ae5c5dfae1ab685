"""A bf16 or fp16 checkpoint's projections kept in their own 16-bit storage on CPU (Engine(dtype="auto")
on such a model directory; activations, KV cache and accumulation stay fp32), and any dense checkpoint's
projections rounded to bf16 for bf16 dot products (Engine(dtype="bfloat16") on CPU, ``bf16_dot``).

`split_16bit(model, weights, ...)` decides whether the checkpoint qualifies (a dense model whose every
projection and embedding tensor is stored in one 16-bit type, on a CPU where the native panel GEMM
is the runner's linear) and, if so, takes those tensors out of the weights the model loads, handing
it placeholders (placeholder.py) instead: no fp32 copy of them is ever made, and anything that read
one as a weight would get NaN, never a stale number. `install_16bit` then packs each projection once
into 16-bit panels for the native GEMM (csrc/gemm_bf16.c, gemm_f16.c) and returns a `CpuLinear`
(native backend) over them, which finds them by the placeholder's storage address as it does for
the fp32 panels it packs itself.

The 16-bit kernels widen each weight exactly in registers and keep the fp32 kernel's multiply-add
order, so logits are bit for bit those of Engine(dtype="float32") on the same checkpoint, and the
batch-invariant mode holds as it does there. A tied embedding is looked up in the LM head's panels
(no second copy); an untied one stays a 16-bit [V, K] tensor. Resident weights are then about the
checkpoint's bytes (panels are zero-padded to 48 output columns) instead of 2x for fp32 panels.

With ``bf16_dot`` every projection (fp32, bf16 or fp16 as stored) is rounded to bf16 once at load
(`native.to_bf16_dot`; the fp32 tensors are dropped) into the same panels, and the GEMM is
csrc/gemm_bf16dot.c: x rounded to bf16 per call, bf16 x bf16 products summed in fp32 in a fixed order
(batch-invariant as above, but not the fp32 kernel's bits). A tied embedding then reads bf16-rounded rows.
"""

from __future__ import annotations

import torch

from deepinfer.engine import cpu
from deepinfer.engine.cpu_linear import CpuLinear, as_stored_bf16, native_gemm_preferred
from deepinfer.engine.placeholder import is_placeholder, placeholder
from deepinfer.errors import ModelLoadError

DTYPES = (torch.bfloat16, torch.float16)


def bf16_dot_available() -> bool:
    """Engine(dtype="bfloat16") on CPU runs the native bf16-dot GEMM here: the native kernels built at
    the avx512 level (its 8 x 48 tile needs 32 vector registers; csrc/gemm_bf16dot.c has no narrower
    tile, and bf16 products are fast only with AVX512_BF16: on AVX2 they ran 2-4x slower than fp32);
    vdpbf16ps itself is used where the CPU also has AVX512_BF16 (else the kernel's widening fallback)."""
    return native_gemm_preferred() and cpu.at_least("avx512")


def split_16bit(model, weights: dict[str, torch.Tensor], model_config, cpu_prepack: bool = True,
                bf16_dot: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None:
    """(weights with placeholders for the tensors kept in 16 bits, {HF name: 16-bit tensor}), or None
    when this checkpoint / machine does not qualify (the caller loads `weights` as they are, converted
    to the runner's dtype). `model` is built but not yet loaded. bf16_dot: every projection qualifies
    whatever its floating-point type, and is returned rounded to bf16 (`native.to_bf16_dot`)."""
    if not cpu_prepack or model_config.moe is not None or model_config.mla is not None:
        return None
    if not hasattr(model, "projection_sources") or not native_gemm_preferred():
        return None
    names = [n for _, ns in model.projection_sources() for n in ns]
    if bf16_dot:
        from deepinfer_kernels import native

        if not all(n in weights and weights[n].is_floating_point() for n in names):
            return None
        kept = {n: native.to_bf16_dot(weights[n]) for n in names}
        return {n: (placeholder(tuple(t.shape)) if n in kept else t) for n, t in weights.items()}, kept
    kinds = {weights[n].dtype if n in weights else None for n in names}
    if len(kinds) != 1 or next(iter(kinds)) not in DTYPES:
        return None  # fp32 (or mixed) projections: fp32 panels as before
    kept = {n: weights[n] for n in names}
    rest = {n: (placeholder(tuple(t.shape)) if n in kept else t) for n, t in weights.items()}
    return rest, kept


def install_16bit(model, kept: dict[str, torch.Tensor], invariant: bool = False, bf16_dot: bool = False) -> CpuLinear:
    """Pack every projection of the model (loaded with `split_16bit`'s placeholders) from `kept` into
    16-bit panels and return the native linear over them (keyed by the placeholders' addresses); the
    embedding lookups read the tied LM head's panels, or the untied 16-bit matrix. bf16_dot: the
    panels run the bf16-dot GEMM (`kept` from split_16bit(..., bf16_dot=True))."""
    from deepinfer_kernels import native

    linear = {w.data_ptr() for w in model.linear_weights()}
    gated = {w.data_ptr() for w in model.gated_weights()}
    packed, packed_gated = {}, {}
    embed_rows = None
    for param, names in model.projection_sources():
        ph = param.data
        if not is_placeholder(ph):
            raise ModelLoadError(f"{names[0]}: expected a 16-bit placeholder after loading")
        w16 = kept[names[0]] if len(names) == 1 else torch.cat([kept[n] for n in names], 0)
        key = ph.data_ptr()
        if key in gated:
            packed_gated[key] = native.pack_gated_weight(w16.contiguous(), bf16_dot=bf16_dot)
        elif key in linear:
            packed[key] = native.pack_weight(w16.contiguous(), bf16_dot=bf16_dot)
        if param is model.embed_tokens:
            if key in packed:  # tied: the LM head's panels serve the lookups too
                pw = packed[key]
                embed_rows = lambda ids, pw=pw: native.packed_rows(pw, ids)  # noqa: E731
            else:
                param.data = w16.contiguous()
                embed_rows = lambda ids, w=param.data: torch.nn.functional.embedding(ids, w).float()  # noqa: E731
        elif key not in packed and key not in packed_gated:
            raise ModelLoadError(f"{names[0]}: a projection the model does not run through its linear")
    left = [w.shape for w in model.linear_weights() + model.gated_weights()
            if w.data_ptr() not in packed and w.data_ptr() not in packed_gated]
    if left:
        raise ModelLoadError(f"no 16-bit panels for projections of shapes {left[:3]}")
    model.set_embedding_impl(embed_rows)
    return CpuLinear.from_native_panels(packed, packed_gated, invariant)

