"""The outer-product kernel for many rows (csrc/qgemm_outer.c) against dequantise-then-fp64, its rows
independent of the batch, and QuantLinear's choice of it (default mode) vs the bit-identical panel
kernel (batch-invariant mode)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import quant

pytestmark = pytest.mark.skipif(not quant.available() or quant.cpu_level() < 1,
                                reason="the outer-product kernel needs the native library at the avx2 CPU level or above")

FMTS = [quant.Q4_0, quant.Q4_1, quant.Q8_0, quant.Q4_K, quant.Q6_K]


def _case(fmt: int, n: int = 37):
    gen = torch.Generator().manual_seed(fmt + 7)
    # K: three blocks of the k walk (256, 256, 32) for the 32-element formats; whole super-blocks else
    k = 544 if quant.FORMATS[fmt][2] == quant.QK else 768
    qw = quant.pack(torch.randn(n, k, generator=gen) * 0.1, fmt)
    return qw, torch.randn(23, k, generator=gen), gen


@pytest.mark.parametrize("fmt", FMTS)
def test_outer_matches_reference_and_rows_do_not_depend_on_the_batch(fmt):
    qw, x, gen = _case(fmt)  # N = 37: two full 16-column panels and a partial one
    bias = torch.randn(qw.n, generator=gen)
    full = quant.qlinear_outer(x, qw, bias)
    ref = x.double() @ quant.dequantize_reference(qw).double().T + bias.double()
    torch.testing.assert_close(full.double(), ref, rtol=1e-5, atol=1e-4)
    for m in (1, 5, 6, 7, 12, 22):  # row tiles of 6: whole, partial, several
        assert torch.equal(quant.qlinear_outer(x[:m], qw, bias), full[:m]), m
    assert torch.equal(quant.qlinear_outer(x[9:10], qw, bias), full[9:10])
    # rows of x with a stride (a view of a wider buffer) give the same bits
    wide = torch.zeros(23, qw.k + 32)
    wide[:, :qw.k] = x
    assert torch.equal(quant.qlinear_outer(wide[:, :qw.k], qw, bias), full)


@pytest.mark.parametrize("fmt", [quant.Q4_1, quant.Q8_0, quant.Q6_K])
def test_outer_rows_keep_their_bits_across_the_few_row_kernel_switch(fmt):
    # AVX2 runs a roles-swapped kernel up to 48 rows and the panel kernel past it (AVX-512 one kernel at
    # every M): a row's bits must not depend on which ran it, nor on the row tile it fell in there
    gen = torch.Generator().manual_seed(fmt + 99)
    k = 544 if quant.FORMATS[fmt][2] == quant.QK else 768
    qw = quant.pack(torch.randn(29, k, generator=gen) * 0.1, fmt)  # N = 29: two groups of 12 and a part
    x = torch.randn(100, k, generator=gen)
    full = quant.qlinear_outer(x, qw)
    for m in (1, 8, 9, 16, 24, 31, 32, 40, 47, 48, 49, 64):
        assert torch.equal(quant.qlinear_outer(x[:m], qw), full[:m]), m
    assert torch.equal(quant.qlinear_outer(x[40:60], qw), full[40:60])
    ref = x.double() @ quant.dequantize_reference(qw).double().T
    torch.testing.assert_close(full.double(), ref, rtol=1e-5, atol=1e-4)


def test_outer_one_full_panel_and_zero_rows():
    qw, x, _ = _case(quant.Q4_1, n=16)
    ref = x.double() @ quant.dequantize_reference(qw).double().T
    torch.testing.assert_close(quant.qlinear_outer(x, qw).double(), ref, rtol=1e-5, atol=1e-4)
    assert quant.qlinear_outer(x[:0], qw).shape == (0, 16)


@pytest.mark.parametrize("mode", ["exact", "int8"])
def test_quant_linear_uses_outer_by_default_and_the_panel_when_invariant(mode, monkeypatch):
    from deepinfer.engine import quant_linear
    from deepinfer.engine.placeholder import placeholder

    qw, x, _ = _case(quant.Q4_1)
    x = torch.cat([x, x])  # 46 rows: past OUTER_M
    ph = placeholder(qw.shape)
    calls = []
    real = quant.qlinear_outer
    monkeypatch.setattr(quant, "qlinear_outer", lambda *a: calls.append(1) or real(*a))
    # the int8 mode as on a CPU without AVX512_VNNI (with it: test_quant_i8_outer.py)
    monkeypatch.setattr(quant, "int8_outer_ready", lambda w: False)
    default = quant_linear.QuantLinear({ph.data_ptr(): qw}, mode=mode)
    if mode == "int8":  # int8 products at every M: the int8 kernels' bits, never the exact outer kernel's
        assert torch.equal(default(x, ph), quant.qlinear(x, qw, mode="int8")) and not calls
    else:
        assert torch.equal(default(x, ph), real(x, qw)) and calls
    calls.clear()
    inv = quant_linear.QuantLinear({ph.data_ptr(): qw}, mode=mode, invariant=True)
    y = inv(x, ph)
    assert not calls
    # invariant: each row's bits are those of the row alone (the row kernels' order)
    assert torch.equal(y[3:4], inv(x[3:4], ph))
    # below OUTER_M the default mode keeps the row kernels
    small = x[: quant_linear.OUTER_M - 1]
    assert torch.equal(default(small, ph), quant.qlinear(small, qw, mode=mode)) and not calls

