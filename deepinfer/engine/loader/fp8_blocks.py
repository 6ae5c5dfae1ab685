"""FP8 block-quantised checkpoints (DeepSeek-V3's `quantization_config: {quant_method: fp8,
weight_block_size: [128, 128]}`): every quantised weight W (float8_e4m3fn) comes with
`W_scale_inv` holding one fp32 scale per 128 x 128 block (the last row / column of blocks may be
partial); the real weight is W * scale_inv of its block.

By default every such weight is dequantised to fp32 once at load. `keep_checkpoint` instead keeps the
e4m3 weights a predicate selects as `Fp8Weight`s (codes as stored, scales expanded to one per row and
column block), for the runner to multiply as they are (engine/fp8_linear.py): a quarter of fp32's bytes,
half of bf16's."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class Fp8Weight:
    """A block-FP8 weight kept as stored: `codes` [N, K] float8_e4m3fn and `scale` [N, ceil(K / block_k)]
    fp32, one scale per row and column block (the checkpoint's row blocks expanded, so projections fused
    by row concatenation need no block alignment). Its value is codes * scale of the column's block."""

    codes: torch.Tensor
    scale: torch.Tensor
    block_k: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.codes.dtype

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scale.numel() * self.scale.element_size()

    def to(self, device) -> "Fp8Weight":
        return Fp8Weight(self.codes.to(device), self.scale.to(device), self.block_k)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in dtype: codes times scales in fp32 (dequantize_block's values), rounded once to dtype:
        the FP8 kernels' definition (deepinfer_kernels.fp8_gemm.dequantize)."""
        from deepinfer_kernels import fp8_gemm

        return fp8_gemm.dequantize(self.codes, self.scale, self.block_k, dtype)

    @staticmethod
    def from_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str = "weight") -> "Fp8Weight":
        """From a checkpoint's e4m3 weight and its [ceil(N / br), ceil(K / bc)] block scales."""
        if w.dtype != torch.float8_e4m3fn:
            raise ModelLoadError(f"{name}: only float8_e4m3fn weights are kept as FP8, got {w.dtype}")
        if w.dim() != 2 or scale_inv.dim() != 2:
            raise ModelLoadError(f"{name}: block FP8 needs a 2-D weight and scale, got {tuple(w.shape)} and {tuple(scale_inv.shape)}")
        br, bc = block
        want = (-(-w.shape[0] // br), -(-w.shape[1] // bc))
        if tuple(scale_inv.shape) != want:
            raise ModelLoadError(f"{name}{SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}; {tuple(w.shape)} in "
                                 f"{br} x {bc} blocks needs {want}")
        rows = scale_inv.float().repeat_interleave(br, 0)[: w.shape[0]].contiguous()
        return Fp8Weight(w.contiguous(), rows, bc)

    @staticmethod
    def cat_rows(parts: list["Fp8Weight"], name: str) -> "Fp8Weight":
        """The row concatenation (a fused projection); its parts must share K and the column block."""
        if len({(p.shape[1], p.block_k) for p in parts}) != 1:
            raise ModelLoadError(f"{name}: its FP8 parts differ in columns or column block: "
                                 f"{[(p.shape, p.block_k) for p in parts]}")
        return Fp8Weight(torch.cat([p.codes for p in parts], 0), torch.cat([p.scale for p in parts], 0), parts[0].block_k)


def keep_checkpoint(tensors: dict[str, torch.Tensor], block: tuple[int, int], keep) -> dict:
    """dequantize_checkpoint, except that an e4m3 weight `keep(name)` selects becomes an Fp8Weight (its
    scales no longer a separate entry); the others are dequantised as there."""
    kept = {n: Fp8Weight.from_blocks(t, tensors[n + SCALE_SUFFIX], block, n) for n, t in tensors.items()
            if t.dtype == torch.float8_e4m3fn and n + SCALE_SUFFIX in tensors and keep(n)}
    rest = dequantize_checkpoint({n: t for n, t in tensors.items()
                                  if n not in kept and n.removesuffix(SCALE_SUFFIX) not in kept}, block)
    rest.update(kept)
    return rest
