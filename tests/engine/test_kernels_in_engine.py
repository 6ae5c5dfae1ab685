"""The engine with deepinfer_kernels switched on (TileLang CPU twins here, GPU kernels on CUDA) gives
the same greedy outputs as with the torch implementations."""

from __future__ import annotations

import pytest

from deepinfer import Engine, SamplingParams
from test_engine_core import random_prompts

pytest.importorskip("tilelang")


def test_greedy_outputs_unchanged_with_kernels(tiny_models):
    path = str(tiny_models["llama"])
    prompts = random_prompts(6, seed=31, lo=5, hi=60)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = Engine(path, kv_cache_memory=8 << 20, block_size=16, kernels="torch").generate(prompts, sp)
    eng = Engine(path, kv_cache_memory=8 << 20, block_size=16, kernels="tilelang")
    assert eng.runner.decode_kernel is not None
    assert all(m.fused_add is not None for m in eng.runner.model.modules() if hasattr(m, "fused_add"))
    out = eng.generate(prompts, sp)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]


def test_auto_on_cpu_uses_native_kernels_not_the_tilelang_twins(tiny_models):
    from deepinfer_kernels import native

    eng = Engine(str(tiny_models["llama"]), kv_cache_memory=8 << 20)
    # the TileLang CPU twins measured slower than torch (dispatch table); the native C kernels faster
    assert eng.runner.decode_kernel is None
    norms = [m.fused_add for m in eng.runner.model.modules() if hasattr(m, "fused_add")]
    if native.available():
        assert eng.runner.token_attention is native.token_attention
        assert all(f is native.add_rmsnorm for f in norms)
    else:
        assert eng.runner.token_attention is None and all(f is None for f in norms)
