"""Block-quantised weights (deepinfer_kernels.quant): packer round trip, the gguf package's encoder and
decoder against ours, and every kernel (AVX2 and scalar, exact and int8) against dequantise-then-fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer_kernels import KernelInputError, quant

pytestmark = pytest.mark.skipif(not quant.available(), reason="native kernels did not build")

FMTS = [quant.Q4_0, quant.Q4_1, quant.Q8_0]
# relative error of a whole matrix after pack -> dequantise (round to nearest: half a step of 15 or 254 levels)
PACK_TOL = {quant.Q4_0: 0.12, quant.Q4_1: 0.08, quant.Q8_0: 0.006}
# int8 path vs dequantise-then-fp32: the activations' own rounding (half a step of 254 levels per block)
INT8_TOL = 0.02
LEVELS = [0, 1] if quant.available() and quant.cpu_level() >= 1 else [0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("fmt", FMTS)
def test_pack_round_trip(fmt):
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(fmt))
    qw = quant.pack(w, fmt)
    assert qw.nbytes == 40 * 3 * quant.FORMATS[fmt][1]
    ref = quant.dequantize_reference(qw)
    assert _rel(ref, w) < PACK_TOL[fmt]
    # re-encoding the decoded matrix reproduces the blocks (each value sits on the block's grid)
    again = quant.dequantize_reference(quant.pack(ref, fmt))
    torch.testing.assert_close(again, ref, rtol=0, atol=1e-3 * float(ref.abs().max()))
    # the native decoder agrees with the torch one to rounding
    torch.testing.assert_close(quant.dequantize(qw), ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fmt", FMTS)
def test_reference_matches_gguf_package(fmt):
    gq = pytest.importorskip("gguf.quants")
    import gguf

    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(3)).numpy()
    qtype = gguf.GGMLQuantizationType(fmt)
    raw = gq.quantize(w, qtype)  # the gguf package's own encoder (as llama.cpp's converter writes)
    qw = quant.QuantWeight(torch.from_numpy(np.ascontiguousarray(raw)), fmt, 8, 64)
    expect = torch.from_numpy(gq.dequantize(raw, qtype).astype(np.float32))
    torch.testing.assert_close(quant.dequantize_reference(qw), expect, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(quant.dequantize(qw), expect, rtol=1e-6, atol=1e-7)
    # and our encoder's blocks decode the same way in the package's decoder
    ours = quant.pack(torch.from_numpy(w), fmt)
    torch.testing.assert_close(torch.from_numpy(gq.dequantize(ours.data.numpy(), qtype).astype(np.float32)),
                               quant.dequantize_reference(ours), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m", [1, 3, 4, 9])
def test_kernels_vs_dequantised_reference(fmt, m, level):
    gen = torch.Generator().manual_seed(10 * fmt + m)
    qw = quant.pack(torch.randn(70, 160, generator=gen), fmt)
    x = torch.randn(m, 160, generator=gen)
    ref = x.double() @ quant.dequantize_reference(qw).double().T
    exact = quant.qlinear(x, qw, mode="exact", level=level)
    torch.testing.assert_close(exact.double(), ref, rtol=1e-5, atol=1e-4)
    int8 = quant.qlinear(x, qw, mode="int8", level=level)
    assert _rel(int8.double(), ref) < INT8_TOL
    bias = torch.randn(70, generator=gen)
    torch.testing.assert_close(quant.qlinear(x, qw, bias, mode="int8", level=level), int8 + bias)


@pytest.mark.parametrize("fmt", FMTS)
def test_avx2_and_scalar_agree(fmt):
    """exact: close (another summation order); int8: the same bits (one arithmetic per output: the
    AVX2 groups of 8 weight rows, their single-row tail and the scalar code). 45 rows = chunks of 16,
    16, 13: groups of 8 and tails of 5."""
    if 1 not in LEVELS:
        pytest.skip("the CPU level lacks AVX2 + FMA + F16C: only the scalar code runs here")
    gen = torch.Generator().manual_seed(5)
    qw = quant.pack(torch.randn(45, 256, generator=gen), fmt)
    x = torch.randn(5, 256, generator=gen)
    torch.testing.assert_close(quant.qlinear(x, qw, mode="exact", level=1), quant.qlinear(x, qw, mode="exact", level=0),
                               rtol=1e-5, atol=1e-4)
    i8 = quant.qlinear(x, qw, mode="int8", level=1)
    assert torch.equal(i8, quant.qlinear(x, qw, mode="int8", level=0))
    assert torch.equal(quant.RowKernel(qw, "int8")(x), i8)


def test_quantize_activations_matches_definition():
    """scale = max|x| / 127 per 32-block, q = round half to even of x * (1 / scale), xsum = scale * sum q:
    the native (AVX2) quantiser's bits against torch's float32 arithmetic, ties and zero blocks included."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, 128, generator=gen) * 3
    x[0, :32] = 0  # an all-zero block: scale 0, quants 0
    x[1, 32:64] = torch.tensor([127.0, 2.5, 3.5, -2.5, -0.5, 0.5] + [1.25] * 26)  # scale 1: exact ties
    qx, xs, xsum = quant.quantize_activations(x)
    b = x.view(3, 4, 32)
    s = b.abs().amax(-1) / 127
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    q = torch.round(b * inv.unsqueeze(-1))  # torch.round: half to even
    assert torch.equal(xs, s)
    assert torch.equal(qx, q.to(torch.int8).view(3, 128))
    assert torch.equal(xsum, s * q.sum(-1))
    assert qx[1, 33:38].tolist() == [2, 4, -2, 0, 0]
    with pytest.raises(KernelInputError, match="multiple of 32"):
        quant.quantize_activations(torch.randn(2, 40))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("mode", quant.MODES)
def test_batch_invariant(fmt, mode):
    """A row's output bits do not depend on how many rows share the call (tiles of 4 rows, threads over N;
    a lone row runs 4 weight rows side by side, 301 = 18 chunks of 16 + 13: a tail of single rows)."""
    gen = torch.Generator().manual_seed(7)
    qw = quant.pack(torch.randn(301, 576, generator=gen), fmt)
    x = torch.randn(37, 576, generator=gen)
    full = quant.qlinear(x, qw, mode=mode)
    for k in (1, 2, 3, 4, 5, 8, 17, 36):
        assert torch.equal(quant.qlinear(x[:k], qw, mode=mode), full[:k]), k
    assert torch.equal(quant.qlinear(x[20:21], qw, mode=mode), full[20:21])


@pytest.mark.parametrize("fmt", FMTS)
def test_row_kernel_matches_qlinear(fmt):
    """RowKernel (arguments bound once) gives qlinear's bits in both modes at every M, strided x
    included, and checks K."""
    gen = torch.Generator().manual_seed(11)
    qw = quant.pack(torch.randn(75, 96, generator=gen), fmt)
    rk = quant.RowKernel(qw)
    for m in (1, 2, 5, quant.PANEL_M - 1, quant.PANEL_M, 40):
        x = torch.randn(m, 96, generator=gen)
        assert torch.equal(rk(x), quant.qlinear(x, qw, mode="exact")), m
    wide = torch.randn(3, 200, generator=gen)[:, :96]  # rows 200 apart: the general path
    assert torch.equal(rk(wide), quant.qlinear(wide.contiguous(), qw, mode="exact"))
    with pytest.raises(KernelInputError, match="float32 CPU"):
        rk(torch.randn(2, 64))
    ri = quant.RowKernel(qw, "int8")
    for m in (1, 2, 5, quant.PANEL_M - 1, quant.PANEL_M, 40):
        x = torch.randn(m, 96, generator=gen)
        assert torch.equal(ri(x), quant.qlinear(x, qw, mode="int8")), m
    with pytest.raises(KernelInputError, match="mode"):
        quant.RowKernel(qw, "fp8")


def test_embedding_rows_and_bad_inputs():
    qw = quant.pack(torch.randn(10, 64), quant.Q8_0)
    ref = quant.dequantize_reference(qw)
    ids = torch.tensor([[3, 0], [9, 3]])
    torch.testing.assert_close(quant.dequantize_rows(qw, ids).view(2, 2, 64), ref[ids], rtol=1e-6, atol=1e-7)
    with pytest.raises(KernelInputError, match="outside"):
        quant.dequantize_rows(qw, torch.tensor([10]))
    with pytest.raises(KernelInputError, match="float32 CPU"):
        quant.qlinear(torch.randn(2, 32), qw)
    with pytest.raises(KernelInputError, match="mode"):
        quant.qlinear(torch.randn(2, 64), qw, mode="fp8")
    with pytest.raises(KernelInputError, match="multiple of 32"):
        quant.pack(torch.randn(4, 40), quant.Q4_0)
    with pytest.raises(KernelInputError, match="unsupported block format"):
        quant.QuantWeight(torch.zeros(1, 18, dtype=torch.uint8), 99, 1, 32)
    with pytest.raises(KernelInputError, match="contiguous uint8"):
        quant.QuantWeight(torch.zeros(1, 17, dtype=torch.uint8), quant.Q4_0, 1, 32)
