"""The engine on CPU with the native kernels (kernels="auto": C token attention + fused add/RMSNorm)
gives the same greedy tokens as the torch implementations (kernels="torch"), across decode, short
prefill chunks (native), long ones (SDPA), chunked prefill and prefix-cache hits."""

from __future__ import annotations

import pytest

from deepinfer import Engine, SamplingParams
from deepinfer_kernels import native
from test_engine_core import random_prompts

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: native kernels not built")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_native_kernels_keep_greedy_outputs(tiny_models, arch):
    path = str(tiny_models[arch])
    shared = random_prompts(1, seed=5, lo=70, hi=71)[0]
    prompts = random_prompts(5, seed=41, lo=3, hi=20) + random_prompts(3, seed=42, lo=80, hi=150)
    prompts += [shared + p for p in random_prompts(3, seed=43, lo=2, hi=9)]  # prefix-cache hits
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    kw = dict(kv_cache_memory=8 << 20, max_num_batched_tokens=96)  # long prompts prefill in chunks
    ref = Engine(path, kernels="torch", **kw)
    assert ref.runner.token_attention is None
    eng = Engine(path, **kw)
    assert eng.runner.token_attention is native.token_attention
    out, want = eng.generate(prompts, sp), ref.generate(prompts, sp)
    assert [o.token_ids for o in out] == [o.token_ids for o in want]
    for o, w in zip(out, want):
        assert len(o.logprobs) == len(w.logprobs) == 10
        for a, b in zip(o.logprobs, w.logprobs):
            assert abs(a.logprob - b.logprob) < 1e-4
