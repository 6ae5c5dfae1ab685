"""csrc/gemm_bf16dot.c (native.linear / gated_linear on panels packed with bf16_dot=True): x and W rounded
to bf16, products summed in fp32 in the order vdpbf16ps uses, checked against

* a brute-force torch emulation of that order (fp32 tensors, one pair of k per step: each bf16 x bf16
  product is exact in fp32, so each step's two roundings are the adds, as in the kernel): bit for bit;
* float64 on the bf16-rounded inputs, within the rounding bound of a K-term fp32 sum, 2 K 2^-24 sum|x w|;
* the kernel's widening fallback (set_bf16_dot_cap(0), what runs without AVX512_BF16): bit for bit on
  data with no subnormal products or partial sums (the only place vdpbf16ps and the fallback differ).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer_kernels import KernelInputError, native

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built")

SHAPES = [(1, 1, 1), (1, 5, 3), (7, 47, 64), (9, 49, 7), (8, 48, 96), (17, 100, 577), (33, 96, 130), (130, 97, 64)]


@pytest.fixture
def fallback():
    """run(fn, *args): fn(*args) with the kernel forced to its widening fallback, the cap lifted after."""
    def run(fn, *args):
        native.set_bf16_dot_cap(0)
        try:
            assert native.bf16_dot_level() == 0
            return fn(*args)
        finally:
            native.set_bf16_dot_cap(None)
    yield run
    native.set_bf16_dot_cap(None)


def _bf(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


def _emulate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T the kernel's way in fp32: for each pair j, acc += x[2j+1] w[2j+1], then acc += x[2j] w[2j]."""
    xb, wb = _bf(x), _bf(w)
    k = x.shape[1]
    acc = torch.zeros(x.shape[0], w.shape[0])
    for j in range(0, k, 2):
        if j + 1 < k:
            acc = acc + xb[:, j + 1, None] * wb[None, :, j + 1]
        acc = acc + xb[:, j, None] * wb[None, :, j]
    return acc


def _case(m: int, n: int, k: int, seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g) * scale, torch.randn(n, k, generator=g) * 0.1, torch.randn(n, generator=g)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_linear_equals_the_emulated_order_and_float64_within_the_sum_bound(m, n, k):
    x, w, b = _case(m, n, k, m * 1000 + n * 10 + k)
    pw = native.pack_weight(w, bf16_dot=True)
    assert pw.bf16_dot and pw.panels.dtype == torch.bfloat16
    y = native.linear(x, pw)
    assert torch.equal(y, _emulate(x, w))
    assert torch.equal(native.linear(x, pw, b), y + b)  # the bias is one add after the sum
    ref = _bf(x).double() @ _bf(w).double().T
    bound = 2 * k * 2.0 ** -24 * (_bf(x).double().abs() @ _bf(w).double().abs().T)
    assert ((y.double() - ref).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_gated_linear(m, n, k):
    x, w, _ = _case(m, 2 * n, k, m + n + k)
    y = native.gated_linear(x, native.pack_gated_weight(w, bf16_dot=True))
    gu = _emulate(x, w)  # the two halves' sums, bit for bit the kernel's
    want = F.silu(gu[:, :n].double()) * gu[:, n:].double()
    # silu16 (vec16.h) is within a few ulp of silu: relative 1e-5 plus a floor for products near 0
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_fallback_is_bit_identical_to_vdpbf16ps(m, n, k, fallback):
    if native.bf16_dot_level() == 0:
        pytest.skip("the CPU level lacks AVX512_BF16: only the fallback runs here (compared with the emulation above)")
    x, w, b = _case(m, 2 * n, k, 7 * m + n + k)
    pw, pg = native.pack_weight(w, bf16_dot=True), native.pack_gated_weight(w, bf16_dot=True)
    assert torch.equal(fallback(native.linear, x, pw, b), native.linear(x, pw, b))
    assert torch.equal(fallback(native.gated_linear, x, pg), native.gated_linear(x, pg))


def test_fallback_equals_the_emulated_order(fallback):
    x, w, _ = _case(19, 53, 201, 5)
    assert torch.equal(fallback(native.linear, x, native.pack_weight(w, bf16_dot=True)), _emulate(x, w))


def test_rows_do_not_depend_on_the_batch():
    x, w, b = _case(70, 100, 577, 11)
    pw, pg = native.pack_weight(w, bf16_dot=True), native.pack_gated_weight(w, bf16_dot=True)
    full, gfull = native.linear(x, pw, b), native.gated_linear(x, pg)
    for lo, hi in [(0, 1), (5, 6), (3, 12), (8, 17), (0, 33), (40, 70)]:
        assert torch.equal(native.linear(x[lo:hi], pw, b), full[lo:hi])
        assert torch.equal(native.gated_linear(x[lo:hi], pg), gfull[lo:hi])


def test_rounding_of_x_nan_inf_ties_and_subnormals():
    # one weight of 1.0 and K = 1: y = bf16(x) exactly
    vals = torch.tensor([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8), 3.4e38, -3.4e38, float("inf"),
                         float("-inf"), 1e-40, -1e-40, 2.0 ** -126, 0.0, -0.0, 1.0 / 3])
    pw = native.pack_weight(torch.ones(1, 1), bf16_dot=True)
    y = native.linear(vals[:, None], pw)[:, 0]
    want = vals.bfloat16().float()
    want[7:9] = 0.0  # fp32 subnormals flush to zero (as vdpbf16ps reads bf16 subnormals)
    assert torch.equal(y, want)
    assert y[0] == 1.0 and y[1] == 1 + 2.0 ** -6  # ties to even, both ways
    assert y[3] == float("inf") and y[4] == float("-inf")  # past bf16's largest finite (3.39e38) and half an ulp: infinite
    assert torch.isnan(native.linear(torch.tensor([[float("nan")]]), pw)).all()


def test_packing_rounds_every_source_dtype_the_same_way():
    w = torch.randn(50, 33) * 0.1
    w[0, 0] = 1e-40  # an fp32 subnormal: flushed
    w[1, 1] = -2.0 ** -130
    fp32, bf16 = native.pack_weight(w, bf16_dot=True), native.pack_weight(w.bfloat16(), bf16_dot=True)
    assert torch.equal(fp32.panels, bf16.panels)
    assert native.to_bf16_dot(w)[0, 0] == 0 and native.to_bf16_dot(w)[1, 1] == 0
    assert torch.equal(native.to_bf16_dot(w.half()), w.half().bfloat16())
    # the widening build reads the same panels exactly: its result is fp32 arithmetic on bf16 weights
    widen = native.PackedWeight(fp32.panels, fp32.n, fp32.k, False)
    x = torch.randn(3, 33)
    torch.testing.assert_close(native.linear(x, widen), x @ native.to_bf16_dot(w).float().T, rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise_kernel_input_errors():
    pw = native.pack_weight(torch.randn(8, 16), bf16_dot=True)
    with pytest.raises(KernelInputError):
        native.linear(torch.randn(2, 15), pw)
    with pytest.raises(KernelInputError):
        native.linear(torch.randn(2, 16).double(), pw)
    with pytest.raises(KernelInputError):
        native.gated_linear(torch.randn(2, 16), pw)
    with pytest.raises(KernelInputError):
        native.pack_weight(torch.randn(8, 16).double(), bf16_dot=True)
    assert native.linear(torch.randn(0, 16), pw).shape == (0, 8)
