"""Which precision an engine computes in, and how it holds the checkpoint's weights, on this device.

Decided twice around loading: `request` (before: what to ask the loader to keep as stored, from
EngineConfig.dtype and the device) and `settle` (after: what the checkpoint and machine allow, with a
warning where a dtype="bfloat16" request falls back to torch's bf16 ops). The ModelRunner then builds
the kernels the settled Precision names.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from deepinfer.engine import cpu
from deepinfer.engine.config import EngineConfig
from deepinfer.errors import InvalidRequestError


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidRequestError("device='cuda' requested but CUDA is not available")
    return torch.device(name)


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """The runner's compute dtype (activations; the KV cache's unless EngineConfig.kv_cache_dtype says
    otherwise: ModelRunner.kv_cache_dtype).

    "auto" on CPU computes in fp32 (the native GEMM, attention and norms are fp32); what it stores the
    weights in depends on the checkpoint: a GGUF's blocks as stored (`quant_mode`), a bf16 / fp16
    model directory's projections in 16-bit panels (weights16.py: the fp32 kernel's bits, half its
    bytes), anything else fp32. Measured on the 2-core AVX-512 Zen 5 host, SmolLM2-135M saved as bf16
    (benchmarks/weights16.py, 32 new tokens, medians of 3-4, arms alternating in one process): auto
    (bf16 panels) / float32 = 1.72x tokens/s at batch 1, 1.47x at 8, 1.08-1.11x at 32, 0.94-1.07x at
    128 over two runs (there the layers' GEMMs are compute-bound: 0.97-1.01x per call), with
    resident weights 1.02x the checkpoint's bytes instead of 4.0x.

    "bfloat16" on CPU, where the native bf16-dot GEMM runs (weights16.bf16_dot_available: native
    kernels, AVX-512F), computes activations, norms and attention in fp32 (the KV cache bf16 under
    kv_cache_dtype "auto") and every projection as bf16 dot products accumulated in fp32
    (csrc/gemm_bf16dot.c, weights rounded to bf16 at load): SmolLM2-135M as an fp32 directory on that host (benchmarks/throughput.py --model, 64 new
    tokens, best of 3) 1.44x / 1.61x / 1.48x / 1.71x float32's tokens/s at batch 1 / 8 / 32 / 128,
    greedy answers equal on 6/8 prompts x 32 tokens, logprobs within 0.061 (benchmarks/bf16_dot.py
    --accuracy); auto does not pick it. An MoE model runs the same arithmetic through the grouped expert
    kernel's bf16-dot build (ModelRunner.moe_bf16_dot). Elsewhere (dense MLA models, expert parallelism,
    no packing; see settle) it is torch's bf16 ops, which ran 0.62-0.83x float32 on that host."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name == "bfloat16" and device.type == "cpu" and native_kernels():
        # fp32 activations between ops, the projections' products in bf16: a GGUF's blocks in the quant
        # mode "bf16" (quant_mode), other checkpoints as bf16 dot products (settle, weights16.py)
        return torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name in QUANT_DTYPES:
        if device.type != "cpu":
            raise InvalidRequestError(f"dtype={name!r} runs on CPU only")
        return torch.float32  # activations and accumulation stay fp32 (the KV cache: kv_cache_dtype)
    if name not in table:
        raise InvalidRequestError(f"dtype must be auto, float32, bfloat16, float16, quantized or quantized_exact, got {name!r}")
    return table[name]


# GGUF block-quantised weights kept as stored (quant_linear.py): int8 dot products, or exact fp32 dequant
QUANT_DTYPES = {"quantized": "int8", "quantized_exact": "exact"}


def quant_mode(name: str, device: torch.device) -> str | None:
    """The kernel mode for quantised weights this dtype asks for, or None (no block weights kept).

    "auto" on CPU keeps a GGUF checkpoint's block-quantised weights as stored and runs the exact mode
    (dequantised in registers against fp32 activations; a checkpoint without such tensors, or a model
    directory, runs fp32 as before). Measured side by side on this 2-core AVX2 host
    (benchmarks/throughput.py, SmolLM2 Q4_1, 64 new tokens, best of 2-4, nothing else running):
    quantized_exact / fp32 = 4.99x at batch 1, 2.07x at 8, 1.25x at 32, 1.16x at 128 (an A/B of the
    engine before and after, alternating processes, medians of 4: 5.17x, 1.19x, 0.98x), with resident
    weights 1.02x the file instead of 11x; greedy answers equal to fp32 on 8/8 prompts, logprobs
    within 6e-5. On the 2-core AVX-512 Zen 5 host (the same benchmark, best of 2, quiet window), with
    the AVX-512 outer-product and row kernels: 4.16x at batch 1, 1.28x at 8, 0.87x at 32, 0.94x at 128
    (224.8 / 454.7 / 602.1 / 754.6 tok/s; with the AVX2-only kernels there 3.32x, -, 0.55x, 0.58x, fp32
    then at 52 tok/s at batch 8), prompt logprobs equal to fp32's there (gemm.c has the outer kernel's
    order). The int8 mode ("quantized": 1.4x quantized_exact at batch 1 on the AVX2 host, 1.37x on the
    AVX-512 one, 6/8 greedy answers equal; from 16 rows, where the CPU has AVX512_VNNI, the int8 outer-
    product kernel: 1396-1514 tok/s at batch 128 on the Zen 5 host vs bf16 products' 1282-1369, prompt logprobs
    within 0.97 of quantized_exact's) stays an explicit choice. Without the native kernels (no C
    compiler) auto stays fp32.

    "bfloat16" on CPU keeps the blocks too, in the mode "bf16" (quant_linear.py: the exact row kernels
    for few rows, bf16 products with fp32 accumulation from BF16_M rows) where the CPU level has
    AVX512_BF16, else in the exact mode; a checkpoint without block tensors is left to the dense path."""
    if name in ("auto", "bfloat16"):
        if device.type != "cpu" or not native_kernels():
            return None
        # bf16 products need AVX512_BF16 at the level in force (deepinfer_kernels.cpu): without it the bf16
        # kernel would run the exact one anyway, so the engine says so ("quantized-exact")
        return "bf16" if name == "bfloat16" and cpu.has("avx512_bf16") else "exact"
    return QUANT_DTYPES.get(name)


def native_kernels() -> bool:
    """Whether the native CPU kernels built (deepinfer_kernels: a C compiler was found)."""
    from deepinfer_kernels import quant

    return quant.available()


def checkpoint_bytes(source: str) -> int:
    """Bytes of the checkpoint's weight files (a .gguf file, or a directory's safetensors/bin files)."""
    p = Path(source)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.glob("*") if f.suffix in (".safetensors", ".bin")) if p.is_dir() else 0


@dataclass(frozen=True)
class Precision:
    dtype: torch.dtype  # the runner's compute dtype (activations; the KV cache's by default)
    quant_mode: str | None  # a GGUF's blocks kept as stored, in this kernel mode (quant_linear.py)
    keep_16bit: bool  # a bf16 / fp16 checkpoint's tensors kept as stored (weights16.py, expert panels)
    bf16_dot: bool  # projections as bf16 dot products with fp32 accumulation (dtype="bfloat16" on CPU)
    keep_fp8: bool = False  # a block-FP8 checkpoint's projections kept as stored (fp8_linear.py)


def request(cfg: EngineConfig, device: torch.device) -> Precision:
    """Before loading: the compute dtype and what the loader should keep as stored. Auto on CPU: a bf16 /
    fp16 model directory's tensors stay 16-bit (weights16.py); bfloat16 with fp32 activations
    (compute_dtype): the projections as bf16 dot products."""
    dtype = compute_dtype(cfg.dtype, device)
    bf16_dot = cfg.dtype == "bfloat16" and device.type == "cpu" and dtype == torch.float32
    keep_16bit = (cfg.dtype == "auto" or bf16_dot) and device.type == "cpu" and cfg.expert_parallel_size == 1
    return Precision(dtype, quant_mode(cfg.dtype, device), keep_16bit, bf16_dot, keep_fp8(cfg, device, dtype))


def keep_fp8(cfg: EngineConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a block-FP8 checkpoint's projections stay FP8 (EngineConfig.fp8_weights): "keep" always;
    "auto" where the FP8 kernel runs them (CUDA, bf16 / fp16 activations, TileLang: fp8_linear.py);
    elsewhere they are dequantised at load. Not with expert parallelism (its workers dequantise)."""
    if cfg.fp8_weights == "dequantize":
        return False
    if cfg.expert_parallel_size > 1:
        if cfg.fp8_weights == "keep":
            raise InvalidRequestError("fp8_weights='keep' is not supported with expert_parallel_size > 1 "
                                      "(the workers dequantise FP8 checkpoints at load)")
        return False
    if cfg.fp8_weights == "keep":
        return True
    from deepinfer.engine.fp8_linear import kernel_runs

    return kernel_runs(device, dtype, cfg.kernels)


def settle(p: Precision, cfg: EngineConfig, loaded) -> Precision:
    """After loading (`loaded`: the loader's LoadedModel): what this checkpoint and machine allow."""
    from deepinfer.engine.expert_kernels import native_experts_available
    from deepinfer.engine.weights16 import bf16_dot_available

    if cfg.dtype in QUANT_DTYPES and not loaded.quantized:
        raise InvalidRequestError(f"dtype={cfg.dtype!r} needs a GGUF checkpoint with Q4_0/Q4_1/Q8_0/Q4_K/Q6_K tensors; "
                                  f"{loaded.source} has none")
    if p.bf16_dot and p.keep_fp8:
        from deepinfer.engine.loader.fp8_blocks import Fp8Weight

        if any(isinstance(t, Fp8Weight) for t in loaded.weights.values()):
            raise InvalidRequestError("dtype='bfloat16' on CPU (bf16 dot products on packed panels) does not combine "
                                      "with fp8_weights='keep'; use fp8_weights='auto' (dequantised at load, then "
                                      "bf16 dot products) or dtype='float32'")
    if not p.bf16_dot:
        return p
    if loaded.quantized and p.quant_mode:
        return replace(p, bf16_dot=False, keep_16bit=False)  # a GGUF's blocks kept as stored: quant_linear.py's kernels
    mc = loaded.config
    if (cfg.expert_parallel_size > 1 or not cfg.cpu_prepack or not bf16_dot_available()
            or (mc.moe is None and mc.mla is not None)
            or (mc.moe is not None and (cfg.kernels != "auto" or not native_experts_available()))):
        warnings.warn("dtype='bfloat16' on CPU: the native bf16-dot projections need cpu_prepack=True and an "
                      "AVX-512 CPU (MoE models also kernels='auto' and no expert parallelism; not dense MLA models); "
                      "this model runs torch's bf16 ops instead", RuntimeWarning, stacklevel=3)
        return replace(p, dtype=torch.bfloat16, bf16_dot=False, keep_16bit=False)
    return p
