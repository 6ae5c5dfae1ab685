"""Loading an HF model directory: config.json, model.safetensors (single or sharded), tokenizer files."""

from __future__ import annotations

from pathlib import Path, PurePosixPath, PureWindowsPath

import torch

from deepinfer.engine.json_file import read_json_object
from deepinfer.engine.loader import fp8_blocks
from deepinfer.engine.model_config import ModelConfig
from deepinfer.engine.tokenizer import Tokenizer
from deepinfer.errors import ModelLoadError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_config(model_dir: Path) -> ModelConfig:
    """ModelConfig of an HF directory's config.json."""
    cfg = read_json_object(model_dir / "config.json", "config.json")
    try:
        return ModelConfig.from_hf_config(cfg)
    except ModelLoadError as e:
        raise type(e)(f"{model_dir / 'config.json'}: {e}") from e


def _load_safetensors(path: Path, keep=None, skipped: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The file's tensors; with `keep(name)`, only those it keeps (the others are named in `skipped`
    and never read: an expert-parallel rank reads its own experts only)."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    if not path.is_file():
        raise ModelLoadError(f"missing weights file {path}")
    try:
        if keep is None:
            return load_file(str(path))
        out = {}
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if keep(name.removesuffix(fp8_blocks.SCALE_SUFFIX) if name.endswith(fp8_blocks.SCALE_SUFFIX) else name):
                    out[name] = f.get_tensor(name)
                elif skipped is not None:
                    skipped.add(name)
        return out
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:  # truncated or garbled file
        raise ModelLoadError(f"corrupt or unreadable safetensors file {path}: {e}") from e


def _confined_shard(index: Path, shard: str) -> PurePosixPath:
    """A shard name from the index as a path inside the model directory, or ModelLoadError.

    Checked lexically: no absolute path, no '..', no backslash or NUL, so an index cannot make
    the loader open a file outside the directory. Symlinks inside the directory are still followed:
    the Hugging Face cache links snapshot files to blobs elsewhere, and the directory is trusted.
    """
    p = PurePosixPath(shard)
    if (not shard or "\\" in shard or "\0" in shard or p.is_absolute() or ".." in p.parts
            or PureWindowsPath(shard).drive):
        raise ModelLoadError(f"{index}: shard path {shard!r} is not a file inside the model directory")
    return p


def read_weights(model_dir: Path, keep=None, skipped: set[str] | None = None, keep_16bit: bool = False,
                 keep_fp8=None) -> dict[str, torch.Tensor]:
    """All tensors of the directory's safetensors checkpoint (those `keep(name)` keeps, when given;
    the rest named in `skipped`), converted to fp32; with `keep_16bit`, bf16 and fp16 tensors stay as
    stored (the model's weight loading converts what it does not keep in 16 bits: weights16.py).
    keep_fp8(name): a block-FP8 checkpoint's weights it selects stay FP8, as fp8_blocks.Fp8Weight
    (the others are dequantised)."""
    single, index = model_dir / SINGLE_FILE, model_dir / INDEX_FILE
    if single.is_file():
        tensors = _load_safetensors(single, keep, skipped)
    elif index.is_file():
        weight_map = read_json_object(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index} has no 'weight_map'")
        tensors = {}
        bad = [v for v in weight_map.values() if not isinstance(v, str)]
        if bad:
            raise ModelLoadError(f"{index}: shard names must be strings, got {bad[0]!r}")
        for shard in sorted(set(weight_map.values())):
            tensors.update(_load_safetensors(model_dir / _confined_shard(index, shard), keep, skipped))
        absent = sorted(n for n in weight_map if n not in tensors and not (skipped and n in skipped))
        if absent:
            raise ModelLoadError(f"{index} lists tensors its shards lack: {absent[:5]}")
    else:
        raise ModelLoadError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir} (only safetensors checkpoints load)")
    if any(n.endswith(fp8_blocks.SCALE_SUFFIX) for n in tensors):  # block-FP8 (DeepSeek): dequantise, or keep
        cfg = read_json_object(model_dir / "config.json", "config.json")
        block = fp8_blocks.block_size_of(cfg)
        tensors = (fp8_blocks.keep_checkpoint(tensors, block, keep_fp8) if keep_fp8 is not None
                   else fp8_blocks.dequantize_checkpoint(tensors, block))
    for name, t in tensors.items():
        if isinstance(t, fp8_blocks.Fp8Weight):
            continue
        if not t.is_floating_point():
            raise ModelLoadError(f"{model_dir}: tensor {name} has dtype {t.dtype}; quantised HF checkpoints are not supported")
        if t.dtype != torch.float32 and not (keep_16bit and t.dtype in (torch.bfloat16, torch.float16)):
            tensors[name] = t.float()  # compute is fp32 on CPU: bf16 matmul is far slower there
    return tensors


def load_hf_dir(model_dir: Path, tensor_filter=None, skipped: set[str] | None = None, keep_16bit: bool = False,
                keep_fp8=None) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """(config, fp32 weights, tokenizer) of an HF model directory; weights are not yet checked.
    tensor_filter(config) -> keep(name): read only the tensors it keeps (the rest go to `skipped`).
    keep_16bit: bf16 / fp16 tensors stay as stored; keep_fp8(name): FP8 weights it selects stay FP8
    (see read_weights)."""
    config = read_config(model_dir)
    weights = read_weights(model_dir, tensor_filter(config) if tensor_filter else None, skipped, keep_16bit, keep_fp8)
    tokenizer = Tokenizer.from_dir(model_dir)
    return config, weights, tokenizer
