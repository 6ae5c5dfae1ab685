"""Fused residual-add + RMSNorm: C twin vs torch reference, batch invariance, input errors."""

import pytest
import torch

from deepinfer_kernels import KernelInputError, fused_add_rmsnorm
from deepinfer_kernels.rmsnorm import fused_add_rmsnorm_reference, fused_add_rmsnorm_tilelang


def make(rows, hidden, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g) * 2
    r = torch.randn(rows, hidden, generator=g)
    w = torch.rand(hidden, generator=g) + 0.5
    return x, r, w


def test_reference_matches_the_textbook_formula():
    x, r, w = make(3, 64)
    normed, h = fused_add_rmsnorm_reference(x, r, w, 1e-6)
    hd = (x + r).double()
    expect = hd / torch.sqrt((hd * hd).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert torch.equal(h, x + r)
    assert torch.allclose(normed.double(), expect, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows,hidden", [(1, 576), (64, 576), (8, 4096), (5, 100)])
def test_twin_matches_reference(tilelang_available, rows, hidden):
    x, r, w = make(rows, hidden, seed=rows + hidden)
    ref_n, ref_h = fused_add_rmsnorm_reference(x, r, w, 1e-5)
    n, h = fused_add_rmsnorm_tilelang(x, r, w, 1e-5)
    assert torch.equal(h, ref_h)  # one IEEE add per element either way
    torch.testing.assert_close(n, ref_n, rtol=2e-6, atol=2e-6)


def test_twin_is_batch_invariant(tilelang_available):
    x, r, w = make(64, 576, seed=3)
    full, _ = fused_add_rmsnorm_tilelang(x, r, w, 1e-5)
    for i in (0, 31, 63):
        one, _ = fused_add_rmsnorm_tilelang(x[i : i + 1], r[i : i + 1], w, 1e-5)
        assert torch.equal(one[0], full[i])


def test_dispatch_handles_non_float32_on_cpu_with_torch():
    x, r, w = make(2, 64)
    n, h = fused_add_rmsnorm(x.bfloat16(), r.bfloat16(), w.bfloat16(), 1e-5)
    assert n.dtype == torch.bfloat16 and h.dtype == torch.bfloat16
    ref, _ = fused_add_rmsnorm_reference(x.bfloat16(), r.bfloat16(), w.bfloat16(), 1e-5)
    assert torch.equal(n, ref)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(residual=torch.zeros(2, 63)), "residual must have|residual shape"),
        (dict(weight=torch.ones(63)), r"weight.shape\[0\] must be 64"),
        (dict(eps=0.0), "eps must be a positive number"),
        (dict(x=torch.zeros(2, 64, dtype=torch.float64)), "x must have dtype"),
        (dict(x=torch.zeros(64)), "x must have 2 dims"),
    ],
)
def test_bad_inputs_raise_typed_errors(kw, match):
    x, r, w = make(2, 64)
    args = dict(x=x, residual=r, weight=w, eps=1e-5)
    args.update(kw)
    with pytest.raises(KernelInputError, match=match):
        fused_add_rmsnorm(**args)
