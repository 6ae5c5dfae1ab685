"""GGUF k-quants (Q4_K, Q6_K) kept as stored: our torch decoder against the gguf package's, our packer's
round trip, every kernel (AVX2 and scalar, exact and int8) against dequantise-then-fp32, and the
exact-mode panel kernel (many rows) bit-identical to the row kernel for every format."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer_kernels import KernelInputError, quant

pytestmark = pytest.mark.skipif(not quant.available(), reason="native kernels did not build")

KFMTS = [quant.Q4_K, quant.Q6_K]
ALL_FMTS = [quant.Q4_0, quant.Q4_1, quant.Q8_0, quant.Q4_K, quant.Q6_K]
# relative error of a random matrix after pack -> decode, measured 0.079 (Q4_K: 15 levels plus a 6-bit
# scale and min per 32) and 0.019 (Q6_K: 63 levels, 8-bit scale per 16)
PACK_TOL = {quant.Q4_K: 0.10, quant.Q6_K: 0.03}
INT8_TOL = 0.02  # the activations rounded per 32-block (measured 0.004-0.007)
LEVELS = [0, 1] if quant.available() and quant.cpu_level() >= 1 else [0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("fmt", KFMTS)
def test_pack_round_trip(fmt):
    w = torch.randn(24, 512, generator=torch.Generator().manual_seed(fmt)) * 0.05
    qw = quant.pack(w, fmt)
    assert qw.nbytes == 24 * 2 * quant.FORMATS[fmt][1]
    ref = quant.dequantize_reference(qw)
    assert _rel(ref, w) < PACK_TOL[fmt]
    torch.testing.assert_close(quant.dequantize(qw), ref, rtol=1e-6, atol=1e-7)
    # a sub-block of zeros and a constant one decode exactly
    w2 = w.clone()
    w2[0, :32] = 0
    w2[1, 256:] = 0.25
    ref2 = quant.dequantize_reference(quant.pack(w2, fmt))
    assert torch.equal(ref2[0, :32], torch.zeros(32))
    torch.testing.assert_close(ref2[1, 256:], torch.full((256,), 0.25), rtol=2e-3, atol=0)


@pytest.mark.parametrize("fmt", KFMTS)
def test_reference_matches_gguf_package(fmt):
    """The gguf package's decoder (llama.cpp's definitions transcribed) reads our blocks as we do."""
    gq = pytest.importorskip("gguf.quants")
    import gguf

    qtype = gguf.GGMLQuantizationType(fmt)
    qw = quant.pack(torch.randn(8, 768, generator=torch.Generator().manual_seed(2)), fmt)
    theirs = torch.from_numpy(gq.dequantize(qw.data.numpy(), qtype).astype(np.float32)).reshape(8, 768)
    torch.testing.assert_close(quant.dequantize_reference(qw), theirs, rtol=0, atol=0)
    # and random bytes (every bit pattern of scales and quants, d kept finite) too
    raw = torch.randint(0, 256, (4, 3 * quant.FORMATS[fmt][1]), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    blocks = raw.view(4, 3, -1)
    half = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    if fmt == quant.Q4_K:
        blocks[..., 0:2] = half
        blocks[..., 2:4] = half
    else:
        blocks[..., 208:210] = half
    rq = quant.QuantWeight(raw, fmt, 4, 768)
    theirs = torch.from_numpy(gq.dequantize(raw.numpy(), qtype).astype(np.float32)).reshape(4, 768)
    torch.testing.assert_close(quant.dequantize_reference(rq), theirs, rtol=0, atol=0)
    torch.testing.assert_close(quant.dequantize(rq), theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("fmt", KFMTS)
@pytest.mark.parametrize("m", [1, 3, 4, 9])
def test_kernels_vs_dequantised_reference(fmt, m, level):
    gen = torch.Generator().manual_seed(10 * fmt + m)
    qw = quant.pack(torch.randn(37, 512, generator=gen), fmt)
    x = torch.randn(m, 512, generator=gen)
    ref = x.double() @ quant.dequantize_reference(qw).double().T
    exact = quant.qlinear(x, qw, mode="exact", level=level, panel=False)
    torch.testing.assert_close(exact.double(), ref, rtol=1e-5, atol=1e-4)
    int8 = quant.qlinear(x, qw, mode="int8", level=level)
    assert _rel(int8.double(), ref) < INT8_TOL
    bias = torch.randn(37, generator=gen)
    torch.testing.assert_close(quant.qlinear(x, qw, bias, mode="int8", level=level), int8 + bias)


@pytest.mark.parametrize("fmt", KFMTS)
def test_avx2_and_scalar_agree(fmt):
    if 1 not in LEVELS:
        pytest.skip("the CPU level lacks AVX2 + FMA + F16C: only the scalar code runs here")
    gen = torch.Generator().manual_seed(5)
    qw = quant.pack(torch.randn(33, 768, generator=gen), fmt)
    x = torch.randn(5, 768, generator=gen)
    for mode in quant.MODES:
        torch.testing.assert_close(quant.qlinear(x, qw, mode=mode, level=1), quant.qlinear(x, qw, mode=mode, level=0),
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", KFMTS)
@pytest.mark.parametrize("mode", quant.MODES)
def test_batch_invariant(fmt, mode):
    gen = torch.Generator().manual_seed(7)
    qw = quant.pack(torch.randn(70, 512, generator=gen), fmt)
    x = torch.randn(37, 512, generator=gen)
    full = quant.qlinear(x, qw, mode=mode)
    for k in (1, 2, 3, 4, 5, 17, 36):
        assert torch.equal(quant.qlinear(x[:k], qw, mode=mode), full[:k]), k
    assert torch.equal(quant.qlinear(x[20:21], qw, mode=mode), full[20:21])


@pytest.mark.parametrize("fmt", ALL_FMTS)
def test_panel_kernel_is_bit_identical_to_the_row_kernel(fmt):
    """Many rows run the panel kernel; its bits equal the row kernel's for every M, N % 3, odd M, strided x."""
    if 1 not in LEVELS:
        pytest.skip("the CPU level lacks AVX2 + FMA + F16C: the panel kernel is AVX2 code")
    gen = torch.Generator().manual_seed(fmt)
    k = 512
    for n in (30, 31, 32):
        qw = quant.pack(torch.randn(n, k, generator=gen), fmt)
        x = torch.randn(41, k + 64, generator=gen)[:, :k]  # rows k + 64 apart
        rows = quant.qlinear(x, qw, mode="exact", panel=False)
        panel = quant.qlinear(x, qw, mode="exact", panel=True)
        assert torch.equal(panel, rows), n
        ref = x.double() @ quant.dequantize_reference(qw).double().T
        torch.testing.assert_close(panel.double(), ref, rtol=1e-5, atol=1e-4)
        for m in (1, 2, 7):
            assert torch.equal(quant.qlinear(x[:m], qw, mode="exact", panel=True), rows[:m]), (n, m)
    assert quant.PANEL_M > 1  # the default switches paths on M: the bits above make that invisible


def test_kquant_shape_errors():
    with pytest.raises(KernelInputError, match="multiple of 256"):
        quant.pack(torch.randn(4, 96), quant.Q4_K)
    with pytest.raises(KernelInputError, match="multiple of 256"):
        quant.QuantWeight(torch.zeros(1, 144, dtype=torch.uint8), quant.Q4_K, 1, 128)
    with pytest.raises(KernelInputError, match="contiguous uint8"):
        quant.QuantWeight(torch.zeros(1, 144, dtype=torch.uint8), quant.Q6_K, 1, 256)
    assert quant.QuantWeight(torch.zeros(2, 420, dtype=torch.uint8), quant.Q6_K, 2, 512).format_name == "Q6_K"
