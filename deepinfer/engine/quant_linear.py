"""The projection op on GGUF block-quantised weights kept as stored (Engine(dtype="quantized_exact") for
a GGUF checkpoint; "quantized" for int8; deepinfer_kernels.quant holds the kernels).

`install_quantized(model, quantized, ...)` swaps every projection of the model whose checkpoint
tensors are all in a supported block format (fused q|k|v and gate|up are the row concatenation
of their parts) for a placeholder of the right shape, and returns a `QuantLinear` that finds the
blocks by the placeholder's storage address, like `CpuLinear` does for its packed copies. The
placeholders are one NaN each, expanded: anything that reads one as a weight gets NaN, not a silent
wrong number. A tied embedding matrix stays quantised too; its lookups dequantise the rows asked for.

Small M (decode) runs the native kernel, reading the weights as blocks (98 MB for SmolLM2-135M
Q4_1 instead of 540 MB of fp32). From LARGE_M rows on, the matrix is dequantised to fp32 for that
call and multiplied by oneDNN: there the GEMM is compute-bound and the native kernel ran at
0.4-0.6x of oneDNN (M = 128), while dequantising costs a fraction of the GEMM. In the
batch-invariant mode every M runs the native kernel (one fixed reduction order per element).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from deepinfer_kernels import quant

# rows from which a call dequantises and uses oneDNN: per projection (Q4_1 3072x576, 1 thread) the
# native kernel took 2.77 ms vs oneDNN 2.60 at M = 32 and 26.7 vs 14.4 at M = 128, while a
# per-call dequantisation at M = 16-32 cost the engine 0.43x of fp32 at batch 32
LARGE_M = 64


class QuantLinear:
    """Callable ``(x, w, b) -> x @ w.T + b`` for placeholder weights made by `install_quantized`
    (others: F.linear, refused in the batch-invariant mode)."""

    silu_mul = None  # gate/up run as one projection, silu * mul in torch

    def __init__(self, table: dict[int, quant.QuantWeight], mode: str = "int8", invariant: bool = False):
        if mode not in quant.MODES:
            raise ValueError(f"QuantLinear mode must be one of {quant.MODES}, got {mode!r}")
        self.table = table
        self.mode = mode
        self.invariant = invariant

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        qw = self.table.get(w.data_ptr())
        if qw is None or x.dim() != 2:
            if self.invariant:
                raise RuntimeError(f"batch-invariant linear called with an unpacked weight {tuple(w.shape)}")
            return F.linear(x, w, b)
        if x.shape[0] >= LARGE_M and not self.invariant:
            return F.linear(x, quant.dequantize(qw), b)
        return quant.qlinear(x, qw, b, mode=self.mode)

    @property
    def nbytes(self) -> int:
        return sum(q.nbytes for q in self.table.values())


def _placeholder(shape: tuple[int, int]) -> torch.Tensor:
    return torch.full((1, 1), float("nan")).expand(*shape)


def install_quantized(model, quantized: Mapping[str, quant.QuantWeight], mode: str = "int8",
                      invariant: bool = False) -> QuantLinear | None:
    """Replace the model's projections (and a quantised embedding) by placeholders backed by the
    blocks in `quantized` (HF name -> QuantWeight); None when no projection could be quantised
    (the model is left as it was)."""
    table: dict[int, quant.QuantWeight] = {}
    embed = None
    for param, names in model.projection_sources():
        parts = [quantized.get(n) for n in names]
        if any(p is None for p in parts) or len({(p.fmt, p.k) for p in parts}) != 1:
            continue  # a part in an unsupported format: this projection stays fp32
        qw = parts[0] if len(parts) == 1 else quant.cat_rows(parts)
        if qw.shape != tuple(param.shape):
            continue
        ph = _placeholder(qw.shape)
        if param is model.embed_tokens:
            embed = qw
        param.data = ph
        table[ph.data_ptr()] = qw
    if not table:
        return None
    if embed is not None:
        model.set_embedding_impl(lambda ids: quant.dequantize_rows(embed, ids).view(*ids.shape, embed.k))
    return QuantLinear(table, mode=mode, invariant=invariant)
