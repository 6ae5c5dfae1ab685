"""Engine(dtype="bfloat16") on CPU with the native kernels: activations, norms, attention and the KV cache
in fp32, every projection (and a tied LM head) packed once into bf16 panels and run as bf16 dot products
with fp32 accumulation (csrc/gemm_bf16dot.c through weights16.py's bf16_dot), no fp32 copy kept.

Tolerance against dtype="float32": bf16 keeps 8 significant bits, so each projection's inputs carry a
relative rounding error up to 2^-9 (x and W both rounded); on these tiny random models (2 layers, logits
with a spread of ~0.6) the prefill logprobs differed from fp32's by at most 0.016-0.028 when this was
written. The tests allow 0.08 (about 3x that) and check the difference is not zero (a silent fp32 run
would pass a tolerance alone). The batch-invariant needle test in bfloat16 mode is in
test_batch_invariance.py."""

from __future__ import annotations

import pytest
import torch

from deepinfer import Engine, SamplingParams
from deepinfer.engine.forward_batch import ForwardBatch
from deepinfer.engine.placeholder import is_placeholder
from deepinfer.engine.weights16 import bf16_dot_available
from model_factory import make_tiny_model
from test_engine_core import random_prompts

pytestmark = pytest.mark.skipif(not bf16_dot_available(), reason="bf16 dot products run only at the avx512 level (AVX-512F)")

KW = dict(kv_cache_memory=8 << 20)
TOL = 0.08  # max |logprob difference| against float32 (see the module docstring)


@pytest.fixture(scope="module")
def ckpts(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16dot")
    return {
        "llama-fp32": tiny_models["llama"],
        "qwen2-fp32-tied-bias": tiny_models["qwen2"],
        "llama-bf16-tied": make_tiny_model(root / "llama-bf16", "llama", tie=True, dtype=torch.bfloat16),
        "llama-f16": make_tiny_model(root / "llama-f16", "llama", dtype=torch.float16),
    }


def _all_logprobs(eng: Engine, ids: list[int]) -> torch.Tensor:
    """log_softmax of the logits of every position of one prefill of `ids` through the engine's runner."""
    bs = eng.config.block_size
    batch = ForwardBatch.build([ids], [0], [list(range(-(-len(ids) // bs)))], list(range(len(ids))), bs)
    return torch.log_softmax(eng.runner.forward(eng.runner.prepare(batch)).double(), -1)


@pytest.mark.parametrize("key", ["llama-fp32", "qwen2-fp32-tied-bias", "llama-bf16-tied", "llama-f16"])
def test_bfloat16_runs_bf16_panels_within_tolerance_of_float32(ckpts, key):
    from deepinfer_kernels import native

    path = str(ckpts[key])
    bf, f32 = Engine(path, dtype="bfloat16", **KW), Engine(path, dtype="float32", **KW)
    assert bf.precision == "bfloat16-dot" and f32.precision == "float32"
    lin = bf.runner.linear
    panels = [*lin.packed.values(), *lin.packed_gated.values()]
    assert panels and all(pw.bf16_dot and pw.panels.dtype == torch.bfloat16 for pw in panels)
    # the panels hold the weights rounded to bf16 once (from fp32, bf16 or fp16 as stored)
    f32_pw = f32.runner.linear.packed[f32.runner.model.layers[0].mlp.down_weight.data_ptr()]
    w = native.packed_rows(f32_pw, torch.arange(f32_pw.n))  # (the float32 engine's one copy is its panels too)
    pw = lin.packed[bf.runner.model.layers[0].mlp.down_weight.data_ptr()]
    assert torch.equal(native.packed_rows(pw, torch.arange(w.shape[0])), native.to_bf16_dot(w).float())
    # no fp32 copy of a projection; activations stay fp32, the KV cache is bf16 (kv_cache_dtype "auto")
    m = bf.runner.model
    assert all(is_placeholder(w) for w in m.linear_weights() + m.gated_weights())
    assert bf.runner.dtype == torch.float32 and bf.runner.kv_cache.dtype == torch.bfloat16
    assert bf.kv_cache_dtype == "bfloat16" and f32.kv_cache_dtype == "float32"
    assert bf.stats.weight_bytes < 0.6 * f32.stats.weight_bytes
    # prefill: every position's logprobs
    ids = bf.encode_prompt("the quick brown fox jumps over the lazy dog " * 3)
    d = (_all_logprobs(bf, ids) - _all_logprobs(f32, ids)).abs().max().item()
    assert 0 < d <= TOL, d
    # decode steps: each generated token's logprob against fp32 teacher-forced on the same tokens
    prompts = random_prompts(4, seed=5, lo=3, hi=30)
    outs = bf.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1))
    for p, o in zip(prompts, outs):
        ref = f32.generate([o.prompt_token_ids + o.token_ids],
                           SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
        ref = ref[len(o.prompt_token_ids):]
        assert [r.token_id for r in ref] == o.token_ids
        diffs = [abs(a.logprob - r.logprob) for a, r in zip(o.logprobs, ref)]
        assert max(diffs) <= TOL, diffs


def test_bfloat16_is_batch_invariant_at_every_size(ckpts):
    """The kernel's order per output does not depend on the batch: a prompt's logprobs alone equal its
    logprobs in batches of 2..12 others, bitwise (batch_invariant mode: invariant attention too)."""
    eng = Engine(str(ckpts["qwen2-fp32-tied-bias"]), dtype="bfloat16", batch_invariant=True, block_size=4,
                 kv_cache_memory=16 << 20)
    assert eng.precision == "bfloat16-dot"
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    needle = "the quick brown fox jumps over the lazy dog and the cat"
    ref = eng.generate([needle], sp)[0]
    for n in (2, 5, 12):
        out = eng.generate(random_prompts(n - 1, seed=n) + [needle], sp)[-1]
        assert out.token_ids == ref.token_ids
        assert [(l.logprob, l.top) for l in out.logprobs] == [(l.logprob, l.top) for l in ref.logprobs]


def test_float32_and_auto_unchanged(ckpts):
    assert Engine(str(ckpts["llama-fp32"]), dtype="float32", **KW).precision == "float32"
    assert Engine(str(ckpts["llama-fp32"]), **KW).precision == "float32"
    assert Engine(str(ckpts["llama-bf16-tied"]), **KW).precision == "bfloat16-weights"


def test_bfloat16_without_prepack_falls_back_to_torch_bf16_with_a_warning(ckpts):
    with pytest.warns(RuntimeWarning, match="torch's bf16 ops"):
        eng = Engine(str(ckpts["llama-fp32"]), dtype="bfloat16", cpu_prepack=False, **KW)
    assert eng.precision == "bfloat16" and eng.runner.kv_cache.dtype == torch.bfloat16
    assert len(eng.generate(["hello world"], SamplingParams(temperature=0, max_tokens=3))[0].token_ids) == 3


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "qwen2_moe"])
def test_bfloat16_on_a_moe_model_runs_bf16_dot_products(tmp_path, arch):
    """An MoE model (MLA included) in dtype="bfloat16": every gated MLP (routed experts, shared experts,
    dense layers) on the grouped expert kernel's bf16-dot build, the other projections on bf16-dot
    panels, the routers (and Qwen2-MoE's shared-expert gates) in fp32; activations, norms, attention
    and (kv_cache_dtype="float32", so the products' error is measured alone) the KV cache fp32. Within
    TOL of float32, not equal to it, and batch-invariant. The KV cache "auto" picks is
    tests/engine/test_kv_cache_dtype.py's."""
    from deepinfer.engine.expert_kernels import NativeExperts, NativeGatedMlp
    from deepinfer.engine.models.moe import MoeBlock
    from moe_factory import make_moe_model

    path = str(make_moe_model(tmp_path / arch, arch, seed=2))
    bf = Engine(path, dtype="bfloat16", block_size=4, kv_cache_dtype="float32", **KW)
    f32 = Engine(path, dtype="float32", block_size=4, **KW)
    assert bf.precision == "bfloat16-dot" and bf.runner.kv_cache.dtype == torch.float32
    mods = list(bf.runner.model.modules())
    experts = [m for m in mods if isinstance(m, NativeExperts)]
    assert experts and all(m.bf16_dot for m in experts)
    assert all(m._packed.bf16_dot for m in mods if isinstance(m, NativeGatedMlp))
    lin = bf.runner.linear
    routers = {w.data_ptr() for m in mods if isinstance(m, MoeBlock) for w in (m.gate_weight, m.shared_gate_weight)
               if w is not None}
    assert routers and all(not lin.packed[p].bf16_dot for p in routers)
    assert any(pw.bf16_dot for p, pw in lin.packed.items() if p not in routers)
    ids = bf.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then")
    diff = (_all_logprobs(bf, ids) - _all_logprobs(f32, ids)).abs().max().item()
    assert 0 < diff <= TOL, diff
    # batch-invariant: each prompt alone gets the batch's tokens and logprobs, bit for bit
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    prompts = random_prompts(5, seed=3)
    batch = bf.generate(prompts, sp)
    for p, out in zip(prompts, batch):
        ref = bf.generate([p], sp)[0]
        assert out.token_ids == ref.token_ids
        assert [(l.logprob, l.top) for l in out.logprobs] == [(l.logprob, l.top) for l in ref.logprobs]


def test_bfloat16_on_a_moe_model_without_the_expert_kernel_falls_back_with_a_warning(tmp_path):
    from moe_factory import make_moe_model

    path = make_moe_model(tmp_path / "qwen3_moe", "qwen3_moe", seed=2)
    with pytest.warns(RuntimeWarning, match="torch's bf16 ops"):
        eng = Engine(str(path), dtype="bfloat16", kernels="torch", **KW)
    assert eng.precision == "bfloat16" and eng.runner.kv_cache.dtype == torch.bfloat16
    assert len(eng.generate(["hello world"], SamplingParams(temperature=0, max_tokens=3))[0].token_ids) == 3