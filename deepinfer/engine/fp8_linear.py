"""The projection op on block-FP8 weights kept as a checkpoint stores them (DeepSeek-V3's
`quantization_config: {quant_method: fp8}`; EngineConfig.fp8_weights).

The loader keeps the e4m3 weights `kept_projection` selects as loader/fp8_blocks.Fp8Weight (codes as
stored plus fp32 scales, one per row and 128-column block); the model's weight loading moves each to
the device into `model.fp8_weights`, keyed by the address of the placeholder (placeholder.py) its
parameter holds instead, and `Fp8Linear` finds it by that address, like CpuLinear and QuantLinear
find their packed copies. Every other weight goes through the runner's linear as before.

What is kept: the projections that run through the linear (attention's q / k / v / o and DeepSeek's
q_a / q_b / kv_a, every gate / up / down of the dense MLPs, the shared and the routed experts, the MTP
layers' eh_proj). Latent attention's kv_b is dequantised at load: it is split per head into the
absorbed up-projections, which run as batched GEMMs (models/mla.py). Embeddings, norms and routers are
not FP8 in DeepSeek's checkpoints.

A kept weight's product is the kernels/fp8_gemm.py definition: every weight value codes * scale in
fp32, rounded to the activations' dtype, then the GEMM with fp32 accumulation. The rounded weights are
the ones the load-time dequantisation gives, so only the GEMM's summation order differs from running
the dequantised checkpoint. It runs:
- on CUDA with bf16 / fp16 activations and TileLang: the W8A16 TileLang kernel (weights decoded in
  shared memory; HBM reads a byte per weight instead of bf16's two) for fewer than KERNEL_MAX_ROWS rows,
  as at decode; from there the weight dequantised for the call, then the runner's linear (cuBLAS is
  faster than the kernel there, dequantisation included: measured figures at KERNEL_MAX_ROWS);
- elsewhere (fp32 activations, no TileLang, kernels="torch", the batch-invariant mode): the weight
  dequantised for the call, then the runner's own linear (F.linear, or the invariant tiled GEMM) on it.
  That trades time for the kept bytes; it is what Engine(fp8_weights="keep") runs on CPU.
"""

from __future__ import annotations

import re
import warnings

import torch

from deepinfer.engine.loader.fp8_blocks import Fp8Weight
from deepinfer.engine.placeholder import is_placeholder
from deepinfer.errors import ModelLoadError

# checkpoint names of the FP8 weights kept as FP8 (the module docstring says which and why)
_KEPT = re.compile(r"\.(q|k|v|o|q_a|q_b|gate|up|down|eh)_proj\.weight$|\.kv_a_proj_with_mqa\.weight$")


def kept_projection(name: str) -> bool:
    """Whether the checkpoint tensor `name`, when block-FP8, stays FP8 (the loader's keep_fp8 predicate)."""
    return _KEPT.search(name) is not None


def kernel_runs(device: torch.device, dtype: torch.dtype, kernels: str, cpu_twin: bool = False) -> bool:
    """Whether the TileLang FP8 kernels serve this device and activation dtype: CUDA, bf16 / fp16 (their
    T.gemm on fp32 operands would be TF32), TileLang importable, kernels not "torch". cpu_twin: also
    their CPU twins, at fp32 when asked for by name (kernels="tilelang": tests; slow), which is what the
    installers run there; "auto" does not keep FP8 for them (precision.keep_fp8)."""
    from deepinfer_kernels import _tilelang

    if cpu_twin and device.type == "cpu" and dtype == torch.float32 and kernels == "tilelang":
        return True  # (TileLang missing: the install fails, and kernels="tilelang" raises)
    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and kernels != "torch"
            and _tilelang.available())


# From this many rows (a prefill chunk, a large batch) a kept weight is dequantised for the call and run
# through `base` (cuBLAS on CUDA) instead of the W8A16 kernel. Measured on an H200 (benchmarks/kernels.py
# fp8 rows, DeepSeek-V3's 7168 x 2048 and 4096 x 7168): the kernel 0.07-0.09 ms at 1-16 rows against
# 0.14-0.25 ms for dequantise + cuBLAS, even at 256 rows (0.15 / 0.30 against 0.14 / 0.26 ms), and from
# there the kernel falls behind (1024 rows: 0.48 / 1.08 against 0.18 / 0.31 ms).
KERNEL_MAX_ROWS = 256


class Fp8Linear:
    """linear(x, w, b) for the runner: kept FP8 weights (found by their placeholder's address) through the
    FP8 GEMM below KERNEL_MAX_ROWS rows (else dequantised for the call), any other weight through `base`,
    the linear the runner chose for the rest."""

    def __init__(self, table: dict[int, Fp8Weight], base, use_kernel: bool):
        from deepinfer_kernels import fp8_gemm

        self.table = table
        self.base = base
        self.use_kernel = use_kernel
        self._gemm = fp8_gemm.fp8_gemm_tilelang  # (bound once: not an import on every call)
        self.silu_mul = None  # gated MLPs run linear, then silu * mul

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.table.values())

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        f = self.table.get(w.data_ptr())
        if f is None:
            return self.base(x, w, b)
        if self.use_kernel and x.numel() < KERNEL_MAX_ROWS * x.shape[-1]:
            y = self._gemm(x.reshape(-1, x.shape[-1]), f.codes, f.scale, f.block_k)
            y = y.view(*x.shape[:-1], y.shape[-1])
            return y + b if b is not None else y
        return self.base(x, f.dequantize(x.dtype), b)


# a kernel's result against the torch definition at install: |kernel - reference| <= CHECK_TOL * max |reference|
# (bf16 / fp16 outputs round to 8 / 11 bits; a wrong block, row or code is off by far more)
CHECK_TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4}


def check_result(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Raise RuntimeError naming `what` unless got is within CHECK_TOL of want (finite both)."""
    tol = CHECK_TOL.get(want.dtype, 3e-2) * float(want.float().abs().max()) + 1e-6
    err = float((got.float() - want.float()).abs().max()) if got.shape == want.shape else float("inf")
    if not (err <= tol):  # (NaN fails too)
        raise RuntimeError(f"{what} disagrees with its torch definition at install (max |diff| {err:.3g} > {tol:.3g})")


def check_kernel(f: Fp8Weight, dtype: torch.dtype, device: torch.device) -> None:
    """Compile the FP8 kernel for f's shape now (never on the step path: on CUDA both its variants, with
    and without the decode k split) and check each on 3 and 130 random rows against the dequantised
    matmul; raises on a compile failure or a wrong result."""
    from deepinfer_kernels import fp8_gemm

    g = torch.Generator().manual_seed(0)
    w = f.dequantize(dtype)
    splits = sorted({1, fp8_gemm.decode_split(*f.shape, device)}) if device.type == "cuda" else [None]
    for split in splits:
        for m in (3, 130):
            x = torch.randn(m, f.shape[1], generator=g).to(device, dtype)
            check_result(fp8_gemm.fp8_gemm_tilelang(x, f.codes, f.scale, f.block_k, split=split),
                         torch.nn.functional.linear(x, w),
                         f"the FP8 kernel on {list(f.shape)} at {m} rows" + (f", k split {split}" if split else ""))


def install_fp8(model, base, device: torch.device, dtype: torch.dtype, kernels: str, invariant: bool) -> Fp8Linear | None:
    """The fp8 linear over `model.fp8_weights` and `base`, or None when the model kept none. Checks that
    every placeholder the model holds is a kept weight (one left over would compute NaN) and, on the
    kernel path, compiles the kernel for every kept shape now and checks its result (check_kernel): a
    failure warns and dequantises per call instead under kernels="auto", and raises under "tilelang"."""
    table = getattr(model, "fp8_weights", {})
    if not table:
        return None
    left = [tuple(p.shape) for p in model.parameters() if is_placeholder(p.data) and p.data.data_ptr() not in table]
    if left:
        raise ModelLoadError(f"weights of shapes {left[:3]} are placeholders with no FP8 weight behind them")
    use_kernel = not invariant and kernel_runs(device, dtype, kernels, cpu_twin=True)
    if use_kernel:
        try:
            for f in {(w.shape, w.block_k): w for w in table.values()}.values():
                check_kernel(f, dtype, device)
        except Exception as e:  # noqa: BLE001 - a compile failure or a wrong result means "dequantise per call"
            if kernels == "tilelang":
                raise
            warnings.warn(f"the TileLang FP8 kernel is unavailable ({type(e).__name__}: {e}); FP8 weights are "
                          "dequantised per call", RuntimeWarning, stacklevel=2)
            use_kernel = False
    if kernels == "tilelang" and not use_kernel:
        warnings.warn("kernels='tilelang': the FP8 kernel runs on CUDA with bfloat16 / float16 activations (or "
                      "the CPU twin at float32) outside the batch-invariant mode; FP8 weights are dequantised "
                      "per call here", RuntimeWarning, stacklevel=2)
    return Fp8Linear(table, base, use_kernel)
