"""The KV cache's element type (EngineConfig.kv_cache_dtype): bf16 under fp32 compute on CPU, what
"auto" picks in each precision, the values the cache holds, and that every attention path reads them."""

from __future__ import annotations

import pytest
import torch

from deepinfer import Engine, SamplingParams
from deepinfer.engine.attention import ForwardContext, PrefillChunk, paged_attention
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.forward_batch import ForwardBatch
from deepinfer.engine.weights16 import bf16_dot_available
from deepinfer.errors import InvalidRequestError
from deepinfer_kernels import native

KW = dict(kv_cache_memory=16 << 20, block_size=4)
needs_native = pytest.mark.skipif(not native.available(), reason="the native CPU kernels did not build")


def _prefill(eng: Engine, ids: list[int]) -> torch.Tensor:
    """log_softmax of every position's logits of one prefill of ids (block ids 0.., so slots 0..len-1)."""
    bs = eng.config.block_size
    batch = ForwardBatch.build([ids], [0], [list(range(-(-len(ids) // bs)))], list(range(len(ids))), bs)
    return torch.log_softmax(eng.runner.forward(eng.runner.prepare(batch)).double(), -1)


def test_bad_setting_is_a_typed_error():
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):
        Engine(kv_cache_dtype="fp8")
    # named before any worker starts: expert parallelism's workers keep the compute dtype
    with pytest.raises(InvalidRequestError, match="expert_parallel_size"):
        EngineConfig(kv_cache_dtype="bfloat16", expert_parallel_size=2)


@needs_native
def test_auto_is_bf16_only_in_the_approximate_precisions(tiny_models):
    path = str(tiny_models["llama"])
    exact = Engine(path, dtype="float32", **KW)
    assert exact.kv_cache_dtype == "float32" and exact.runner.kv_cache.dtype == torch.float32
    dot = Engine(path, dtype="bfloat16", **KW)
    # bf16 dot products at the avx512 level; below it torch's bf16 ops (compute dtype bf16): a bf16 cache either way
    assert dot.precision == ("bfloat16-dot" if bf16_dot_available() else "bfloat16") and dot.kv_cache_dtype == "bfloat16"
    # half the bytes per token, so the same budget holds twice the blocks
    assert dot.runner.kv_bytes_per_token * 2 == exact.runner.kv_bytes_per_token
    assert dot.runner.num_blocks >= 2 * exact.runner.num_blocks - 1
    # the torch kernels keep the compute dtype's cache under auto; asked for, bf16 runs there too
    assert Engine(path, dtype="float32", kernels="torch", **KW).kv_cache_dtype == "float32"
    assert Engine(path, dtype="float32", kernels="torch", kv_cache_dtype="bfloat16", **KW).kv_cache_dtype == "bfloat16"


@needs_native
def test_auto_on_the_default_gguf():
    # int8 mode: bf16; the exact mode (the default) and fp32 keep fp32
    got = {dt: Engine(dtype=dt, kv_cache_memory=32 << 20).kv_cache_dtype for dt in ("quantized", "auto", "float32")}
    assert got == {"quantized": "bfloat16", "auto": "float32", "float32": "float32"}


def test_latent_cache_stays_in_the_compute_dtype(tmp_path):
    from moe_factory import make_moe_model

    path = str(make_moe_model(tmp_path / "v3", "deepseek_v3", seed=2))
    eng = Engine(path, dtype="bfloat16", **KW)  # MLA's latent cache: the compute dtype's (fp32 with bf16 dot products)
    assert eng.runner.kv_cache.dtype == eng.dtype == (torch.float32 if bf16_dot_available() else torch.bfloat16)
    with pytest.raises(InvalidRequestError, match="MLA"):
        Engine(path, kv_cache_dtype="bfloat16", **KW)


@pytest.mark.parametrize("kernels", [pytest.param("auto", marks=needs_native), "torch"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cache_holds_the_fp32_values_rounded(tiny_models, kernels, arch):
    """Layer 0's keys and values depend only on the embeddings, so a bf16 cache must hold exactly the
    fp32 engine's rounded to bf16 (torch's rounding), written natively (rope_store_kv) or by torch
    (write_kv; Qwen3's q/k norms take that path under either kernels option)."""
    path = str(tiny_models[arch])
    f32 = Engine(path, dtype="float32", kernels=kernels, **KW)
    bf = Engine(path, dtype="float32", kernels=kernels, kv_cache_dtype="bfloat16", **KW)
    ids = f32.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 2)
    lp32, lpbf = _prefill(f32, ids), _prefill(bf, ids)
    n = len(ids)
    assert bf.runner.kv_cache.dtype == torch.bfloat16
    assert torch.equal(bf.runner.kv_cache[0, :, :n], f32.runner.kv_cache[0, :, :n].to(torch.bfloat16))
    assert bf.runner.kv_cache[0, :, :n].abs().sum() > 0
    # and the rounding shows in the logits, a little
    d = (lp32 - lpbf).abs().max().item()
    assert 0 < d < 0.05, d


def test_a_chunk_sees_its_own_keys_as_the_cache_holds_them():
    """A prefill chunk attending to its own new keys (k given) gets the output it gets reading them
    back from a bf16 cache (k None): both round them."""
    torch.manual_seed(0)
    T, H, Hkv, D = 7, 4, 2, 16
    q, k, v = torch.randn(T, H, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    slots = torch.arange(3, 3 + T)
    ctx = ForwardContext(slot_mapping=slots, prefills=[PrefillChunk(q_start=0, q_len=T, ctx_len=T, gather_idx=None)])
    caches = [torch.zeros(16, Hkv, D, dtype=torch.bfloat16) for _ in range(4)]
    own = paged_attention(q, k, v, caches[0], caches[1], ctx, 0.25)
    caches[2].index_copy_(0, slots, k.to(torch.bfloat16))
    caches[3].index_copy_(0, slots, v.to(torch.bfloat16))
    read_back = paged_attention(q, None, None, caches[2], caches[3], ctx, 0.25)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert torch.equal(own, read_back)
    # against fp32 keys the output moves (the rounding is real)
    f32 = paged_attention(q, k, v, torch.zeros(16, Hkv, D), torch.zeros(16, Hkv, D), ctx, 0.25)
    assert not torch.equal(own, f32) and torch.allclose(own, f32, atol=0.05)


@needs_native
def test_decode_with_a_bf16_cache_matches_teacher_forced_prefill(tiny_models):
    """Greedy decode through the native kernels (the decode stack, token attention) over a bf16 cache,
    with prefix hits and batching, against the same engine's prefill of the generated sequence: in
    the batch-invariant mode every path reads the same cache values in one order, so bitwise."""
    eng = Engine(str(tiny_models["llama"]), dtype="float32", kv_cache_dtype="bfloat16", batch_invariant=True, **KW)
    prompts = ["the quick brown fox", "the quick brown fox jumps over", "a lazy dog sleeps"]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    outs = eng.generate(prompts, sp)
    for p, o in zip(prompts, outs):
        eng.reset_prefix_cache()
        ids = eng.tokenizer.encode(p)
        forced = eng.generate([ids + o.token_ids], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
        want = [x.logprob for x in forced.prompt_logprobs[len(ids):]]
        assert [l.logprob for l in o.logprobs] == want, p
        lp = _prefill(eng, ids + o.token_ids[:-1])
        assert o.token_ids == [int(lp[len(ids) - 1 + i].argmax()) for i in range(len(o.token_ids))]


@needs_native
def test_kernels_reject_mixed_cache_types():
    from deepinfer_kernels.errors import KernelInputError

    q = torch.randn(2, 4, 16)
    kc, vc = torch.zeros(8, 2, 16, dtype=torch.bfloat16), torch.zeros(8, 2, 16)
    idx, row, lens = torch.zeros(2, 4, dtype=torch.long), torch.arange(2), torch.ones(2, dtype=torch.long)
    with pytest.raises(KernelInputError, match="both"):
        native.token_attention(q, kc, vc, idx, row, lens, 0.25, 4)
    with pytest.raises(KernelInputError, match="both"):
        native.rope_store_kv(torch.randn(2, 8 * 16), 4, 2, torch.ones(2, 16), torch.zeros(2, 16),
                             torch.arange(2), kc, vc)
