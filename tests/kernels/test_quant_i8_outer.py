"""The int8 mode's outer-product kernels (quant.qlinear_int8_outer: csrc/qgemm_i8_outer.c with
AVX512_VNNI, csrc/qgemm_i8_outer_avx2.c on AVX2, vpmaddubsw / vpmaddwd or AVX-VNNI): bit for bit the int8
row kernel (AVX2 / VNNI and scalar code) and within the fp32 roundings of a float64 sum over the same
quantised operands, for each format they cover, at odd shapes, saturating-range operands and several
passes; their rows independent of M; which runs at each level; their fallbacks; QuantLinear's int8 mode
running them from INT8_OUTER_M rows.

Each kernel test runs at the level in force (on an AVX-512 host with VNNI: the AVX512_VNNI kernel) and
capped to level 1 (quant.set_level_cap(1): the AVX2 kernel, in whatever build the library is). Run the
file under DEEPINFER_CPU=avx2 too: there the library is the avx2 build (-march=x86-64-v3), what an
AVX2-only CPU runs."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import KernelInputError, quant

pytestmark = pytest.mark.skipif(not quant.available(), reason="native kernels did not build")

FMTS = [quant.Q4_0, quant.Q4_1, quant.Q8_0]


def _level() -> int:
    if not quant.available():
        return -1
    quant.set_level_cap(None)
    return quant.cpu_level()


# the kernels need AVX2 (level 1); below it, by design, only the row kernel exists
needs_avx2 = pytest.mark.skipif(_level() < 1, reason="the CPU level is generic (no AVX2 + FMA + F16C): "
                                                     "qlinear_int8_outer has no kernel there, it runs the row kernel")


@pytest.fixture(params=[None, 1], ids=["level", "avx2"])
def cap(request):
    """The level cap each kernel test runs under: None (the level in force) or 1 (the AVX2 kernel)."""
    quant.set_level_cap(request.param)
    try:
        yield request.param
    finally:
        quant.set_level_cap(None)


def _kernel(cap, qw) -> str | None:
    """The kernel qlinear_int8_outer runs under `cap`, checked against what the level promises."""
    kind = quant.int8_outer_kernel(qw)
    if cap == 1 or quant.cpu_level() == 1:
        assert kind in ("avx2", "avx_vnni"), kind
    else:
        assert kind in ("avx512_vnni", "avx2"), kind  # an AVX-512 CPU without VNNI has the AVX2 kernel
    return kind


def _case(fmt: int, m: int, n: int, k: int = 544, seed: int = 0):
    gen = torch.Generator().manual_seed(fmt * 131 + m + n + seed)
    qw = quant.pack(torch.randn(n, k, generator=gen) * 0.1, fmt)
    return qw, torch.randn(m, k, generator=gen)


def _extreme(fmt: int, m: int, n: int, k: int = 256):
    """Operands at the ends of their ranges: activations quantised to +-127 (one large value of each sign
    per block), quants all 15 (4-bit) or +-127 and -128 (Q8_0), where an i16 sum or pair could saturate."""
    gen = torch.Generator().manual_seed(7 * fmt + m + n)
    x = torch.randn(m, k, generator=gen)
    x[:, ::32] = 50.0
    x[:, 1::32] = -50.0
    qw = quant.pack(torch.sign(torch.randn(n, k, generator=gen)), fmt)
    _, bb, _ = quant.FORMATS[fmt]
    raw = qw.data.view(n, k // quant.QK, bb).clone()
    if fmt == quant.Q8_0:
        pick = torch.rand(n, k // quant.QK, 32, generator=gen) < 0.5
        raw[..., 2:] = torch.where(pick, 128, 127).to(torch.uint8)  # -128 and +127 as int8
        raw[: n // 2, :, 2:] = 128  # whole rows of -128
    else:
        raw[..., 4 if fmt == quant.Q4_1 else 2:] = 0xFF
    return quant.QuantWeight(raw.view(n, -1).contiguous(), fmt, n, k), x


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


@needs_avx2
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m,n", [(1, 5), (3, 16), (4, 17), (7, 8), (16, 37), (47, 16), (49, 1), (101, 50),
                                 (130, 33)])
def test_int8_outer_is_the_int8_row_kernel_bit_for_bit(fmt, m, n, cap):
    # m: one row, within one tile (AVX2: 4 rows; AVX-512: 16 / 32), a few past it, several tiles and
    # panels with a ragged last one; n: one row, fewer than or not a multiple of the weight groups (AVX2:
    # 16 rows in two vectors of 8; AVX-512: 16 in tiles of 4)
    qw, x = _case(fmt, m, n)
    _kernel(cap, qw)
    y = quant.qlinear_int8_outer(x, qw)
    assert torch.equal(y, quant.qlinear(x, qw, mode="int8"))
    assert torch.equal(y, quant.qlinear(x, qw, mode="int8", level=0))  # the scalar reference order
    ref, bound = _reference(x, qw)
    assert ((y.double() - ref).abs() <= bound + 1e-30).all()


@needs_avx2
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m,n,k", [(1, 3, 32), (5, 24, 64), (13, 29, 256), (33, 70, 96)])
def test_int8_outer_saturating_range_is_exact(fmt, m, n, k, cap):
    # the bounds the AVX2 kernel relies on (no i16 sum or pair saturates, csrc/qgemm_i8_outer_avx2.c):
    # activations at +-127, quants 15 or -128 / +127; K of one, two, eight and three blocks
    qw, x = _extreme(fmt, m, n, k)
    _kernel(cap, qw)
    y = quant.qlinear_int8_outer(x, qw)
    assert torch.equal(y, quant.qlinear(x, qw, mode="int8"))
    assert torch.equal(y, quant.qlinear(x, qw, mode="int8", level=0))
    ref, bound = _reference(x, qw)
    assert ((y.double() - ref).abs() <= bound + 1e-30).all()


@needs_avx2
@pytest.mark.parametrize("fmt", FMTS)
def test_int8_outer_rows_do_not_depend_on_the_batch(fmt, cap):
    qw, x = _case(fmt, 150, 41, seed=1)
    _kernel(cap, qw)
    y = quant.qlinear_int8_outer(x, qw)
    for a, b in ((0, 1), (0, 3), (0, 16), (5, 22), (48, 97), (100, 150), (149, 150)):
        assert torch.equal(quant.qlinear_int8_outer(x[a:b], qw), y[a:b]), (a, b)
    for k in (1, 2, 5, 8, 31, 64):  # the first k rows of the batch as a k-row call
        assert torch.equal(quant.qlinear_int8_outer(x[:k], qw), y[:k]), k


@needs_avx2
def test_int8_outer_kernels_agree_with_each_other():
    # the level's kernel and the AVX2 one on the same call (on an AVX512_VNNI host: the two kernels)
    for fmt in FMTS:
        qw, x = _case(fmt, 67, 45, seed=2)
        y = quant.qlinear_int8_outer(x, qw)
        quant.set_level_cap(1)
        try:
            assert torch.equal(quant.qlinear_int8_outer(x, qw), y), fmt
        finally:
            quant.set_level_cap(None)


@needs_avx2
@pytest.mark.parametrize("fmt", FMTS)
def test_int8_outer_several_passes_and_bias(fmt, cap):
    # K = 2048: a pass covers 288 rows of x on the AVX-512 kernel (its xT slice stays under 640 KB), 128
    # (64 for Q8_0's 16-bit panels) on the AVX2 one (256 KB), so 700 rows take three passes or more
    qw, x = _case(fmt, 700, 21, k=2048)
    _kernel(cap, qw)
    bias = torch.randn(21)
    y = quant.qlinear_int8_outer(x, qw, bias)
    assert torch.equal(y, quant.qlinear(x, qw, bias, mode="int8"))
    ref, bound = _reference(x, qw)
    assert ((y.double() - bias.double() - ref).abs() <= bound + 1e-5).all()
    assert quant.qlinear_int8_outer(x[:0], qw).shape == (0, 21)


def test_int8_outer_kernel_at_each_level():
    qw = quant.pack(torch.randn(20, 64) * 0.1, quant.Q8_0)
    x = torch.randn(40, 64)
    level = _level()
    try:
        for c in range(0, level + 1):
            quant.set_level_cap(c)
            kind = quant.int8_outer_kernel(qw)
            if c == 0:  # generic: the kernels refuse, qlinear_int8_outer runs the row kernel
                assert kind is None and not quant.int8_outer_ready(qw)
            elif c == 1:
                assert kind in ("avx2", "avx_vnni") and quant.int8_outer_ready(qw)
            else:
                assert kind in ("avx512_vnni", "avx2")
            assert torch.equal(quant.qlinear_int8_outer(x, qw), quant.qlinear(x, qw, mode="int8")), c
    finally:
        quant.set_level_cap(None)
    if level >= 2:  # the zmm kernel exactly where the level may use AVX512_VNNI
        from deepinfer_kernels import cpu

        assert (quant.int8_outer_kernel(qw) == "avx512_vnni") == cpu.has("avx512_vnni")


def test_int8_outer_falls_back_to_the_row_kernel():
    qw, x = _case(quant.Q8_0, 40, 19)
    quant.set_level_cap(0)  # generic: no kernel at this level, the row kernel (scalar code) runs
    try:
        assert not quant.int8_outer_ready(qw) and quant.int8_outer_kernel(qw) is None
        assert torch.equal(quant.qlinear_int8_outer(x, qw), quant.qlinear(x, qw, mode="int8"))
    finally:
        quant.set_level_cap(None)
    # the k-quants are not covered: the row kernel's int8 mode (qgemm_k.c), at every level
    kq = quant.pack(torch.randn(9, 512) * 0.1, quant.Q4_K)
    xk = torch.randn(20, 512)
    for c in (None, 1):
        quant.set_level_cap(c)
        try:
            assert not quant.int8_outer_ready(kq) and quant.int8_outer_kernel(kq) is None
            assert torch.equal(quant.qlinear_int8_outer(xk, kq), quant.qlinear(xk, kq, mode="int8"))
        finally:
            quant.set_level_cap(None)


@pytest.mark.parametrize("capped", [None, 1], ids=["level", "avx2"])
def test_int8_outer_refuses_bad_input(capped):
    qw, x = _case(quant.Q4_0, 4, 8)
    quant.set_level_cap(capped)
    try:
        with pytest.raises(KernelInputError, match="qlinear_int8_outer"):
            quant.qlinear_int8_outer(x.double(), qw)
        with pytest.raises(KernelInputError, match="qlinear_int8_outer"):
            quant.qlinear_int8_outer(x[:, :32], qw)
        with pytest.raises(KernelInputError, match="qlinear_int8_outer"):
            quant.qlinear_int8_outer(x[0], qw)  # not 2-D
        with pytest.raises(KernelInputError, match="bias"):
            quant.qlinear_int8_outer(x, qw, torch.randn(7))
    finally:
        quant.set_level_cap(None)


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
    # the AVX2 kernel (level 1) runs it too where the library was built for AVX2 or more; at level 0
    # (and under DEEPINFER_CPU=generic) none does: the row kernel, int8 products at every M
    from deepinfer_kernels import cpu

    for c in (1, 0):
        runs = c == 1 and cpu.kernel_level() >= 1
        calls.clear()
        quant.set_level_cap(c)
        try:
            assert quant.int8_outer_ready(qw) == runs
            y = lin(x, ph)
            assert calls == ([x.shape[0]] if runs else [])
            assert torch.equal(y, row)
        finally:
            quant.set_level_cap(None)
