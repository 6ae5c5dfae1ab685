"""The bf16 kernel for many rows (csrc/qgemm_bf16.c, quant.qlinear_bf16) against dequantise-then-fp64 on
bf16-rounded operands, its rows independent of the batch, its fallback where AVX512_BF16 is missing, and
QuantLinear's mode "bf16" (exact row kernels below BF16_M rows, the bf16 kernel from there, the exact
kernels in the batch-invariant mode)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import KernelInputError, quant

pytestmark = pytest.mark.skipif(not quant.available(), reason="native kernels did not build")
needs_bf16 = pytest.mark.skipif(not quant.available() or quant.cpu_level() < 3,
                                reason="the CPU level lacks AVX512_BF16: qlinear_bf16 runs the exact outer kernel")

FMTS = [quant.Q4_0, quant.Q4_1, quant.Q8_0, quant.Q4_K, quant.Q6_K]


def _case(fmt: int, m: int = 101, n: int = 37, seed: int = 0):
    gen = torch.Generator().manual_seed(fmt * 31 + seed)
    # K: 17 blocks for the 32-element formats (pairs not a multiple of 32), 3 super-blocks for the k-quants
    k = 544 if quant.FORMATS[fmt][2] == quant.QK else 768
    qw = quant.pack(torch.randn(n, k, generator=gen) * 0.1, fmt)
    return qw, torch.randn(m, k, generator=gen), gen


def _bf16_reference(x: torch.Tensor, qw: quant.QuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_bf16 @ w_bf16.T in fp64, and a bound on the fp32 accumulation's error): x and the dequantised
    weights rounded to bf16 (nearest even, torch's conversion); each product of two bf16 values is exact
    in fp32, so the kernel differs from this only by the roundings of its running sums, at most K of
    them per output: |error| <= K * 2^-24 * sum_k |x_k w_k| (the recursive-summation bound)."""
    xb = x.bfloat16().double()
    wb = quant.dequantize_reference(qw).bfloat16().double()
    return xb @ wb.T, qw.k * 2.0**-24 * (xb.abs() @ wb.abs().T)


@needs_bf16
@pytest.mark.parametrize("fmt", FMTS)
def test_bf16_matches_the_bf16_reference_and_rows_do_not_depend_on_the_batch(fmt):
    qw, x, gen = _case(fmt)  # N = 37: two groups of 16 weight rows and a partial one; M = 101: 2 x 48 + 5
    bias = torch.randn(qw.n, generator=gen)
    full = quant.qlinear_bf16(x, qw, bias)
    ref, bound = _bf16_reference(x, qw)
    err = (full.double() - bias.double() - ref).abs()
    assert (err <= bound + 1e-6).all(), float((err - bound).max())
    # bf16 operands indeed: the exact dot products are two orders of magnitude farther from the kernel
    # (measured ~1e-2 vs ~1e-6 here)
    exact = x.double() @ quant.dequantize_reference(qw).double().T + bias.double()
    assert (full.double() - exact).abs().max() > 100 * err.max()
    for m in (1, 5, 16, 17, 33, 47, 48, 49, 100):  # tiles of 16 / 32 / 48 rows of x: whole, partial, several
        assert torch.equal(quant.qlinear_bf16(x[:m], qw, bias), full[:m]), m
    assert torch.equal(quant.qlinear_bf16(x[60:61], qw, bias), full[60:61])
    wide = torch.zeros(x.shape[0], qw.k + 32)  # rows of x with a stride: the same bits
    wide[:, :qw.k] = x
    assert torch.equal(quant.qlinear_bf16(wide[:, :qw.k], qw, bias), full)


@needs_bf16
@pytest.mark.parametrize("n", [1, 8, 16, 50])
def test_bf16_odd_widths_and_several_passes_over_the_weights(n):
    # M = 700 rows of K = 544: more than one pass over the weights (each pass's bf16 x slice is ~600 KB)
    qw, x, _ = _case(quant.Q4_1, m=700, n=n, seed=n)
    y = quant.qlinear_bf16(x, qw)
    ref, bound = _bf16_reference(x, qw)
    assert ((y.double() - ref).abs() <= bound + 1e-6).all()
    assert torch.equal(quant.qlinear_bf16(x[650:], qw), y[650:])
    assert quant.qlinear_bf16(x[:0], qw).shape == (0, n)


def test_bf16_without_avx512_bf16_runs_the_exact_outer_kernel():
    qw, x, _ = _case(quant.Q8_0, m=40)
    quant.set_level_cap(2)  # AVX-512 without BF16: the kernel refuses, qlinear_bf16 falls back
    try:
        assert quant.cpu_level() <= 2
        capped = quant.qlinear_bf16(x, qw)
        assert torch.equal(capped, quant.qlinear_outer(x, qw))
    finally:
        quant.set_level_cap(None)


def test_bf16_refuses_bad_input():
    qw, x, _ = _case(quant.Q4_0, m=4)
    with pytest.raises(KernelInputError, match="qlinear_bf16"):
        quant.qlinear_bf16(x.double(), qw)
    with pytest.raises(KernelInputError, match="qlinear_bf16"):
        quant.qlinear_bf16(x[:, :32], qw)


def test_quant_linear_bf16_mode_rows_and_invariant(monkeypatch):
    from deepinfer.engine import quant_linear
    from deepinfer.engine.placeholder import placeholder

    qw, x, _ = _case(quant.Q4_1, m=2 * quant_linear.BF16_M + 3)
    ph = placeholder(qw.shape)
    lin = quant_linear.QuantLinear({ph.data_ptr(): qw}, mode="bf16")
    assert lin.row_mode == "exact"
    # BF16_M rows and more: the bf16 kernel (the exact outer one where the CPU lacks AVX512_BF16)
    assert torch.equal(lin(x, ph), quant.qlinear_bf16(x, qw))
    # below: the exact mode's kernels, the same bits as quantized_exact's QuantLinear
    exact = quant_linear.QuantLinear({ph.data_ptr(): qw}, mode="exact")
    for m in (1, quant.PANEL_M - 1, quant_linear.BF16_M - 1):
        assert torch.equal(lin(x[:m], ph), exact(x[:m], ph)), m
    # batch-invariant: the exact row / panel kernels at every M, never the bf16 kernel
    calls = []
    real = quant.qlinear_bf16
    monkeypatch.setattr(quant, "qlinear_bf16", lambda *a: calls.append(1) or real(*a))
    inv = quant_linear.QuantLinear({ph.data_ptr(): qw}, mode="bf16", invariant=True)
    y = inv(x, ph)
    assert not calls
    assert torch.equal(y, quant_linear.QuantLinear({ph.data_ptr(): qw}, mode="exact", invariant=True)(x, ph))
    assert torch.equal(y[7:8], inv(x[7:8], ph))
    with pytest.raises(ValueError, match="mode"):
        quant_linear.QuantLinear({ph.data_ptr(): qw}, mode="bf8")
