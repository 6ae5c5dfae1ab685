"""Stand-ins for weights the engine keeps in another form (a GGUF's blocks as stored, quant_linear.py).

A placeholder is one NaN expanded to the weight's shape: 4 bytes whatever the shape, and anything that
reads it as a weight gets NaN, never a silent wrong number. The loader hands them out for the tensors it
keeps quantised (so no fp32 copy of those is ever made), the model's weight loading passes them through
(fused projections: the placeholder of the concatenation), and `install_quantized` replaces every one
by its blocks.
"""

from __future__ import annotations

import torch

from deepinfer.errors import ModelLoadError


def placeholder(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.full((1,) * len(shape), float("nan")).expand(*shape)


def is_placeholder(t: torch.Tensor) -> bool:
    return (t.dim() > 0 and t.numel() > 1 and all(s == 0 for s in t.stride())
            and bool(torch.isnan(t.reshape(-1)[0])))


def cat_rows(parts: list, name: str):
    """torch.cat(parts) along rows; the placeholder of the result when every part is one, the FP8
    concatenation when every part is a kept FP8 weight (loader/fp8_blocks.Fp8Weight)."""
    from deepinfer.engine.loader.fp8_blocks import Fp8Weight

    fp8 = [isinstance(p, Fp8Weight) for p in parts]
    if all(fp8):
        return Fp8Weight.cat_rows(parts, name)
    if any(fp8):
        raise ModelLoadError(f"{name}: some parts are kept as FP8 and some are not")
    marks = [is_placeholder(p) for p in parts]
    if all(marks):
        return placeholder((sum(p.shape[0] for p in parts), *parts[0].shape[1:]))
    if any(marks):  # the loader keeps a fused projection's parts all quantised or none
        raise ModelLoadError(f"{name}: some parts are kept quantised and some are not")
    return torch.cat(parts, 0)
