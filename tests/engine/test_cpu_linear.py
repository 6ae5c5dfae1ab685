"""engine/cpu_linear.py: projections on packed weights, native panels and oneDNN (values, strides,
batch invariance), and how the model runner chooses its linear op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer import Engine
from deepinfer.engine.cpu_linear import (
    CpuLinear, chunked_linear, native_available, native_gemm_preferred, onednn_available, packed_gemm_available,
)

pytestmark = pytest.mark.skipif(not packed_gemm_available(), reason="neither the native kernels nor oneDNN run here")

BACKENDS = [
    pytest.param("native", marks=pytest.mark.skipif(not native_available(), reason="native kernels not built")),
    pytest.param("onednn", marks=pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")),
]


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, k, generator=g) for n, k in ((96, 64), (64, 160), (1000, 64))], torch.randn(320, 64, generator=g)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [1, 3, 4, 5, 32, 200])
def test_values_match_f_linear(m, backend):
    ws, gu = _weights()
    lin = CpuLinear(ws, gated=[gu], backend=backend)
    for w in ws:
        x = torch.randn(m, w.shape[1])
        b = torch.randn(w.shape[0])
        assert torch.allclose(lin(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    x = torch.randn(m, 64)
    g, u = F.linear(x, gu).chunk(2, -1)
    assert torch.allclose(lin.silu_mul(x, gu), F.silu(g) * u, atol=1e-4, rtol=1e-4)


def test_single_row_gemv_output_has_plain_strides():
    # a [1, n] result with strides (1, 1) counts as contiguous but sent the next GEMV down a 3x slower path
    w = torch.randn(64, 32)
    y = chunked_linear(torch.randn(1, 32), w)
    assert y.shape == (1, 64) and y.stride() == (64, 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_invariant_mode_rows_do_not_depend_on_the_batch(backend):
    ws, gu = _weights(1)
    lin = CpuLinear(ws, invariant=True, gated=[gu], backend=backend)
    if not lin.verify_invariance(ws + [gu]):
        # the native GEMM is invariant by construction; oneDNN's depends on the build and threads
        assert backend == "onednn", "the native GEMM must be batch-invariant"
        pytest.skip("oneDNN's packed GEMM is not batch-invariant with this build/thread count (engine falls back)")
    for w in ws:
        x = torch.randn(70, w.shape[1])
        full = lin(x, w)
        for k in (1, 2, 3, 7, 16, 33, 69):
            assert torch.equal(lin(x[:k], w), full[:k]), (tuple(w.shape), k)
    x = torch.randn(70, 64)
    full = lin.silu_mul(x, gu)
    for k in (1, 2, 5, 40):
        assert torch.equal(lin.silu_mul(x[:k], gu), full[:k])


def test_invariant_mode_refuses_unpacked_weights_and_unknown_backends():
    with pytest.raises(ValueError, match="backend"):
        CpuLinear([], backend="mkl")
    lin = CpuLinear([], invariant=True)
    with pytest.raises(RuntimeError, match="unpacked"):
        lin(torch.randn(3, 8), torch.randn(4, 8))


def test_runner_picks_packed_linear_and_falls_back_when_not_invariant(tiny_models, monkeypatch):
    path = str(tiny_models["llama"])
    eng = Engine(path, kv_cache_memory=8 << 20)
    assert isinstance(eng.runner.linear, CpuLinear) and not eng.runner.linear.invariant
    assert eng.runner.linear.backend == ("native" if native_gemm_preferred() else "onednn")
    assert isinstance(Engine(path, kv_cache_memory=8 << 20, cpu_prepack=False).runner.linear, type(F.linear))
    bi = Engine(path, kv_cache_memory=8 << 20, batch_invariant=True)
    assert isinstance(bi.runner.linear, CpuLinear) and bi.runner.linear.invariant
    # where the start-up check fails, the batch-invariant mode uses the fixed-tile GEMM instead
    monkeypatch.setattr(CpuLinear, "verify_invariance", lambda self, ws: False)
    fallback = Engine(path, kv_cache_memory=8 << 20, batch_invariant=True)
    assert not isinstance(fallback.runner.linear, CpuLinear)
