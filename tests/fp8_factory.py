"""Block-FP8 checkpoints for tests: a model directory's projections quantised as DeepSeek ships them
(float8_e4m3fn weights + `_scale_inv` per block), and the same directory with those weights dequantised."""

from __future__ import annotations

import json
import pathlib
import shutil

import torch


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference block quantisation: scale = amax / 448 per block (partial edge blocks included),
    q = fp8(w / scale)."""
    br, bc = block
    rows, cols = w.shape
    R, C = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(R * br, C * bc, dtype=torch.float32)
    padded[:rows, :cols] = w
    tiles = padded.view(R, br, C, bc)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (tiles / scale[:, None, :, None]).view(R * br, C * bc)[:rows, :cols].to(torch.float8_e4m3fn)
    return q, scale


def dequantize_loop(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Element by element: q[r, c] * scale[r // br, c // bc]."""
    br, bc = block
    out = torch.empty(q.shape)
    for r in range(q.shape[0]):
        for c in range(q.shape[1]):
            out[r, c] = q[r, c].float() * scale[r // br, c // bc]
    return out


def fp8_checkpoint(src: pathlib.Path, dst: pathlib.Path, block: tuple[int, int] = (16, 16), reference: bool = False
                   ) -> dict[str, tuple[int, int]]:
    """Write `src` (a model directory) to `dst` with every 2-D `*proj*` tensor block-FP8 (as DeepSeek
    ships: projections yes; embeddings, norms, routers no) and config.json's quantization_config;
    returns {quantised name: shape}. reference: write the dequantised values instead (element by
    element, dequantize_loop) and no quantization_config: the checkpoint the FP8 one stands for."""
    from safetensors.torch import load_file, save_file

    w = load_file(str(src / "model.safetensors"))
    out, shapes = {}, {}
    for name, t in w.items():
        if t.dim() == 2 and "proj" in name:
            q, s = quantize(t.float(), block)
            if reference:
                out[name] = dequantize_loop(q, s, block)
            else:
                out[name], out[name + "_scale_inv"] = q, s
            shapes[name] = tuple(t.shape)
        else:
            out[name] = t
    shutil.copytree(src, dst)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if not reference:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block), "fmt": "e4m3"}
        (dst / "config.json").write_text(json.dumps(cfg))
    return shapes


def make_fp8_pair(src: pathlib.Path, root: pathlib.Path, block: tuple[int, int] = (16, 16)
                  ) -> tuple[pathlib.Path, pathlib.Path, dict[str, tuple[int, int]]]:
    """(fp8 dir, dequantised reference dir, {quantised name: shape}) of the fp32 model directory `src`
    (fp8_checkpoint both ways), in small blocks so tiny weights span several, partial ones included."""
    shapes = fp8_checkpoint(src, root / "fp8", block)
    fp8_checkpoint(src, root / "ref", block, reference=True)
    return root / "fp8", root / "ref", shapes
