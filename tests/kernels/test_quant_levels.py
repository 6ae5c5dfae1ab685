"""The quantised kernels' AVX-512 code (level 2: the outer-product kernel's 8 x 48 tile, the exact row
kernels in zmm, VNNI in the int8 dot) against their AVX2 code (quant.set_level_cap(1)): the same bits
on every format and on shapes that fill no tile or panel exactly. Skipped where the CPU has no AVX-512."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import KernelInputError, quant

FMTS = [quant.Q4_0, quant.Q4_1, quant.Q8_0, quant.Q4_K, quant.Q6_K]


def _level() -> int:
    if not quant.available():
        return -1
    quant.set_level_cap(None)
    return quant.cpu_level()


avx512_only = pytest.mark.skipif(_level() < 2, reason="the CPU level lacks AVX-512 F/BW/DQ/VL (or the native "
                                                      "kernels did not build): only the AVX2 code runs here")


@pytest.fixture
def capped():
    """run(fn, *args): fn(*args) with the kernels capped to their AVX2 code, the cap lifted after."""
    def run(fn, *args, **kwargs):
        quant.set_level_cap(1)
        try:
            assert quant.cpu_level() == 1
            return fn(*args, **kwargs)
        finally:
            quant.set_level_cap(None)
    yield run
    quant.set_level_cap(None)


def _case(fmt: int, m: int, n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    k = 544 if quant.FORMATS[fmt][2] == quant.QK else 768  # past one K block of both outer tiles
    return quant.pack(torch.randn(n, k, generator=gen) * 0.1, fmt), torch.randn(m, k, generator=gen)


@avx512_only
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m,n", [(1, 1), (7, 47), (9, 49), (17, 100), (33, 16), (8, 48), (130, 97), (300, 50)])
def test_outer_avx512_tile_is_bit_identical_to_the_avx2_tile(fmt, m, n, capped):
    # M a multiple of neither row tile (16 / 48 / 6) or of both, and 300: two passes over the weights (K = 544
    # or 768: 288 or 192 rows of x per pass); N a multiple of neither weight group (AVX-512: 16 rows, tiles
    # of 8; AVX2: panels of 16) or of both
    qw, x = _case(fmt, m, n, fmt * 1000 + m * 7 + n)
    narrow = capped(quant.qlinear_outer, x, qw)
    y = quant.qlinear_outer(x, qw)
    assert torch.equal(y, narrow)
    ref = x.double() @ quant.dequantize_reference(qw).double().T
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)


@avx512_only
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 15, 16, 33])
def test_exact_row_kernels_avx512_are_bit_identical_to_avx2(fmt, m, capped):
    # the exact row kernels (1 row: 4 weight rows side by side; 2-4: the row tile) and, the batch-invariant
    # mode's many-row path, the panel kernel, which must keep the row kernels' bits
    qw, x = _case(fmt, m, 37, fmt + m)
    for panel in (False, True):
        narrow = capped(quant.qlinear, x, qw, mode="exact", panel=panel)
        assert torch.equal(quant.qlinear(x, qw, mode="exact", panel=panel), narrow), panel
    assert torch.equal(quant.qlinear(x, qw, mode="exact", panel=False), quant.qlinear(x, qw, mode="exact", panel=True))
    one = quant.RowKernel(qw, "exact")
    assert torch.equal(one(x[:1]), capped(one, x[:1]))


@avx512_only
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 9, 17])
def test_int8_vnni_is_bit_identical_to_maddubs(fmt, m, capped):
    # saturating-range inputs: activations at +-127 after quantisation (one large value per block) and
    # weights at the ends of their range (pack of +-1 gives the largest quants)
    qw, x = _case(fmt, m, 41, 50 + fmt + m)
    x[:, ::32] = 50.0
    x[:, 1::32] = -50.0
    extreme = quant.pack(torch.sign(torch.randn(41, qw.k, generator=torch.Generator().manual_seed(m))), fmt)
    for w in (qw, extreme):
        narrow = capped(quant.qlinear, x, w, mode="int8")
        assert torch.equal(quant.qlinear(x, w, mode="int8"), narrow)
        one = quant.RowKernel(w, "int8")
        assert torch.equal(one(x[:1]), capped(one, x[:1]))


def test_level_cap_rejects_bad_levels_and_caps():
    if not quant.available():
        pytest.skip("native kernels did not build")
    with pytest.raises(KernelInputError, match="level"):
        quant.set_level_cap(-1)
    with pytest.raises(KernelInputError, match="level"):
        quant.set_level_cap(1.5)
    top = _level()
    quant.set_level_cap(0)
    try:
        assert quant.cpu_level() == 0
    finally:
        quant.set_level_cap(None)
    assert quant.cpu_level() == top
