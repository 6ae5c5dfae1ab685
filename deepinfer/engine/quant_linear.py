"""The projection op on GGUF block-quantised weights kept as stored (Engine(dtype="quantized_exact") for
a GGUF checkpoint; "quantized" for int8; "bfloat16" for bf16 products at many rows;
deepinfer_kernels.quant holds the kernels).

`install_quantized(model, quantized, ...)` swaps every projection of the model whose checkpoint
tensors are all in a supported block format (fused q|k|v and gate|up are the row concatenation
of their parts) for a placeholder of the right shape, and returns a `QuantLinear` that finds the
blocks by the placeholder's storage address, like `CpuLinear` does for its packed copies. The
placeholders are one NaN each, expanded: anything that reads one as a weight gets NaN, not a silent
wrong number. A tied embedding matrix stays quantised too; its lookups dequantise the rows asked for.

Small M (decode) runs the native row kernel, reading the weights as blocks (98 MB for SmolLM2-135M
Q4_1 instead of 540 MB of fp32), through one `quant.RowKernel` per weight (arguments bound once,
same bits; in the int8 mode it quantises the activations too). From OUTER_M rows the exact mode runs
csrc/qgemm_outer.c (AVX2: 16 weight rows dequantised into a transposed panel, a 6 x 16 outer-product
tile; AVX-512: x transposed once, 16 weight rows dequantised at a time and broadcast against an 8 x 48
tile, the same bits): one fixed order per output, not the row kernel's (it is the fp32 panel GEMM's on
the dequantised weights). The batch-invariant mode instead runs the panel kernel there
(csrc/qgemm_panel.c: bit-identical to the row kernel, so a row's bits never depend on M). At the
generic CPU level many rows dequantise the matrix for the call and run oneDNN.

The int8 mode keeps int8 products at every M: from INT8_OUTER_M rows (INT8_OUTER_M_Q4 for the 4-bit
formats) `quant.qlinear_int8_outer` (csrc/qgemm_i8_outer.c with AVX512_VNNI's vpdpbusd, else
csrc/qgemm_i8_outer_avx2.c: vpmaddubsw / vpmaddwd, AVX-VNNI where built; every one bit-identical to
the int8 row kernel), in both the default and the batch-invariant mode; at the generic level, and for
the k-quants, the int8 row kernel at every M (the same bits), never the exact mode's kernels.

The mode "bf16" is the exact mode but for calls of BF16_M rows or more (not batch-invariant mode): there
x and the dequantised weights are rounded to bf16 and multiplied by AVX512_BF16's vdpbf16ps with fp32
accumulation (csrc/qgemm_bf16.c, `quant.qlinear_bf16`: one fixed order per output, so a row still
does not depend on the batch); the exact outer kernel where the CPU lacks AVX512_BF16. The batch-
invariant mode runs the exact mode's kernels in it (the row / panel kernels' bits at every M).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from deepinfer.engine.placeholder import is_placeholder, placeholder
from deepinfer.errors import ModelLoadError
from deepinfer_kernels import native, quant

# rows from which a call (default mode, AVX2 or better) runs the outer-product kernel.
# On the 2-core AVX-512 Zen 5 host (benchmarks/quant_outer_m.py, 2 threads, SmolLM2's Q4_1 shapes
# 960x576, 3072x576, 576x1536 and the tied Q8_0 LM head 49152x576, medians of 9, arms alternating), ms,
# row kernel (AVX-512) vs outer kernel (AVX-512): at 8 rows 0.062 / 0.249 / 0.081 / 2.78 vs 0.084 /
# 0.359 / 0.119 / 4.65; at 12 rows 0.077 / 0.362 / 0.117 / 4.80 vs 0.075 / 0.365 / 0.122 / 5.52 (even);
# at 16 rows 0.095 / 0.478 / 0.155 / 5.71 vs 0.072 / 0.363 / 0.125 / 4.99 (1.15-1.32x), so 16 stays.
# Earlier, at 1 thread on an AVX2-only Zen 3 host, ms: at 16 rows outer 0.41 / 0.98 / 0.49 vs the exact
# row-or-panel path 0.40 / 1.08 / 0.58; at 32 rows 0.52 / 1.69 / 0.94 vs 0.68 / 2.20 / 1.42; at 128 rows
# 1.73 / 6.65 / 3.33 vs 2.60 / 8.35 / 5.23, where the fp32 path's oneDNN GEMM on the dequantised weights
# took 2.13 / 6.34 / 3.88. The int8 row kernel was slower than both from 16 rows on both hosts.
OUTER_M = 16
# Without AVX2: rows from which the matrix is dequantised for the call and run on oneDNN (the row
# kernel took 26.7 ms vs 14.4 for that on Q4_1 3072 x 576 at M = 128, 1 thread).
DEQUANT_M = 64
# the modes a QuantLinear runs: the row kernels' (quant.MODES), and "bf16" (exact row kernels below
# BF16_M rows, the bf16 kernel from there)
MODES = (*quant.MODES, "bf16")
# rows from which the bf16 mode runs quant.qlinear_bf16. On the 2-core AVX-512 Zen 5 host
# (benchmarks/quant_outer_m.py, 2 threads, SmolLM2's Q4_1 shapes and the Q8_0 LM head, medians of 9,
# arms alternating), row-kernel time / bf16-kernel time, qkv / gate_up / down / lm_head: at 8 rows 0.81 /
# 0.84 / 0.82 / 0.70, at 12 rows 1.17 / 1.27 / 1.22 / 0.95, at 16 rows 1.58 / 1.66 / 1.57 / 1.17 (and
# 1.12-1.22x the exact outer kernel there). Decode is bandwidth-bound below that; 16 is also where
# the native decode stack (exact row kernels, fewer than PANEL_M rows) stops, so a decode step's bits do
# not depend on which path ran it. BF16_M must stay >= quant.PANEL_M for that.
BF16_M = 16
# rows from which the int8 mode runs quant.qlinear_int8_outer (the int8 row kernel's bits, so this
# threshold and the batch-invariant mode change no result; AVX512_VNNI's kernel, or the AVX2 one: on the
# 2-core Zen 4 under DEEPINFER_CPU=avx2 it ran 1.9-2.2x the row kernel at 16 rows on SmolLM2's Q4_1
# layers, 1.7x on the Q8_0 LM head, benchmarks/quant_outer_m.py, so 16 / 8 hold there too). On the 2-core AVX-512 Zen 5
# host (benchmarks/quant_outer_m.py, 2 threads, medians of 9, arms alternating, quiet window), ms for
# SmolLM2's Q4_1 qkv / gate_up / down and the Q8_0 LM head at 16 rows: 0.038 / 0.101 / 0.059 / 3.19 vs
# the int8 row kernel's 0.104 / 0.302 / 0.158 / 5.37, the exact outer kernel's 0.065 / 0.193 / 0.100 /
# 4.76 and the bf16 kernel's 0.055 / 0.156 / 0.084 / 3.91; at 128 rows 0.164 / 0.524 / 0.263 / 10.3 vs
# bf16 0.196 / 0.646 / 0.307 / 11.4 and exact outer 0.336 / 1.09 / 0.556 / 18.3. At 8 rows it beat the
# row kernel on the layers (1.5-1.7x) but not on the LM head (0.81x); below 16 the row kernels (and the
# native decode stack, whose calls stop at quant.PANEL_M rows) stay, so this must stay >= PANEL_M.
INT8_OUTER_M = 16
# Q4_0 / Q4_1 weights run it from fewer rows, in QuantLinear and in the native decode stack alike (the
# same bits either way, so no result depends on it). Same host, quiet window, 2 threads, medians of 11,
# int8 row kernel / outer kernel (its 4 x 2 tile) on SmolLM2's Q4_1 qkv / gate_up / down: at 6 rows
# 0.95 / 1.04 / 1.01, at 8 rows 1.40 / 1.48 / 1.34, at 12 rows 1.89 / 2.13 / 1.95. The row
# kernel reads Q8_0's bytes without unpacking nibbles, so there the outer kernel only paid from 10-12 rows
# (8 rows: 1.02 / 1.01 / 0.85); Q8_0 (and the vocab-sized Q8_0 LM head) keeps INT8_OUTER_M.
INT8_OUTER_M_Q4 = 8


def int8_outer_rows(fmt: int) -> int:
    """Rows from which the int8 mode runs quant.qlinear_int8_outer on a weight of block format fmt."""
    return INT8_OUTER_M_Q4 if fmt in (quant.Q4_0, quant.Q4_1) else INT8_OUTER_M


class QuantLinear:
    """Callable ``(x, w, b) -> x @ w.T + b`` for placeholder weights made by `install_quantized`
    (others: F.linear, refused in the batch-invariant mode)."""

    def __init__(self, table: dict[int, quant.QuantWeight], mode: str = "int8", invariant: bool = False):
        if mode not in MODES:
            raise ValueError(f"QuantLinear mode must be one of {MODES}, got {mode!r}")
        self.table = table
        self.mode = mode
        # the row and panel kernels' mode (also the native decode stack's): bf16 keeps them exact
        self.row_mode = "exact" if mode == "bf16" else mode
        self.invariant = invariant
        self.avx2 = quant.cpu_level() >= 1  # the panel and outer-product kernels need AVX2 (or AVX-512)
        # the decode calls (below PANEL_M rows), arguments bound once per weight (same kernel, same bits)
        self.rows = {p: quant.RowKernel(q, self.row_mode) for p, q in table.items()}

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        key = w.data_ptr()
        m = x.shape[0] if x.dim() == 2 else 0
        qw = self.table.get(key)
        if self.mode == "int8" and qw is not None and m >= int8_outer_rows(qw.fmt) and quant.int8_outer_ready(qw):
            return quant.qlinear_int8_outer(x, qw, b)  # the row kernel's bits: invariant mode too
        rows = self.rows.get(key)
        if rows is not None and 0 < m < quant.PANEL_M:
            y = rows(x)
            return y if b is None else y.add_(b)
        if qw is None or x.dim() != 2:
            if self.invariant:
                raise RuntimeError(f"batch-invariant linear called with an unpacked weight {tuple(w.shape)}")
            return F.linear(x, w, b)
        if not self.invariant and self.row_mode == "exact":  # (the int8 mode keeps int8 products at every M)
            if self.mode == "bf16" and x.shape[0] >= BF16_M:
                return quant.qlinear_bf16(x, qw, b)
            if self.avx2 and x.shape[0] >= OUTER_M:
                return quant.qlinear_outer(x, qw, b)
            if not self.avx2 and x.shape[0] >= DEQUANT_M:
                return F.linear(x, quant.dequantize(qw), b)
        return quant.qlinear(x, qw, b, mode=self.row_mode)

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
