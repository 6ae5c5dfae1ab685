"""Our forward pass against transformers on tiny random-weight Llama, Qwen2 and Qwen3 models."""

from __future__ import annotations

import pytest
import torch

from deepinfer import Engine, SamplingParams

PROMPTS = ["The quick brown fox", "Hello world! How are", "def add(a, b):\n    return"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_logits_and_greedy_match_transformers(tiny_models, arch):
    transformers = pytest.importorskip("transformers")
    path = tiny_models[arch]
    eng = Engine(str(path), kv_cache_memory=8 << 20, block_size=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    n_new = 10
    sp = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True, logprobs=20, prompt_logprobs=20)
    outs = eng.generate(PROMPTS, sp)
    for prompt, out in zip(PROMPTS, outs):
        ids = eng.tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            ref_tokens = hf.generate(
                torch.tensor([ids]), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False
            )[0, len(ids):].tolist()
            ref_lp = torch.log_softmax(hf(torch.tensor([ids + out.token_ids])).logits[0].float(), -1)
        assert out.token_ids == ref_tokens, "greedy generation differs from transformers"
        # decode steps: logprob of each generated token and the whole top-20
        for i, tl in enumerate(out.logprobs):
            row = ref_lp[len(ids) - 1 + i]
            assert abs(tl.logprob - row[tl.token_id].item()) < 1e-4
            top_ids = [t for t, _ in tl.top]
            top_vals = torch.tensor([v for _, v in tl.top])
            assert torch.allclose(top_vals, row[top_ids], atol=1e-4)
            assert torch.allclose(top_vals, row.topk(20).values, atol=1e-4)
        # prefill: every prompt position
        assert out.prompt_logprobs[0] is None
        for p in range(1, len(ids)):
            assert abs(out.prompt_logprobs[p].logprob - ref_lp[p - 1, ids[p]].item()) < 1e-4


def test_sharded_checkpoint_loads_identically(tmp_path):
    from model_factory import make_tiny_model

    single = make_tiny_model(tmp_path / "single", "llama", seed=3)
    sharded = make_tiny_model(tmp_path / "sharded", "llama", seed=3, shard=True)
    assert (sharded / "model.safetensors.index.json").exists()
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = Engine(str(single), kv_cache_memory=4 << 20).generate(PROMPTS, sp)
    b = Engine(str(sharded), kv_cache_memory=4 << 20).generate(PROMPTS, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
