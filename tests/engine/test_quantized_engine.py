"""The default GGUF model with its Q4_1/Q8_0 blocks kept as stored (dtype="quantized" / "quantized_exact")
against the exact fp32 path (dtype="float32"): memory, logits, greedy agreement, and
batch invariance in the quantized mode."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import Engine, SamplingParams
from deepinfer.errors import InvalidRequestError
from deepinfer_kernels import quant

needs_native = pytest.mark.skipif(not quant.available(), reason="native kernels did not build")

PROMPTS = [[{"role": "user", "content": c}] for c in (
    "What is the capital of France?", "Write a haiku about rain.", "Explain photosynthesis in one sentence.",
    "List three prime numbers.", "Who wrote Hamlet?", "Translate 'good morning' to Spanish.",
    "What is 12 times 12?", "Give me a tip for learning Python.")]
# prompt-token logprobs vs the fp32 path, max abs difference over the prompt set. exact: prompts of 16+
# tokens run the outer-product kernel (fp32 activations), 5.6e-5 on the AVX2 host, 0 where the fp32 GEMM
# has its order. int8: where the CPU has AVX512_VNNI the prompts run the int8 arithmetic too
# (csrc/qgemm_i8_outer.c from INT8_OUTER_M rows: activations rounded to 8 bits per 32-block, as
# llama.cpp does): measured on the 2-core AVX-512 Zen 5 host 0.97 max, 0.12 mean over the 288 prompt
# tokens against quantized_exact (bf16 products: 0.10 max, 0.02 mean); without VNNI the prompts run the
# exact outer kernel (1e-3 then)
LOGPROB_TOL = {"quantized_exact": 1e-3, "quantized": 1.5}
MIN_AGREE = {"quantized_exact": 7, "quantized": 4}


@pytest.fixture(scope="module")
def engines():
    return {dt: Engine(dtype=dt, kv_cache_memory=64 << 20) for dt in ("float32", "quantized", "quantized_exact")}


@pytest.fixture(scope="module")
def fp32_outputs(engines):
    return engines["float32"].generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=0,
                                                               logprobs=0))


@needs_native
@pytest.mark.slow
def test_resident_memory_within_checkpoint_budget(engines):
    q, f = engines["quantized"], engines["float32"]
    assert q.precision == "quantized-int8" and engines["quantized_exact"].precision == "quantized-exact"
    assert f.precision == "float32"
    assert q.stats.checkpoint_bytes > 90e6
    assert q.stats.weight_bytes <= 1.2 * q.stats.checkpoint_bytes, q.stats.weight_bytes
    assert f.stats.weight_bytes > 5 * q.stats.weight_bytes  # fp32 + packed copy


@needs_native
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["quantized_exact", "quantized"])
def test_logprobs_and_greedy_vs_fp32(engines, fp32_outputs, dtype):
    outs = engines[dtype].generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=0,
                                                           logprobs=0))
    worst, decode_diff, agree = 0.0, 0.0, 0
    for a, b in zip(fp32_outputs, outs):
        pa = [x.logprob for x in a.prompt_logprobs if x is not None]
        pb = [x.logprob for x in b.prompt_logprobs if x is not None]
        assert len(pa) == len(pb) > 10
        worst = max(worst, max(abs(u - v) for u, v in zip(pa, pb)))
        agree += a.token_ids == b.token_ids
        same = next((i for i, (u, v) in enumerate(zip(a.token_ids, b.token_ids)) if u != v), len(a.token_ids))
        decode_diff = max([decode_diff] + [abs(u.logprob - v.logprob) for u, v in zip(a.logprobs[:same], b.logprobs[:same])])
    print(f"{dtype}: greedy identical to fp32 on {agree}/{len(PROMPTS)} prompts; max prompt logprob diff {worst:.2e}, "
          f"decode {decode_diff:.2e}")
    assert worst < LOGPROB_TOL[dtype]
    # another arithmetic indeed ran: at decode (8 rows: the row kernels). Not asserted on the prompts: the
    # fp32 GEMM (csrc/gemm.c, every CPU level's tile) has the outer-product kernel's order (one FMA chain
    # per output over k in order) on the same dequantised values, so the prompts' logprobs are equal
    # (0 measured on the 2-core AVX-512 Zen 5 host; 5.6e-5 on the AVX2-only host when its fp32 GEMM was oneDNN)
    assert decode_diff > 0
    assert agree >= MIN_AGREE[dtype]
    if dtype == "quantized":
        int8_prompts = quant.int8_outer_ready(quant.pack(torch.zeros(1, 32), quant.Q4_1))
        assert (worst > 1e-2) if int8_prompts else (worst < 1e-3)


@needs_native
@pytest.mark.slow
def test_bfloat16_tracks_quantized_exact():
    """dtype="bfloat16" on the GGUF: bf16 products from BF16_M rows (the prompts, batches of 16+), the
    exact row kernels below (this decode of 8). Measured on the AVX512_BF16 host: prompt logprobs within
    0.10 of quantized_exact's (activations rounded to 8 significant bits in every projection, over 30
    layers), greedy answers (32 tokens) identical on 7/8 prompts. Where the CPU lacks AVX512_BF16 the
    mode runs the exact kernels: then equal."""
    from deepinfer.engine import quant_linear

    sp = SamplingParams(temperature=0, max_tokens=32, prompt_logprobs=0)
    exact = Engine(dtype="quantized_exact", kv_cache_memory=64 << 20).generate(PROMPTS, sp)
    eng = Engine(dtype="bfloat16", kv_cache_memory=64 << 20)
    bf16 = quant.cpu_level() >= 3  # (else the engine says it runs the exact kernels)
    assert eng.precision == ("quantized-bf16" if bf16 else "quantized-exact")
    assert isinstance(eng.runner.linear, quant_linear.QuantLinear)
    outs = eng.generate(PROMPTS, sp)
    worst = max(abs(u.logprob - v.logprob) for a, b in zip(exact, outs)
                for u, v in zip(a.prompt_logprobs, b.prompt_logprobs) if u is not None)
    agree = sum(a.token_ids == b.token_ids for a, b in zip(exact, outs))
    print(f"bfloat16 vs quantized_exact: max prompt logprob diff {worst:.2e}, greedy identical on {agree}/8")
    assert worst < 0.25 and agree >= 6
    assert (worst > 0) == bf16  # bf16 products did run (or, without them, the exact kernels: equal)


class _CountingStack:
    """The runner's decode stack, recording the rows of each call"""

    def __init__(self, inner):
        self.inner, self.max_rows, self.rows = inner, inner.max_rows, []

    def __call__(self, x, *args):
        self.rows.append(x.shape[0])
        return self.inner(x, *args)


@needs_native
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["quantized", "quantized_exact", "bfloat16"])
def test_needle_batch_invariant_in_quantized_mode(dtype):
    """exact (and bfloat16, which runs the exact kernels in this mode): prefill chunks of 16+ rows run
    the panel kernel, decode the row kernel (the same bits).
    Decode steps of fewer than PANEL_M rows (the needle alone, the tails of the batches) run through
    the native decode stack, larger ones and mixed steps per op: the needle's tokens and logprobs
    must not tell which."""
    eng = Engine(dtype=dtype, batch_invariant=True, kv_cache_memory=64 << 20, max_num_batched_tokens=128)
    assert eng.precision == {"quantized": "quantized-int8", "quantized_exact": "quantized-exact",
                             "bfloat16": "quantized-bf16" if quant.cpu_level() >= 3 else "quantized-exact"}[dtype]
    assert eng.runner.decode_stack is not None
    eng.runner.decode_stack = counting = _CountingStack(eng.runner.decode_stack)
    r = random.Random(3)
    words = "alpha beta gamma delta river stone cloud green quick slow bright dark seven".split()
    needle = [{"role": "user", "content": "Tell me about the sea and " + " ".join(r.choice(words) for _ in range(12))}]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    ref = eng.generate([needle], sp)[0]
    for t in range(6):
        n = r.randint(2, 24)
        others = [" ".join(r.choice(words) for _ in range(r.randint(1, 40))) for _ in range(n - 1)]
        pos = r.randint(0, n - 1)
        prompts = others[:pos] + [needle] + others[pos:]
        params = [SamplingParams(temperature=0, max_tokens=r.randint(1, 12), ignore_eos=True) for _ in prompts]
        params[pos] = sp
        if t % 2:
            eng.reset_prefix_cache()
        out = eng.generate(prompts, params)[pos]
        assert out.token_ids == ref.token_ids, f"trial {t}: batch of {n}"
        assert [(x.logprob, x.top) for x in out.logprobs] == [(x.logprob, x.top) for x in ref.logprobs], t
    assert 1 in counting.rows and max(counting.rows) > 1  # the needle alone and in small batches went through the stack


def test_quantized_dtype_needs_a_gguf(tiny_models):
    with pytest.raises(InvalidRequestError, match="needs a GGUF checkpoint"):
        Engine(str(tiny_models["llama"]), dtype="quantized", kv_cache_memory=8 << 20)
    with pytest.raises(InvalidRequestError, match="dtype must be"):
        Engine(str(tiny_models["llama"]), dtype="int3", kv_cache_memory=8 << 20)


def test_auto_on_a_hf_directory_stays_fp32(tiny_models):
    eng = Engine(str(tiny_models["llama"]), kv_cache_memory=8 << 20)
    assert eng.precision == "float32"
    assert eng.stats.weight_bytes > 0 and eng.stats.checkpoint_bytes > 0


@needs_native
def test_auto_on_a_gguf_keeps_its_blocks_and_runs_the_exact_mode(engines):
    """dtype="auto" (the default) on CPU: a GGUF's blocks kept as stored, the exact mode, the same
    tokens and logprobs as asking for quantized_exact, weights ~1x the file's bytes."""
    eng = Engine(kv_cache_memory=64 << 20)
    assert eng.precision == "quantized-exact"
    assert eng.stats.weight_bytes <= 1.2 * eng.stats.checkpoint_bytes
    sp = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    engines["quantized_exact"].reset_prefix_cache()  # the same work on both (no prefix hits from earlier tests)
    a, b = eng.generate(PROMPTS[:3], sp), engines["quantized_exact"].generate(PROMPTS[:3], sp)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert [(t.logprob, t.top) for t in x.logprobs] == [(t.logprob, t.top) for t in y.logprobs]


@needs_native
def test_install_quantized_on_a_tiny_model(tiny_models):
    """Projections whose parts all pack become placeholders backed by blocks; the rest stay fp32."""
    import torch

    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.loader import load_model
    from deepinfer.engine.model_runner import ModelRunner

    loaded = load_model(str(tiny_models["qwen2"]))  # tied embeddings: the lm_head is the embedding
    # layer 0's down_proj left out, as a tensor in a format the kernels lack would be
    blocks = {k: quant.pack(v, quant.Q8_0) for k, v in loaded.weights.items()
              if v.dim() == 2 and k != "model.layers.0.mlp.down_proj.weight"}
    ref = {k: quant.dequantize_reference(q) for k, q in blocks.items()}
    fp32 = {k: v.clone() for k, v in loaded.weights.items()}
    cfg = EngineConfig(kv_cache_memory=4 << 20)
    runner = ModelRunner(cfg, loaded.config, loaded.weights, torch.device("cpu"), torch.float32,
                         quantized=blocks, quant_mode="exact")
    assert runner.precision == "quantized-exact"
    m = runner.model
    layer = m.layers[0]
    assert torch.isnan(layer.self_attn.qkv_weight).all()  # a placeholder: reading it as a weight gives NaN
    x = torch.randn(3, loaded.config.hidden_size)
    p = "model.layers.0."
    want = x @ torch.cat([ref[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]).T + layer.self_attn.qkv_bias
    torch.testing.assert_close(runner.linear(x, layer.self_attn.qkv_weight, layer.self_attn.qkv_bias), want,
                               rtol=1e-5, atol=1e-5)
    # the projection without blocks stays the fp32 weight
    assert torch.equal(layer.mlp.down_weight, fp32[p + "mlp.down_proj.weight"])
    ids = torch.tensor([5, 0, 7])
    torch.testing.assert_close(m.embed_impl(ids), ref["model.embed_tokens.weight"][ids])
    assert runner.weight_bytes() < sum(v.numel() * 4 for v in fp32.values())


@needs_native
@pytest.mark.slow
def test_quantized_exact_keeps_the_gguf_blocks():
    eng = Engine(kv_cache_memory=32 << 20, dtype="quantized_exact")
    assert eng.precision == "quantized-exact"
    assert eng.stats.weight_bytes <= 1.2 * eng.stats.checkpoint_bytes
