"""The projection op on GGUF block-quantised weights kept as stored (Engine(dtype="quantized_exact") for
a GGUF checkpoint; "quantized" for int8; deepinfer_kernels.quant holds the kernels).

`install_quantized(model, quantized, ...)` swaps every projection of the model whose checkpoint
tensors are all in a supported block format (fused q|k|v and gate|up are the row concatenation
of their parts) for a placeholder of the right shape, and returns a `QuantLinear` that finds the
blocks by the placeholder's storage address, like `CpuLinear` does for its packed copies. The
placeholders are one NaN each, expanded: anything that reads one as a weight gets NaN, not a silent
wrong number. A tied embedding matrix stays quantised too; its lookups dequantise the rows asked for.

Small M (decode) runs the native row kernel, reading the weights as blocks (98 MB for SmolLM2-135M
Q4_1 instead of 540 MB of fp32); in the exact mode through one `quant.RowKernel` per weight (arguments
bound once, same bits). Many rows in the exact mode run the panel kernel
(csrc/qgemm_panel.c: three weight rows dequantised into L1 at a time, a 2 x 3 register tile over
all rows), bit-identical to the row kernel, so the batch-invariant mode uses it too. The int8 mode
switches to that exact panel kernel from LARGE_M rows (not in the batch-invariant mode, whose int8
rows must not depend on M). Without AVX2 (no panel kernel) many rows dequantise the matrix for the
call and run oneDNN, as before.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from deepinfer.engine.placeholder import is_placeholder, placeholder
from deepinfer.errors import ModelLoadError
from deepinfer_kernels import native, quant

# int8 mode: rows from which a call runs the exact panel kernel instead (see benchmarks/quant_kernels.py);
# without AVX2, rows from which it dequantises and uses oneDNN (the row kernel took 26.7 ms vs 14.4 for
# dequantise + oneDNN on Q4_1 3072 x 576 at M = 128, 1 thread)
LARGE_M = 64
LARGE_PATH = "panel"


class QuantLinear:
    """Callable ``(x, w, b) -> x @ w.T + b`` for placeholder weights made by `install_quantized`
    (others: F.linear, refused in the batch-invariant mode)."""

    def __init__(self, table: dict[int, quant.QuantWeight], mode: str = "int8", invariant: bool = False):
        if mode not in quant.MODES:
            raise ValueError(f"QuantLinear mode must be one of {quant.MODES}, got {mode!r}")
        self.table = table
        self.mode = mode
        self.invariant = invariant
        self.panel = quant.cpu_level() >= 1  # the panel kernel is AVX2-only
        # many rows outside the invariant mode: "dequant" (the matrix dequantised for the call, then
        # oneDNN), "panel" or "panel1" (the one-chain tile); from large_m rows
        self.large, self.large_m = LARGE_PATH, LARGE_M
        # the exact mode's decode calls, arguments bound once per weight (same kernel, same bits)
        self.rows = {p: quant.RowKernel(q) for p, q in table.items()} if mode == "exact" else {}

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        key = w.data_ptr()
        rows = self.rows.get(key)
        if rows is not None and x.dim() == 2 and x.shape[0] < quant.PANEL_M:
            y = rows(x)
            return y if b is None else y.add_(b)
        qw = self.table.get(key)
        if qw is None or x.dim() != 2:
            if self.invariant:
                raise RuntimeError(f"batch-invariant linear called with an unpacked weight {tuple(w.shape)}")
            return F.linear(x, w, b)
        if x.shape[0] >= self.large_m and not self.invariant:
            if self.large == "dequant" or not self.panel:
                return F.linear(x, quant.dequantize(qw), b)
            return quant.qlinear(x, qw, b, mode="exact", panel=True, one_chain=self.large == "panel1")
        return quant.qlinear(x, qw, b, mode=self.mode)

    def silu_mul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """silu(x @ gate.T) * (x @ up.T) for a stacked [gate; up] weight: one projection, then the
        native silu * mul (csrc/silu_mul.c, the kernel the native decode stack calls too)."""
        return native.silu_mul(self(x, w))

    @property
    def nbytes(self) -> int:
        return sum(q.nbytes for q in self.table.values())


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
        ph = placeholder(qw.shape)
        if param is model.embed_tokens:
            embed = qw
        param.data = ph
        table[ph.data_ptr()] = qw
    # the loader hands out placeholders only for what this installs; one left over would compute NaN
    left = [names[0] for param, names in model.projection_sources()
            if is_placeholder(param.data) and param.data.data_ptr() not in table]
    if left:
        raise ModelLoadError(f"no quantised blocks for the placeholder weights of {left[:3]}")
    if not table:
        return None
    if embed is not None:
        model.set_embedding_impl(lambda ids: quant.dequantize_rows(embed, ids).view(*ids.shape, embed.k))
    return QuantLinear(table, mode=mode, invariant=invariant)
