"""FP8 block-quantised checkpoints (DeepSeek-V3's `quantization_config: {quant_method: fp8,
weight_block_size: [128, 128]}`): every quantised weight W (float8_e4m3fn) comes with
`W_scale_inv` holding one fp32 scale per 128 x 128 block (the last row / column of blocks may be
partial); the real weight is W * scale_inv of its block. Dequantised to fp32 once at load, on CPU."""

from __future__ import annotations

import torch

from deepinfer.errors import ModelLoadError

SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)


def block_size_of(config: dict) -> tuple[int, int]:
    """The (rows, cols) block of config.json's quantization_config (128 x 128 when it says none)."""
    q = config.get("quantization_config") or {}
    method = q.get("quant_method", "fp8")
    if method != "fp8":
        raise ModelLoadError(f"quantization_config.quant_method {method!r} is not supported (only block 'fp8')")
    bs = q.get("weight_block_size") or DEFAULT_BLOCK
    if not (isinstance(bs, (list, tuple)) and len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs)):
        raise ModelLoadError(f"quantization_config.weight_block_size must be two positive ints, got {bs!r}")
    return int(bs[0]), int(bs[1])


def dequantize_block(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str = "weight") -> torch.Tensor:
    """fp32 W * scale_inv, one scale per (block[0] x block[1]) tile of the 2-D weight."""
    if w.dim() != 2 or scale_inv.dim() != 2:
        raise ModelLoadError(f"{name}: block FP8 needs a 2-D weight and scale, got {tuple(w.shape)} and {tuple(scale_inv.shape)}")
    br, bc = block
    rows, cols = w.shape
    want = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != want:
        raise ModelLoadError(f"{name}{SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}; {tuple(w.shape)} in "
                             f"{br} x {bc} blocks needs {want}")
    s = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return w.float() * s


def dequantize_checkpoint(tensors: dict[str, torch.Tensor], block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The tensors with every `X` that has an `X_scale_inv` dequantised (the scales dropped); an FP8
    tensor without a scale, or a scale without its tensor, is a ModelLoadError."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            if name[: -len(SCALE_SUFFIX)] not in tensors:
                raise ModelLoadError(f"checkpoint has {name} but no {name[: -len(SCALE_SUFFIX)]}")
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        if scale is not None:
            out[name] = dequantize_block(t, scale, block, name)
        elif t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ModelLoadError(f"checkpoint tensor {name} is FP8 but has no {name}{SCALE_SUFFIX}")
        else:
            out[name] = t
    return out
