"""The int8 mode's outer-product kernel (csrc/qgemm_i8_outer.c, quant.qlinear_int8_outer): bit for bit
the int8 row kernel (AVX2 / VNNI and scalar code) and within the fp32 roundings of a float64 sum over
the same quantised operands, for each format it covers, at odd shapes and several passes; its rows
independent of M; its fallbacks; QuantLinear's int8 mode running it from INT8_OUTER_M rows."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import KernelInputError, quant

pytestmark = pytest.mark.skipif(not quant.available(), reason="native kernels did not build")

FMTS = [quant.Q4_0, quant.Q4_1, quant.Q8_0]


def _ready() -> bool:
    return quant.available() and quant.int8_outer_ready(quant.pack(torch.zeros(1, 32), quant.Q8_0))


needs_vnni = pytest.mark.skipif(not _ready(), reason="no AVX-512 VNNI: qlinear_int8_outer runs the row kernel")


def _case(fmt: int, m: int, n: int, k: int = 544, seed: int = 0):
    gen = torch.Generator().manual_seed(fmt * 131 + m + n + seed)
    qw = quant.pack(torch.randn(n, k, generator=gen) * 0.1, fmt)
    return qw, torch.randn(m, k, generator=gen)


def _blocks(qw: quant.QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d, m, q) of every block as float64: d, m [N, nb], the integer quants q [N, nb, 32] (Q4_0 with its
    -8), read from the bytes by their definitions (m zero but for Q4_1)."""
    _, bb, _ = quant.FORMATS[qw.fmt]
    raw = qw.data.view(qw.n, -1, bb)
    d = raw[..., 0:2].contiguous().view(torch.float16).double().squeeze(-1)
    if qw.fmt == quant.Q8_0:
        return d, torch.zeros_like(d), raw[..., 2:].contiguous().view(torch.int8).double()
    off = 4 if qw.fmt == quant.Q4_1 else 2
    qs = raw[..., off:].long()
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1).double()
    if qw.fmt == quant.Q4_0:
        return d, torch.zeros_like(d), q - 8
    return d, raw[..., 2:4].contiguous().view(torch.float16).double().squeeze(-1), q


def _reference(x: torch.Tensor, qw: quant.QuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(y in float64, a bound on the kernel's error) over the same quantised operands: x quantised by
    quant.quantize_activations (the kernel's quantiser), per block b the exact integer dot_b, and
    y = sum_b d_b s_b dot_b + m_b xsum_b. The kernel rounds d_b * s_b and each of its nb + nb fp32
    accumulations (and the final add) once: |error| <= (2 nb + 2) 2^-24 sum_b (|d_b s_b dot_b| + |m_b xsum_b|)."""
    qx, xs, xsum = quant.quantize_activations(x)
    d, m, q = _blocks(qw)
    nb = qw.k // quant.QK
    dots = torch.einsum("rbj,nbj->rnb", qx.double().view(x.shape[0], nb, quant.QK), q)
    main = dots * xs.double().unsqueeze(1) * d.unsqueeze(0)
    mins = xsum.double().unsqueeze(1) * m.unsqueeze(0)
    y = (main + mins).sum(-1)
    return y, (2 * nb + 2) * 2.0**-24 * (main.abs() + mins.abs()).sum(-1)


@needs_vnni
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m,n", [(16, 37), (47, 16), (49, 1), (101, 50), (130, 33)])
def test_int8_outer_is_the_int8_row_kernel_bit_for_bit(fmt, m, n):
    # m: within one tile of 48 rows, one past it, several panels with a ragged last one; n: not a
    # multiple of the 16-row weight group or the 4-row register tile
    qw, x = _case(fmt, m, n)
    y = quant.qlinear_int8_outer(x, qw)
    assert torch.equal(y, quant.qlinear(x, qw, mode="int8"))
    assert torch.equal(y, quant.qlinear(x, qw, mode="int8", level=0))  # the scalar reference order
    ref, bound = _reference(x, qw)
    assert ((y.double() - ref).abs() <= bound + 1e-30).all()


@needs_vnni
@pytest.mark.parametrize("fmt", FMTS)
def test_int8_outer_rows_do_not_depend_on_the_batch(fmt):
    qw, x = _case(fmt, 150, 41, seed=1)
    y = quant.qlinear_int8_outer(x, qw)
    for a, b in ((0, 16), (5, 22), (48, 97), (100, 150), (149, 150)):
        assert torch.equal(quant.qlinear_int8_outer(x[a:b], qw), y[a:b]), (a, b)


@needs_vnni
def test_int8_outer_several_passes_and_bias():
    # K = 2048: a pass covers 288 rows of x (its xT slice stays under 640 KB), so 700 rows take three
    qw, x = _case(quant.Q4_1, 700, 21, k=2048)
    bias = torch.randn(21)
    y = quant.qlinear_int8_outer(x, qw, bias)
    assert torch.equal(y, quant.qlinear(x, qw, bias, mode="int8"))
    ref, bound = _reference(x, qw)
    assert ((y.double() - bias.double() - ref).abs() <= bound + 1e-5).all()
    assert quant.qlinear_int8_outer(x[:0], qw).shape == (0, 21)


def test_int8_outer_falls_back_to_the_row_kernel():
    qw, x = _case(quant.Q8_0, 40, 19)
    quant.set_level_cap(1)  # AVX2 only: the kernel refuses
    try:
        assert not quant.int8_outer_ready(qw)
        assert torch.equal(quant.qlinear_int8_outer(x, qw), quant.qlinear(x, qw, mode="int8"))
    finally:
        quant.set_level_cap(None)
    # the k-quants are not covered: the row kernel's int8 mode (qgemm_k.c)
    kq = quant.pack(torch.randn(9, 512) * 0.1, quant.Q4_K)
    xk = torch.randn(20, 512)
    assert not quant.int8_outer_ready(kq)
    assert torch.equal(quant.qlinear_int8_outer(xk, kq), quant.qlinear(xk, kq, mode="int8"))


def test_int8_outer_refuses_bad_input():
    qw, x = _case(quant.Q4_0, 4, 8)
    with pytest.raises(KernelInputError, match="qlinear_int8_outer"):
        quant.qlinear_int8_outer(x.double(), qw)
    with pytest.raises(KernelInputError, match="qlinear_int8_outer"):
        quant.qlinear_int8_outer(x[:, :32], qw)


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("fmt", [quant.Q4_1, quant.Q8_0])
def test_quant_linear_int8_mode_runs_it_from_int8_outer_m(monkeypatch, invariant, fmt):
    from deepinfer.engine import quant_linear
    from deepinfer.engine.placeholder import placeholder

    start = quant_linear.int8_outer_rows(fmt)
    assert start == (quant_linear.INT8_OUTER_M_Q4 if fmt == quant.Q4_1 else quant_linear.INT8_OUTER_M)
    qw, x = _case(fmt, 2 * quant_linear.INT8_OUTER_M + 3, 35)
    ph = placeholder(qw.shape)
    lin = quant_linear.QuantLinear({ph.data_ptr(): qw}, mode="int8", invariant=invariant)
    calls = []
    real = quant.qlinear_int8_outer
    monkeypatch.setattr(quant, "qlinear_int8_outer", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    row = quant.qlinear(x, qw, mode="int8")
    for m in (1, start - 1, start, x.shape[0]):
        assert torch.equal(lin(x[:m], ph), row[:m]), m  # the row kernel's bits at every M
    assert calls == ([start, x.shape[0]] if quant.int8_outer_ready(qw) else [])
    # without VNNI: today's paths (the exact outer kernel in the default mode, the row kernel invariant)
    calls.clear()
    quant.set_level_cap(1)
    try:
        y = lin(x, ph)
        assert not calls
        assert torch.equal(y, row if invariant else quant.qlinear_outer(x, qw))
    finally:
        quant.set_level_cap(None)
