"""Backend selection: env var, context manager, auto table, fallback with one warning."""

import warnings

import pytest
import torch

from deepinfer_kernels import KernelConfigError, dispatch, masked_sample, selected_backend, use_backend
from deepinfer_kernels import sampling


@pytest.fixture(autouse=True)
def _clean_failures():
    dispatch._failed.clear()
    yield
    dispatch._failed.clear()


def test_env_var_and_context_manager(monkeypatch):
    monkeypatch.setenv("DEEPINFER_KERNELS", "torch")
    assert selected_backend("masked_sample", "cpu") == "torch"
    with use_backend("tilelang"):
        assert selected_backend("masked_sample", "cpu") == "tilelang"
        with use_backend("torch"):
            assert selected_backend("fused_add_rmsnorm", "cpu") == "torch"
        assert selected_backend("fused_add_rmsnorm", "cpu") == "tilelang"
    assert selected_backend("masked_sample", "cpu") == "torch"


def test_auto_follows_the_table(monkeypatch, tilelang_available):
    monkeypatch.delenv("DEEPINFER_KERNELS", raising=False)
    for (op, dev), choice in dispatch.AUTO_TABLE.items():
        assert selected_backend(op, dev) == choice


def test_bad_backend_names_raise(monkeypatch):
    monkeypatch.setenv("DEEPINFER_KERNELS", "cuda-magic")
    with pytest.raises(KernelConfigError, match="DEEPINFER_KERNELS must be one of"):
        selected_backend("masked_sample", "cpu")
    with pytest.raises(KernelConfigError, match="use_backend"):
        with use_backend("fast"):
            pass
    with pytest.raises(KernelConfigError, match="unknown op"):
        selected_backend("softmax", "cpu")


def _inputs():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    return logits, None, torch.tensor([0.0, 0.5, 1.0, 2.0]), torch.arange(4, dtype=torch.int64)


def test_backends_agree_bitwise(tilelang_available):
    with use_backend("torch"):
        a = masked_sample(*_inputs())
    with use_backend("tilelang"):
        b = masked_sample(*_inputs())
    assert torch.equal(a, b)


def test_auto_falls_back_to_torch_with_one_warning(monkeypatch):
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("simulated build failure")

    monkeypatch.setattr(sampling, "masked_sample_tilelang", broken)
    monkeypatch.setattr(dispatch._tilelang, "_WARNED", False)
    monkeypatch.setattr(dispatch._tilelang, "available", lambda: True)
    expected = sampling.masked_sample_reference(*(_inputs()[0],), torch.full((4, 10), -1, dtype=torch.int32), *_inputs()[2:])
    with use_backend("auto"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = masked_sample(*_inputs())
        second = masked_sample(*_inputs())
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert len(calls) == 1  # the failure is remembered: no retry on the per-step path
    assert len([w for w in caught if "falling back" in str(w.message)]) == 1
    with use_backend("tilelang"), pytest.raises(RuntimeError, match="simulated"):
        masked_sample(*_inputs())


def test_missing_tilelang_means_torch_with_one_warning(monkeypatch):
    monkeypatch.setattr(dispatch._tilelang, "available", lambda: False)
    monkeypatch.setattr(dispatch._tilelang, "import_error", lambda: ImportError("no tilelang here"))
    monkeypatch.setattr(dispatch._tilelang, "_WARNED", False)
    with use_backend("auto"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert selected_backend("masked_sample", "cpu") == "torch"
        assert selected_backend("masked_sample", "cuda") == "torch"
        out = masked_sample(*_inputs())
    assert out.shape == (4,)
    assert len([w for w in caught if "no tilelang here" in str(w.message)]) == 1


def test_warmup_compiles_ahead_so_steps_do_not(tilelang_available):
    with use_backend("tilelang"):
        dispatch.warmup("cpu", vocab_size=500, hidden=64, eps=1e-6,
                        attention=dict(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, scale=0.125))
        compiled = dict(dispatch._tilelang.COMPILE_SECONDS)
        assert ("masked_sample", "c") in compiled and ("rmsnorm", "c", 64, 1e-6) in compiled
        masked_sample(torch.randn(3, 777), None, torch.ones(3), torch.arange(3, dtype=torch.int64))
        dispatch.fused_add_rmsnorm(torch.randn(5, 64), torch.randn(5, 64), torch.ones(64), 1e-6)
        assert dispatch._tilelang.COMPILE_SECONDS == compiled  # other sizes, same shape class
