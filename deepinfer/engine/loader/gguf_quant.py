"""GGUF tensors in the block formats the native kernels read (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), kept as stored.

`quantized_weights(path, config)` returns HF name -> QuantWeight (the file's bytes, copied out of the
mapping once; llama files' q/k rows unpermuted, which moves whole rows of blocks). Tensors in other
formats are left out: the engine keeps those as fp32. `installable` picks the tensors the engine can
keep as stored (a fused projection's parts all in one format), which the loader then never
dequantises (`load_model(keep_quantized=True)`: no fp32 copy of them at any moment).
"""

from __future__ import annotations

import os

import torch

from deepinfer.engine.loader.gguf_meta import open_gguf
from deepinfer.engine.loader.gguf_model import hf_name, unpermute_rows
from deepinfer.engine.model_config import ModelConfig
from deepinfer.errors import ModelLoadError
from deepinfer_kernels import quant


def tensor_types(path: str | os.PathLike) -> dict[str, str]:
    """GGUF tensor name -> its storage type's name (F32, Q4_1, Q8_0, ...)."""
    return {t.name: t.tensor_type.name for t in open_gguf(path).tensors}


# the decoder's fused projections (models/layers.py): their parts run as one matrix, so all or none stay quantised
_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def installable(quantized: dict[str, quant.QuantWeight]) -> dict[str, quant.QuantWeight]:
    """The entries whose fused group (q|k|v, gate|up) is entirely present in one format and width."""
    out = {}
    for name, qw in quantized.items():
        group = [name]
        for parts in _FUSED:
            for part in parts:
                if name.endswith(f".{part}.weight"):
                    stem = name[: -len(f"{part}.weight")]
                    group = [f"{stem}{p}.weight" for p in parts]
        peers = [quantized.get(g) for g in group]
        if all(q is not None and (q.fmt, q.k) == (qw.fmt, qw.k) for q in peers):
            out[name] = qw
    return out


def quantized_weights(path: str | os.PathLike, config: ModelConfig, reader=None) -> dict[str, quant.QuantWeight]:
    """reader: the file's GGUFReader when the caller has one (a second one costs ~140 MB of Python
    objects for SmolLM2's vocabulary). Blocks are read from the file into their own buffers (pread),
    not through the reader's memory map, so no mapped page of the file stays resident."""
    reader = reader if reader is not None else open_gguf(path)
    unpermute = config.architecture == "LlamaForCausalLM"
    out: dict[str, quant.QuantWeight] = {}
    fd = os.open(path, os.O_RDONLY)
    try:
        for t in reader.tensors:
            name = hf_name(t.name)
            fmt = int(t.tensor_type)
            if name is None or fmt not in quant.FORMATS or len(t.shape) != 2:
                continue
            k, rows = int(t.shape[0]), int(t.shape[1])  # GGUF shapes are (cols, rows)
            data = torch.empty(int(t.n_bytes), dtype=torch.uint8)
            if os.preadv(fd, [data.numpy()], int(t.data_offset)) != t.n_bytes:
                raise ModelLoadError(f"GGUF tensor {t.name!r}: the file ends inside its data")
            data = data.view(rows, -1)
            if unpermute and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
                data = unpermute_rows(data, heads)
            out[name] = quant.QuantWeight(data.contiguous(), fmt, rows, k)
    finally:
        os.close(fd)
    return out
