"""A step that needs logits for only some of its rows (a prefill: the last prompt token of each
sequence) runs its last layer's attention output projection and MLP on those rows alone
(ForwardContext.keep_rows). The kernels are row-invariant on CPU, so the logits keep their bits."""

from __future__ import annotations

import pytest
import torch

from deepinfer import Engine, SamplingParams
from model_factory import make_tiny_model
from moe_factory import make_moe_model

pytest.importorskip("transformers")

PROMPTS = ["the quick brown fox jumps over the lazy dog", "hello world how are you", "paris capital france"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("last_rows")
    return {
        "llama": make_tiny_model(root / "llama", "llama", seed=7),
        "qwen3_moe": make_moe_model(root / "qwen3_moe", "qwen3_moe", seed=2),
        "deepseek_v3": make_moe_model(root / "deepseek_v3", "deepseek_v3", seed=3),
    }


def _run(eng: Engine, prune: bool):
    """(outputs, rows the last layer's MLP saw per call) with the last-layer pruning on or off."""
    eng.runner.prune_last_layer = prune
    eng.reset_prefix_cache()
    seen: list[int] = []
    hook = eng.runner.model.layers[-1].mlp.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[0]))
    try:
        outs = eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5))
    finally:
        hook.remove()
    return outs, seen


# (arch, batch_invariant, exact): DeepSeek-V3's latent attention projects its heads' values with a
# linear whose kernel choice depends on the row count outside the batch-invariant mode, so there the
# pruned rows' logits match to rounding only
CASES = [("llama", False, True), ("qwen3_moe", False, True), ("deepseek_v3", True, True), ("deepseek_v3", False, False)]


@pytest.mark.parametrize("arch,batch_invariant,exact", CASES)
def test_pruned_last_layer_keeps_logit_bits(models, arch, batch_invariant, exact):
    # max_num_seqs=2: the native decode stack takes at most 2 rows, so the prefills run layer by layer
    eng = Engine(str(models[arch]), kv_cache_memory=8 << 20, block_size=4, max_num_seqs=2,
                 batch_invariant=batch_invariant)
    prompt_tokens = [len(eng.tokenizer.encode(p)) for p in PROMPTS]
    full, rows_full = _run(eng, prune=False)
    pruned, rows_pruned = _run(eng, prune=True)
    # the prefill steps ran the last MLP on every prompt token without pruning, on one row per
    # sequence with it (2 sequences a step at most, so the 3 prompts prefill in 2 steps)
    assert sum(rows_full) >= sum(prompt_tokens)
    assert max(rows_pruned) <= 2 < max(rows_full)
    for a, b in zip(full, pruned):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):  # the first one comes from the prefill step
            if exact:
                assert la.logprob == lb.logprob and la.top == lb.top
            else:
                assert [t for t, _ in la.top] == [t for t, _ in lb.top]
                assert la.logprob == pytest.approx(lb.logprob, abs=1e-5)
                assert [v for _, v in la.top] == pytest.approx([v for _, v in lb.top], abs=1e-5)


def test_prompt_logprobs_and_hidden_states_are_not_pruned(models):
    """Prompt logprobs need every prompt row's logits: such a step keeps all rows in the last layer."""
    eng = Engine(str(models["llama"]), kv_cache_memory=8 << 20, block_size=4, max_num_seqs=2)
    seen: list[int] = []
    eng.runner.model.layers[-1].mlp.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[0]))
    ids = eng.tokenizer.encode(PROMPTS[0])
    out = eng.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    assert seen[0] == len(ids) and len(out.prompt_logprobs) == len(ids)
    assert all(lp is not None for lp in out.prompt_logprobs[1:])
    assert torch.isfinite(torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])).all()
