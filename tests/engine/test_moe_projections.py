"""engine/native_projections.py: MLA's projections and the MoE routers on the native expert tile (CPU
fp32, where the runner's linear is not the native panel GEMM): installed once and not packed twice,
the same projections as the torch definition, row-invariant, and the engine's greedy tokens the same
as without them."""

from __future__ import annotations

import pytest
import torch

from deepinfer import Engine, SamplingParams
from deepinfer.engine.attention import ForwardContext
from deepinfer.engine.models.mla import MlaAttention
from deepinfer.engine.models.moe import MoeBlock
from deepinfer_kernels import moe_gemm
from moe_factory import make_moe_model

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not moe_gemm.available(), reason="no C compiler: native kernels not built")


@pytest.fixture(scope="module")
def v3_path(tmp_path_factory):
    return make_moe_model(tmp_path_factory.mktemp("moe_proj") / "v3", "deepseek_v3", seed=5)


def _engine(path, monkeypatch, preferred: bool) -> Engine:
    # the install depends on whether the runner's linear is the native panel GEMM: pin it either way
    monkeypatch.setattr("deepinfer.engine.cpu_linear.native_gemm_preferred", lambda: preferred)
    return Engine(str(path), kv_cache_memory=1 << 20)


def _mods(eng: Engine):
    ms = list(eng.runner.model.modules())
    return [m for m in ms if isinstance(m, MlaAttention)], [m for m in ms if isinstance(m, MoeBlock)]


def test_installed_once_and_not_packed_for_the_linear(v3_path, monkeypatch):
    eng = _engine(v3_path, monkeypatch, preferred=False)
    mlas, blocks = _mods(eng)
    assert mlas and blocks
    assert all(set(m.kernels) == set(m.projection_weights()) for m in mlas)
    assert all(b.router_kernel is not None for b in blocks)
    packed = set(getattr(eng.runner.linear, "packed", {}))
    moved = {w.data_ptr() for m in mlas for w in (m.kv_a_weight, m.o_weight, getattr(m, "q_b_weight", m.o_weight))}
    moved |= {b.gate_weight.data_ptr() for b in blocks}
    assert packed and not packed & moved, "weights on a native projection were also packed for the linear"
    # the absorbed per-head slices stay on the linear
    assert {w.data_ptr() for w in mlas[0].uk_t} <= packed


def test_not_installed_where_the_native_gemm_is_the_linear(v3_path, monkeypatch):
    eng = _engine(v3_path, monkeypatch, preferred=True)
    mlas, blocks = _mods(eng)
    assert all(len(m.kernels) == 0 for m in mlas) and all(b.router_kernel is None for b in blocks)


@pytest.mark.parametrize("tokens", [1, 6, 37])
def test_projections_match_torch_and_are_row_invariant(v3_path, monkeypatch, tokens):
    eng = _engine(v3_path, monkeypatch, preferred=False)
    mlas, blocks = _mods(eng)
    m, b = mlas[0], blocks[0]
    lin = eng.runner.linear
    meta = ForwardContext(slot_mapping=torch.empty(0, dtype=torch.long), linear=lin, silu_mul=None)
    x = torch.randn(tokens, m.o_weight.shape[0], generator=torch.Generator().manual_seed(tokens))
    q, ckv = m._down(x, meta)
    q_w = m.q_weight if m.q_lora is None else m.q_a_weight
    torch.testing.assert_close(q, x @ q_w.t(), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(ckv, x @ m.kv_a_weight.t(), atol=2e-5, rtol=1e-4)
    assert torch.equal(m._down(x[-1:], meta)[1][0], ckv[-1])
    o_in = torch.randn(tokens, m.o_weight.shape[1], generator=torch.Generator().manual_seed(7))
    o = m._proj("o", o_in, m.o_weight, meta)
    torch.testing.assert_close(o, o_in @ m.o_weight.t(), atol=2e-5, rtol=1e-4)
    logits = b.router_kernel(x)
    torch.testing.assert_close(logits, x @ b.gate_weight.t(), atol=2e-5, rtol=1e-4)
    assert torch.equal(b.router_kernel(x[:1])[0], logits[0])


def test_greedy_tokens_same_with_and_without(v3_path, monkeypatch):
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 9, 14, 3, 22, 7], [11, 4, 30, 2, 8, 19, 6, 1, 25]]
    new = [o.token_ids for o in _engine(v3_path, monkeypatch, preferred=False).generate(prompts, sp)]
    old = [o.token_ids for o in _engine(v3_path, monkeypatch, preferred=True).generate(prompts, sp)]
    assert new == old


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_gqa_projections_of_qwen_moe_models(tmp_path, monkeypatch, arch):
    from deepinfer.engine.models.layers import Attention

    path = make_moe_model(tmp_path / arch, arch, seed=6)
    eng = _engine(path, monkeypatch, preferred=False)
    attns = [m for m in eng.runner.model.modules() if isinstance(m, Attention)]
    assert attns and all(set(a.kernels) == {"qkv", "o"} for a in attns)
    packed = set(getattr(eng.runner.linear, "packed", {}))
    assert not packed & {w.data_ptr() for a in attns for w in (a.qkv_weight, a.o_weight)}
    a = attns[0]
    meta = ForwardContext(slot_mapping=torch.empty(0, dtype=torch.long), linear=eng.runner.linear, silu_mul=None)
    x = torch.randn(5, a.qkv_weight.shape[1], generator=torch.Generator().manual_seed(1))
    ref = x @ a.qkv_weight.t() + (a.qkv_bias if a.qkv_bias is not None else 0)
    torch.testing.assert_close(a._proj("qkv", x, a.qkv_weight, a.qkv_bias, meta), ref, atol=2e-5, rtol=1e-4)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [[5, 9, 14, 3, 22, 7], [11, 4, 30, 2, 8, 19, 6, 1, 25]]
    new = [o.token_ids for o in eng.generate(prompts, sp)]
    old = [o.token_ids for o in _engine(path, monkeypatch, preferred=True).generate(prompts, sp)]
    assert new == old
