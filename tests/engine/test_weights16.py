"""bf16 / fp16 checkpoints on CPU under dtype="auto": projections kept in 16-bit panels (weights16.py),
computing bit for bit what Engine(dtype="float32") computes on the same checkpoint, batch-invariant,
with resident weights about the checkpoint's bytes."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import Engine, SamplingParams
from deepinfer.engine.cpu_linear import native_gemm_preferred
from deepinfer.engine.forward_batch import ForwardBatch
from deepinfer.engine.placeholder import is_placeholder
from model_factory import make_tiny_model
from test_engine_core import WORDS, assert_all_blocks_free, random_prompts

pytestmark = pytest.mark.skipif(not native_gemm_preferred(), reason="the native kernels did not build (16-bit panels are native)")

KW = dict(kv_cache_memory=8 << 20)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("w16")
    # llama-bf16: every projection a whole number of 48-column panels and short rotary tables, so its
    # resident bytes are the checkpoint's (the others pad panels: 64 columns take 96)
    aligned = dict(hidden_size=96, intermediate_size=192, max_position_embeddings=64)
    return {
        ("llama", torch.bfloat16): make_tiny_model(root / "llama-bf16", "llama", dtype=torch.bfloat16, **aligned),
        ("qwen2", torch.bfloat16): make_tiny_model(root / "qwen2-bf16", "qwen2", tie=True, dtype=torch.bfloat16),
        ("llama", torch.float16): make_tiny_model(root / "llama-f16", "llama", tie=True, dtype=torch.float16),
    }


def _all_logits(eng: Engine, ids: list[int]) -> torch.Tensor:
    """Logits of every position of one prefill of `ids` through the engine's runner."""
    bs = eng.config.block_size
    batch = ForwardBatch.build([ids], [0], [list(range(-(-len(ids) // bs)))], list(range(len(ids))), bs)
    return eng.runner.forward(eng.runner.prepare(batch))


@pytest.mark.parametrize("key", [("llama", torch.bfloat16), ("qwen2", torch.bfloat16), ("llama", torch.float16)],
                         ids=["llama-bf16", "qwen2-bf16-tied-bias", "llama-f16-tied"])
def test_auto_keeps_16bit_panels_and_matches_float32_bitwise(ckpts, key):
    path = str(ckpts[key])
    auto, f32 = Engine(path, **KW), Engine(path, dtype="float32", **KW)
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[key[1]]
    assert auto.precision == f"{name}-weights" and f32.precision == "float32"
    lin = auto.runner.linear
    assert all(pw.panels.dtype == key[1] for pw in [*lin.packed.values(), *lin.packed_gated.values()])
    # no fp32 copy of a projection is held: the model's parameters are placeholders (or the untied
    # embedding, kept 16-bit), and the runner's dtype (activations, KV cache) stays fp32
    m = auto.runner.model
    assert all(is_placeholder(w) for w in m.linear_weights() + m.gated_weights())
    assert m.embed_tokens.dtype == key[1] or is_placeholder(m.embed_tokens)
    assert auto.runner.kv_cache.dtype == torch.float32
    # resident weights: half the fp32 engine's packed copy; at most 1.2x the checkpoint's bytes
    # where the shapes fill whole panels (fp32 panels hold 2x or more)
    assert auto.stats.weight_bytes < 0.6 * f32.stats.weight_bytes
    assert f32.stats.weight_bytes >= 2 * auto.stats.checkpoint_bytes
    if key == ("llama", torch.bfloat16):
        assert auto.stats.weight_bytes <= 1.2 * auto.stats.checkpoint_bytes
    # widening is exact and the kernel's order is the fp32 kernel's: the same bits
    ids = auto.encode_prompt("the quick brown fox jumps over the lazy dog " * 3)
    assert torch.equal(_all_logits(auto, ids), _all_logits(f32, ids))
    prompts = random_prompts(6, seed=3, lo=3, hi=40)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    a, b = auto.generate(prompts, sp), f32.generate(prompts, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [[(l.logprob, l.top) for l in o.logprobs] for o in a] == [[(l.logprob, l.top) for l in o.logprobs] for o in b]


def test_fp32_checkpoint_under_auto_stays_fp32(tiny_models):
    eng = Engine(str(tiny_models["llama"]), **KW)
    assert eng.precision == "float32"
    # fp32 panels (an fp32 value is not a bf16 one), the panels the projections' only copy
    lin = eng.runner.linear
    assert lin.packed and all(pw.panels.dtype == torch.float32 for pw in [*lin.packed.values(), *lin.packed_gated.values()])
    assert all(is_placeholder(w) for w in eng.runner.model.linear_weights())


def test_tied_fp32_embedding_is_looked_up_in_the_lm_head_panels(tmp_path):
    """A tied embedding is the LM head's matrix: its lookups read the packed panels (the same fp32
    values), so the checkpoint's largest tensor is not held twice."""
    from safetensors.torch import load_file

    aligned = dict(hidden_size=96, intermediate_size=192, max_position_embeddings=64)
    path = make_tiny_model(tmp_path / "qwen2-tied", "qwen2", tie=True, **aligned)
    eng = Engine(str(path), **KW)
    m = eng.runner.model
    assert eng.precision == "float32" and m.lm_head is None and is_placeholder(m.embed_tokens)
    table = load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"].float()
    ids = torch.randperm(table.shape[0])[:50].view(5, 10)
    assert torch.equal(m.embed(ids), table[ids])
    # projections, LM head and embedding in whole panels: the checkpoint's bytes plus norms and rotary tables
    assert eng.stats.weight_bytes <= 1.05 * eng.stats.checkpoint_bytes, (eng.stats.weight_bytes, eng.stats.checkpoint_bytes)
    # and it generates what the unpacked fp32 engine (oneDNN on the matrices themselves) generates
    ref = Engine(str(path), cpu_prepack=False, **KW)
    assert not is_placeholder(ref.runner.model.embed_tokens)
    prompts = random_prompts(4, seed=5, lo=3, hi=20)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == [o.token_ids for o in ref.generate(prompts, sp)]


def test_16bit_storage_is_batch_invariant(ckpts):
    eng = Engine(str(ckpts[("llama", torch.bfloat16)]), kv_cache_memory=16 << 20, block_size=4,
                 batch_invariant=True, max_num_batched_tokens=96)
    assert eng.precision == "bfloat16-weights"
    r = random.Random(3)
    needle = "the quick brown fox jumps over the lazy dog and " + " ".join(r.choice(WORDS) for _ in range(30))
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    ref = eng.generate([needle], sp)[0]
    for t in range(12):
        n = r.randint(2, 40)
        pos = r.randint(0, n - 1)
        prompts = [" ".join(r.choice(WORDS) for _ in range(r.randint(1, 50))) for _ in range(n - 1)]
        prompts.insert(pos, needle)
        params = [SamplingParams(temperature=0.7, max_tokens=r.randint(1, 12), seed=i) for i in range(n)]
        params[pos] = sp
        if r.random() < 0.5:
            eng.reset_prefix_cache()
        out = eng.generate(prompts, params)[pos]
        assert out.token_ids == ref.token_ids, f"trial {t}: tokens differ in a batch of {n} at {pos}"
        assert [(l.logprob, l.top) for l in out.logprobs] == [(l.logprob, l.top) for l in ref.logprobs], t
    assert_all_blocks_free(eng)
