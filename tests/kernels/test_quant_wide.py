"""The exact row kernels' AVX-512 tiles for two or more rows of x (csrc/qgemm.c, wide_tile: rows split
into even tiles of at most 8, two or three weight rows side by side, K walked in slices where a tile's
x outgrows 32 KB) against dequantise-then-fp64, and bit for bit against the row kernel on each row
alone and against the AVX2 code's 4-row tiles: the row kernels' bits at every M, which the batch-
invariant mode and the native decode stack rely on. Skipped where the CPU has no AVX-512."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import quant

pytestmark = pytest.mark.skipif(not quant.available() or quant.cpu_level() < 2,
                                reason="the wide tiles run at the avx512 CPU level (AVX-512 F/BW/DQ/VL, native kernels built)")

FMTS = [quant.Q4_0, quant.Q4_1, quant.Q8_0]


def _capped(fn, *args, **kwargs):
    quant.set_level_cap(1)  # the AVX2 code: tiles of MR = 4 rows, one weight row at a time
    try:
        return fn(*args, **kwargs)
    finally:
        quant.set_level_cap(None)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("k", [96, 576, 2048])  # 2048: 8 rows of x are 64 KB, so K runs in two slices
@pytest.mark.parametrize("m", [2, 3, 5, 6, 7, 8, 9, 12, 13, 15, 16, 17, 25])
def test_wide_tiles_match_reference_and_the_row_kernels_bits(fmt, k, m):
    # N = 41: chunks of 16 weight rows (16, 16, 9), none a multiple of the 2 or 3 rows side by side;
    # M: one tile (2..8), even tiles of 5 + 4, 6 + 6, 7 + 6, 8 + 7, 8 + 8, 6 + 6 + 5, and 25 = 7 * 3 + 4
    gen = torch.Generator().manual_seed(fmt * 100 + m + k)
    qw = quant.pack(torch.randn(41, k, generator=gen) * 0.1, fmt)
    x = torch.randn(m, k, generator=gen)
    y = quant.qlinear(x, qw, mode="exact", panel=False)
    ref = x.double() @ quant.dequantize_reference(qw).double().T
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)
    alone = torch.cat([quant.qlinear(x[i:i + 1], qw, mode="exact", panel=False) for i in range(m)])
    assert torch.equal(y, alone)
    assert torch.equal(y, _capped(quant.qlinear, x, qw, mode="exact", panel=False))
    if m < quant.PANEL_M:  # the decode path's bound kernel runs the same tiles
        assert torch.equal(quant.RowKernel(qw, "exact")(x), y)


def test_wide_tiles_read_strided_rows():
    # rows of x ldx apart (a view of a wider buffer): the same bits as the dense copy
    gen = torch.Generator().manual_seed(3)
    qw = quant.pack(torch.randn(19, 256, generator=gen) * 0.1, quant.Q4_1)
    buf = torch.randn(12, 320, generator=gen)
    view = buf[:, :256]
    assert torch.equal(quant.qlinear(view, qw, mode="exact", panel=False),
                       quant.qlinear(view.contiguous(), qw, mode="exact", panel=False))
