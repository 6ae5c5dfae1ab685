"""GGUF tensors in the block formats the native kernels read (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), kept as stored.

`quantized_weights(path, config)` returns HF name -> QuantWeight (the file's bytes, copied out of the
mapping once; llama files' q/k rows unpermuted, which moves whole rows of blocks). Tensors in other
formats are left out: the engine keeps those as fp32.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from deepinfer.engine.loader.gguf_meta import open_gguf
from deepinfer.engine.loader.gguf_model import hf_name, unpermute_rows
from deepinfer.engine.model_config import ModelConfig
from deepinfer_kernels import quant


def tensor_types(path: str | os.PathLike) -> dict[str, str]:
    """GGUF tensor name -> its storage type's name (F32, Q4_1, Q8_0, ...)."""
    return {t.name: t.tensor_type.name for t in open_gguf(path).tensors}


def quantized_weights(path: str | os.PathLike, config: ModelConfig) -> dict[str, quant.QuantWeight]:
    reader = open_gguf(path)
    unpermute = config.architecture == "LlamaForCausalLM"
    out: dict[str, quant.QuantWeight] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        fmt = int(t.tensor_type)
        if name is None or fmt not in quant.FORMATS or len(t.shape) != 2:
            continue
        k = int(t.shape[0])  # GGUF shapes are (cols, rows)
        data = torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True)).reshape(int(t.shape[1]), -1)
        if unpermute and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            data = unpermute_rows(data, heads)
        out[name] = quant.QuantWeight(data.contiguous(), fmt, data.shape[0], k)
    return out
