"""An on-disk cache of converted checkpoints (GGUF -> fp32 safetensors + config.json + tokenizer files).

Each source file gets its own directory, named after the file, its size and a hash of its path,
mtime and the converter version, so an edited file or a changed converter never reads a stale copy.
A cache directory is built under a temporary name and renamed into place, so it either exists
complete or not at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from deepinfer.engine.model_config import ModelConfig
from deepinfer.engine.tokenizer import Tokenizer

# Bump when the conversion changes so old caches are ignored.
CONVERTER_VERSION = 1

_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def cache_root(cache_dir: str | os.PathLike | None) -> Path:
    """`cache_dir`, else `$DEEPINFER_CACHE_DIR`, else `~/.cache/deepinfer/models`."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("DEEPINFER_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "deepinfer" / "models"


def cache_entry(source: Path, cache_dir: str | os.PathLike | None) -> Path:
    """The cache directory for `source`: `<root>/<name>-<size>-<hash of path, mtime, converter version>`."""
    st = source.stat()
    key = f"{source.resolve()}|{st.st_mtime_ns}|{CONVERTER_VERSION}".encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    return cache_root(cache_dir) / f"{source.stem}-{st.st_size}-{digest}"


def config_to_hf_dict(config: ModelConfig) -> dict[str, Any]:
    """An HF-style config.json dict that `ModelConfig.from_hf_config` (and transformers) read back."""
    d = asdict(config)
    arch = d.pop("architecture")
    d.pop("qk_norm")  # implied by the architecture
    eos = d.pop("eos_token_ids")
    return {"architectures": [arch], "model_type": _MODEL_TYPES.get(arch, arch), **d, "eos_token_id": eos}


def write_entry(entry: Path, config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Tokenizer) -> None:
    """Write a complete cache directory at `entry` atomically; a concurrent writer's copy wins ties."""
    from safetensors.torch import save_file

    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=entry.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; a model cache is ordinary readable data
        (tmp / "config.json").write_text(json.dumps(config_to_hf_dict(config), indent=2), encoding="utf-8")
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"))
        tokenizer.save(tmp)
        try:
            os.rename(tmp, entry)
        except OSError:
            if not entry.is_dir():  # not a lost race with another writer: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
