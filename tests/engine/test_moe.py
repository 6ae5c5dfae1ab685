"""Qwen2-MoE, Qwen3-MoE and DeepSeek-V2/V3 (MoE + latent attention) against transformers, and through
the engine's chunked prefill, prefix cache, preemption, batching and batch-invariant mode."""

from __future__ import annotations

import json
import random

import pytest
import torch

from deepinfer import Engine, SamplingParams
from deepinfer.engine.moe_config import MoeConfigError
from moe_factory import make_moe_model
from test_engine_core import WORDS, assert_all_blocks_free

transformers = pytest.importorskip("transformers")

PROMPTS = ["The quick brown fox", "Hello world! How are", "def add(a, b):\n    return"]
# DeepSeek-V3 without q LoRA, without interleaved or YaRN rope and without group-limited routing
PLAIN_V3 = dict(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0))


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {
        "qwen2_moe": make_moe_model(root / "qwen2_moe", "qwen2_moe", seed=1),
        # its shared expert twice a routed expert's width: fused into the experts' call, gate and all
        "qwen2_moe_fused": make_moe_model(root / "qwen2_moe_fused", "qwen2_moe", seed=1,
                                          shared_expert_intermediate_size=64),
        "qwen3_moe": make_moe_model(root / "qwen3_moe", "qwen3_moe", seed=2),
        "deepseek_v3": make_moe_model(root / "deepseek_v3", "deepseek_v3", seed=3),
        "deepseek_v3_plain": make_moe_model(root / "deepseek_v3_plain", "deepseek_v3", seed=4, **PLAIN_V3),
        "deepseek_v2": make_moe_model(root / "deepseek_v2", "deepseek_v2", seed=5),
        "deepseek_v2_greedy": make_moe_model(root / "deepseek_v2_greedy", "deepseek_v2", seed=6, topk_method="greedy",
                                             q_lora_rank=None),
    }


def _prompts(n: int, seed: int, lo: int = 6, hi: int = 24, prefix: str = "") -> list[str]:
    r = random.Random(seed)
    return [prefix + " ".join(r.choice(WORDS) for _ in range(r.randint(lo, hi))) for _ in range(n)]


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen2_moe_fused", "qwen3_moe", "deepseek_v3", "deepseek_v3_plain",
                                  "deepseek_v2", "deepseek_v2_greedy"])
def test_logits_and_greedy_match_transformers(moe_models, arch):
    path = moe_models[arch]
    eng = Engine(str(path), kv_cache_memory=8 << 20, block_size=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    n_new = 10
    sp = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True, logprobs=20, prompt_logprobs=20)
    outs = eng.generate(PROMPTS, sp)
    for prompt, out in zip(PROMPTS, outs):
        ids = eng.tokenizer.encode(prompt)
        with torch.no_grad():
            ref_tokens = hf.generate(torch.tensor([ids]), max_new_tokens=n_new, min_new_tokens=n_new,
                                     do_sample=False)[0, len(ids):].tolist()
            ref_lp = torch.log_softmax(hf(torch.tensor([ids + out.token_ids])).logits[0].float(), -1)
        assert out.token_ids == ref_tokens, "greedy generation differs from transformers"
        for i, tl in enumerate(out.logprobs):  # decode steps: the sampled token and the whole top-20
            row = ref_lp[len(ids) - 1 + i]
            assert abs(tl.logprob - row[tl.token_id].item()) < 1e-4
            top_vals = torch.tensor([v for _, v in tl.top])
            assert torch.allclose(top_vals, row[[t for t, _ in tl.top]], atol=1e-4)
            assert torch.allclose(top_vals, row.topk(20).values, atol=1e-4)
        for p in range(1, len(ids)):  # prefill: every prompt position
            assert abs(out.prompt_logprobs[p].logprob - ref_lp[p - 1, ids[p]].item()) < 1e-4


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_chunked_prefill_prefix_hits_and_preemption_match_reference(moe_models, arch):
    path = str(moe_models[arch])
    prompts = _prompts(8, seed=5, lo=10, hi=30, prefix="the quick brown fox jumps over the lazy dog and ")
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)
    big = Engine(path, kv_cache_memory=16 << 20, enable_prefix_caching=False, enable_chunked_prefill=False)
    ref = [big.generate([p], sp)[0] for p in prompts]  # one at a time: no batching, no cache, no chunks
    per_token = big.runner.kv_bytes_per_token
    # room for about 110 tokens (the batch needs several times that): forces preemption
    small = Engine(path, kv_cache_memory=110 * per_token, block_size=4, max_num_batched_tokens=16)
    out = small.generate(prompts, sp)
    assert small.stats.num_preemptions > 0, "the budget was meant to force preemption"
    assert small.stats.cached_prompt_tokens > 0, "the shared prefix was meant to hit the radix cache"
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    for x, y in zip(out, ref):
        for lx, ly in zip(x.logprobs, y.logprobs):
            assert abs(lx.logprob - ly.logprob) < 1e-4
    assert_all_blocks_free(small)


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])
def test_batched_equals_alone(moe_models, arch):
    eng = Engine(str(moe_models[arch]), kv_cache_memory=16 << 20, block_size=4, enable_prefix_caching=False)
    prompts = _prompts(12, seed=7)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    batched = eng.generate(prompts, sp)
    for p, b in zip(prompts, batched):
        alone = eng.generate([p], sp)[0]
        assert alone.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(alone.logprobs, b.logprobs)) < 1e-4


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_batch_invariant_needle_with_moe(moe_models, arch):
    eng = Engine(str(moe_models[arch]), kv_cache_memory=16 << 20, block_size=4, batch_invariant=True,
                 max_num_batched_tokens=64)
    r = random.Random(11)
    needle = "the quick brown fox jumps over the lazy dog and " + " ".join(r.choice(WORDS) for _ in range(20))
    sp = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=10, seed=5, ignore_eos=True, logprobs=3)
    ref = eng.generate([needle], sp)[0]
    for t in range(8):
        n = r.randint(2, 24)
        others = _prompts(n - 1, seed=100 + t, lo=1, hi=40)
        pos = r.randint(0, n - 1)
        prompts = others[:pos] + [needle] + others[pos:]
        params = [SamplingParams(temperature=0, max_tokens=r.randint(1, 12)) for _ in prompts]
        params[pos] = sp
        if t % 2:
            eng.reset_prefix_cache()
        out = eng.generate(prompts, params)[pos]
        assert out.token_ids == ref.token_ids, f"trial {t}: tokens differ in a batch of {n}"
        assert [(x.logprob, x.top) for x in out.logprobs] == [(x.logprob, x.top) for x in ref.logprobs], \
            f"trial {t}: logprobs differ bitwise in a batch of {n}"
    assert_all_blocks_free(eng)


def test_mla_cache_holds_one_latent_per_token(moe_models):
    eng = Engine(str(moe_models["deepseek_v3"]), kv_cache_memory=1 << 20, block_size=4)
    mc = eng.model_config
    a = mc.mla
    latent = mc.num_hidden_layers * (a.kv_lora_rank + a.qk_rope_head_dim) * 4  # fp32 bytes
    gqa = mc.num_hidden_layers * 2 * mc.num_attention_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim) * 4
    assert eng.runner.kv_bytes_per_token == latent == 3 * (32 + 16) * 4
    assert latent < gqa / 4
    assert tuple(eng.runner.kv_cache.shape[1:]) == (1, eng.runner.num_blocks * 4, 1, 48)
    assert eng.runner.num_blocks == (1 << 20) // (4 * latent)


def test_fork_shares_latent_pages(moe_models):
    eng = Engine(str(moe_models["deepseek_v3"]), kv_cache_memory=4 << 20, block_size=4)
    prompt = "the quick brown fox jumps over the lazy dog"
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = eng.generate([prompt], sp)[0].token_ids
    rid = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    seen: list[int] = []
    for _ in range(4):  # prefill and a few decode steps
        for o in eng.step():
            if o.request_id == rid:
                seen = list(o.token_ids)
    assert 0 < len(seen) < 12
    kids = eng.fork(rid, 2, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    assert done[rid] == alone
    for k in kids:  # a greedy child continues from the parent's latent pages exactly as the parent did
        assert done[k] == alone[len(seen) : len(seen) + 6]
    assert_all_blocks_free(eng)


def test_sharded_checkpoint_loads_identically(tmp_path):
    a = make_moe_model(tmp_path / "single", "deepseek_v3", seed=9)
    b = make_moe_model(tmp_path / "sharded", "deepseek_v3", seed=9, shard=True)
    assert (b / "model.safetensors.index.json").exists()
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    x = Engine(str(a), kv_cache_memory=2 << 20).generate(PROMPTS, sp)
    y = Engine(str(b), kv_cache_memory=2 << 20).generate(PROMPTS, sp)
    assert [o.token_ids for o in x] == [o.token_ids for o in y]


@pytest.mark.parametrize("arch,edit,field", [
    ("deepseek_v3", {"kv_lora_rank": None}, "kv_lora_rank"),
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
    ("deepseek_v3", {"n_group": 3}, "n_group"),
    ("deepseek_v3", {"topk_group": 9}, "topk_group"),
    ("qwen3_moe", {"num_experts_per_tok": 99}, "num_experts_per_tok"),
    ("qwen3_moe", {"num_local_experts": None}, "num_experts"),
    ("qwen2_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ("qwen2_moe", {"hidden_act": "gelu"}, "hidden_act"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method"),
])
def test_bad_moe_config_names_the_field(moe_models, tmp_path, arch, edit, field):
    import shutil

    d = tmp_path / arch
    shutil.copytree(moe_models[arch], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(edit)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MoeConfigError, match=field):
        Engine(str(d), kv_cache_memory=1 << 20)


def test_missing_expert_weight_is_named(moe_models, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from deepinfer.errors import ModelLoadError

    d = tmp_path / "m"
    shutil.copytree(moe_models["qwen3_moe"], d)
    w = load_file(str(d / "model.safetensors"))
    del w["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"experts\.5\.up_proj"):
        Engine(str(d), kv_cache_memory=1 << 20)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_bf16_expert_weights_equal_fp32_on_bf16_rounded_experts(moe_models, arch, tmp_path):
    """moe_expert_dtype="bfloat16" stores the routed experts' packed weights in bf16 and widens them
    exactly: the engine's tokens and logprobs are bitwise those of the fp32 engine on a checkpoint whose
    routed expert weights were rounded to bf16 (everything else untouched), at half the packed bytes."""
    import shutil

    from safetensors.torch import load_file, save_file

    rounded = tmp_path / arch
    shutil.copytree(moe_models[arch], rounded)
    f = rounded / "model.safetensors"
    w = load_file(str(f))
    routed = [n for n in w if ".mlp.experts." in n]
    assert routed
    for n in routed:
        w[n] = w[n].bfloat16().float()
    save_file(w, str(f), metadata={"format": "pt"})
    kw = dict(kv_cache_memory=8 << 20, block_size=4)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    half = Engine(str(moe_models[arch]), moe_expert_dtype="bfloat16", **kw)
    ref = Engine(str(rounded), **kw)
    got, want = half.generate(PROMPTS, sp), ref.generate(PROMPTS, sp)
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        assert [(t.token_id, t.logprob, t.top) for t in a.logprobs] == [(t.token_id, t.logprob, t.top) for t in b.logprobs]
        assert [(t.token_id, t.logprob) for t in a.prompt_logprobs[1:]] == [(t.token_id, t.logprob) for t in b.prompt_logprobs[1:]]
    packed = [m for m in half.runner.model.modules() if type(m).__name__ == "NativeExperts"]
    assert packed and all(m.packed_gate_up.dtype == torch.bfloat16 for m in packed)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_auto_keeps_a_bf16_checkpoints_experts_in_bf16(moe_models, arch, tmp_path):
    """moe_expert_dtype="auto" (the default) packs a bf16 checkpoint's routed experts as stored, in bf16:
    the same tokens and logprobs, bit for bit, as the fp32 engine on that checkpoint (widening bf16 is
    exact), in fewer resident bytes. An fp16 checkpoint's experts (fp16 does not round-trip through
    bf16) and an explicit "float32" stay fp32."""
    import shutil

    from safetensors.torch import load_file, save_file

    def saved_as(dtype):
        d = tmp_path / f"{arch}_{dtype}"
        shutil.copytree(moe_models[arch], d)
        w = load_file(str(d / "model.safetensors"))
        save_file({n: t.to(dtype) if t.is_floating_point() else t for n, t in w.items()},
                  str(d / "model.safetensors"), metadata={"format": "pt"})
        return str(d)

    def expert_storage(engine):
        packed = [m for m in engine.runner.model.modules() if type(m).__name__ == "NativeExperts"]
        assert packed
        return {m.packed_gate_up.dtype for m in packed} | {m.packed_down.dtype for m in packed}

    kw = dict(kv_cache_memory=8 << 20, block_size=4)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    bf16 = saved_as(torch.bfloat16)
    auto, fp32 = Engine(bf16, **kw), Engine(bf16, dtype="float32", **kw)
    assert expert_storage(auto) == {torch.bfloat16} and expert_storage(fp32) == {torch.float32}
    got, want = auto.generate(PROMPTS, sp), fp32.generate(PROMPTS, sp)
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        assert [(t.token_id, t.logprob, t.top) for t in a.logprobs] == [(t.token_id, t.logprob, t.top) for t in b.logprobs]
        assert [(t.token_id, t.logprob) for t in a.prompt_logprobs[1:]] == [(t.token_id, t.logprob) for t in b.prompt_logprobs[1:]]
    # the experts' panels at 2 bytes per weight instead of 4, everything else as before
    def expert_bytes(engine):
        return sum(m.packed_gate_up.nbytes + m.packed_down.nbytes for m in engine.runner.model.modules()
                   if type(m).__name__ == "NativeExperts")

    assert expert_bytes(auto) <= 0.5 * expert_bytes(fp32) * 1.02
    # (and the rest no bigger: the fp32 engine's MLA v slices are views keeping all of kv_b_proj alive,
    # the bf16 checkpoint's are per-head fp32 copies of the v part only)
    assert auto.runner.weight_bytes() - expert_bytes(auto) <= fp32.runner.weight_bytes() - expert_bytes(fp32)
    # the shared experts / dense MLPs and the other projections too: bf16 panels, the same bits
    gated = [m for m in auto.runner.model.modules() if type(m).__name__ == "NativeGatedMlp"]
    assert gated and all(m._packed.weights == torch.bfloat16 for m in gated)
    lin = auto.runner.linear
    assert lin.packed and all(pw.panels.dtype == torch.bfloat16 for pw in lin.packed.values())
    # resident bytes near the checkpoint's (1.21-1.23x here when written, 1.32x with the embedding in
    # fp32: these tiny models' norms and routers, kept fp32, are a far larger share than a real model's)
    assert auto.stats.weight_bytes <= 1.25 * auto.stats.checkpoint_bytes
    assert expert_storage(Engine(bf16, moe_expert_dtype="float32", **kw)) == {torch.float32}
    assert expert_storage(Engine(saved_as(torch.float16), **kw)) == {torch.float32}


def test_bf16_expert_weights_need_the_native_kernel(moe_models):
    from deepinfer import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="moe_expert_dtype"):
        Engine(str(moe_models["qwen3_moe"]), moe_expert_dtype="float16", kv_cache_memory=8 << 20)
    with pytest.raises(InvalidRequestError, match="native grouped expert kernel"):
        Engine(str(moe_models["qwen3_moe"]), moe_expert_dtype="bfloat16", kernels="torch", kv_cache_memory=8 << 20)


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v3_plain"])
def test_mla_per_head_projections_match_the_batched_path(moe_models, arch, monkeypatch):
    """Many-row steps run MLA's absorbed projections as one linear per head (mla.PER_HEAD_MIN_ROWS);
    forced for every step, generation and logprobs agree with the batched bmm path."""
    from deepinfer.engine.models import mla

    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    prompts = _prompts(6, seed=11)
    outs = {}
    for rows in (1, 1 << 30):
        monkeypatch.setattr(mla, "PER_HEAD_MIN_ROWS", rows)
        outs[rows] = Engine(str(moe_models[arch]), kv_cache_memory=8 << 20, block_size=4).generate(prompts, sp)
    for a, b in zip(outs[1], outs[1 << 30]):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x.logprob - y.logprob) < 1e-5
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert abs(x.logprob - y.logprob) < 1e-5
