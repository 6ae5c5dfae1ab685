"""speculative="mtp": the checkpoint's MTP layer drafts the token after next; the target verifies it.

Outputs are identical with it on or off (greedy, seeded, overlapped loop, chunked prefill), and the
MTP cache the drafter fills step by step gives the drafts a from-scratch MTP pass over the whole
sequence gives."""

from __future__ import annotations

import pytest
import torch

from deepinfer import Engine, InvalidRequestError, SamplingParams
from deepinfer.engine.attention import ForwardContext, PrefillChunk
from moe_factory import make_moe_model
from test_engine_core import assert_all_blocks_free
from test_mtp import _with_mtp

transformers = pytest.importorskip("transformers")

PROMPTS = ["The quick brown fox", "Once upon a time there was", "a b c d e f g", "Hello"]


def _oracle(tmp_path):
    """A 2-layer DeepSeek-V3 (both layers MoE) whose layer 1 adds nothing (its output projections are
    zero) and whose embedding rows have unit RMS, with an MTP layer that is layer 0 again reading only
    the next token's embedding: MTP row j then computes nearly what the target computes at position
    j + 1 (its context lacks the first token), so many of its drafts are accepted and some are not."""
    from safetensors.torch import load_file, save_file

    path = make_moe_model(tmp_path / "oracle", "deepseek_v3", seed=41, num_hidden_layers=2,
                          num_nextn_predict_layers=1, first_k_dense_replace=0)
    w = load_file(str(path / "model.safetensors"))
    emb = w["model.embed_tokens.weight"]
    emb = emb / emb.pow(2).mean(-1, keepdim=True).sqrt()
    w["model.embed_tokens.weight"] = emb
    for n in list(w):
        if n.startswith("model.layers.1.") and ("o_proj" in n or "down_proj" in n):
            w[n] = torch.zeros_like(w[n])
    h = emb.shape[1]
    extra = {
        "model.layers.2.enorm.weight": torch.ones(h),
        "model.layers.2.hnorm.weight": torch.ones(h),
        "model.layers.2.eh_proj.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], 1),
        "model.layers.2.shared_head.norm.weight": w["model.norm.weight"].clone(),
        "model.layers.2.shared_head.head.weight": w["lm_head.weight"].clone(),
    }
    for n, t in w.items():
        if n.startswith("model.layers.0."):
            extra["model.layers.2." + n[len("model.layers.0."):]] = t.clone()
    w.update(extra)
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return _oracle(tmp_path_factory.mktemp("mtp_spec"))


def _pair(path, **kw):
    base = dict(kv_cache_memory=4 << 20, block_size=4, max_num_batched_tokens=16)  # chunked prefill
    base.update(kw)
    off = Engine(str(path), **base)
    on = Engine(str(path), speculative="mtp", speculative_budget=False, **base)
    _count_stack_calls(on)  # (the target's steps on the decode stack, its MTP layer per op)
    return off, on


def _same(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_identical_with_drafts_accepted_and_rejected(oracle, overlap):
    off, on = _pair(oracle, overlap_schedule=overlap)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    a, b = off.generate(PROMPTS, sp), on.generate(PROMPTS, sp)
    _same(a, b)
    st = on.stats
    assert st.accepted_draft_tokens > 0, "no MTP draft accepted: the test proves nothing"
    assert st.accepted_draft_tokens < st.draft_tokens, "no MTP draft rejected: the rejection path is untested"
    assert sum(o.num_accepted_draft_tokens for o in b) == st.accepted_draft_tokens
    assert on.runner.kv_bytes_per_token == off.runner.kv_bytes_per_token * 3 // 2  # + the MTP layer's cache
    assert_all_blocks_free(on)


def test_seeded_sampling_identical(oracle):
    off, on = _pair(oracle)
    sp = [SamplingParams(temperature=0.7, seed=100 + i, max_tokens=20, ignore_eos=True) for i in range(len(PROMPTS))]
    _same(off.generate(PROMPTS, sp), on.generate(PROMPTS, sp))
    assert on.stats.draft_tokens > 0
    assert_all_blocks_free(on)


def test_stop_and_max_tokens_mid_run(oracle):
    off, on = _pair(oracle)
    ref = off.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    stop_text = ref.text[len(ref.text) // 2 :][:3]
    for sp in (SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
               SamplingParams(temperature=0, max_tokens=16, stop=[stop_text] if stop_text.strip() else None)):
        _same(off.generate(PROMPTS, sp), on.generate(PROMPTS, sp))
    assert_all_blocks_free(on)


def test_drafts_equal_a_from_scratch_mtp_pass(tmp_path):
    """Every draft the step-by-step MTP cache gave is the argmax a full MTP pass over the final
    sequence gives at that row (prefill chunks, decodes and verify steps with rejections all fill it)."""
    path, _, _ = _with_mtp(tmp_path)
    eng = Engine(str(path), kv_cache_memory=4 << 20, block_size=4, max_num_batched_tokens=8,
                 speculative="mtp", speculative_budget=False)
    drafter = eng.speculator.drafter
    stack = _count_stack_calls(eng)
    seen: dict[int, dict[int, int]] = {}  # id(seq) -> {position predicted: draft}
    seqs = {}
    real = drafter.after_step

    def spy(step):
        real(step)
        for e in step.entries:
            d = e.seq.mtp_draft
            if d is not None:
                seen.setdefault(id(e.seq), {})[d[0]] = d[1]
                seqs[id(e.seq)] = e.seq

    drafter.after_step = spy
    outs = eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert eng.stats.draft_tokens > 0
    model = eng.runner.model
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    a = model.config.mla
    checked = 0
    for key, drafts in seen.items():
        ids = seqs[key].all_token_ids
        T = len(ids) - 1
        with torch.no_grad():
            hidden = hf.model(torch.tensor([ids[:-1]])).last_hidden_state[0]
            cache = torch.zeros(T, 1, a.kv_lora_rank + a.qk_rope_head_dim)
            meta = ForwardContext(slot_mapping=torch.arange(T), prefills=[PrefillChunk(0, T, T, None)],
                               linear=eng.runner.linear)  # the engine's panels: its projections' one copy
            want = model.mtp_logits(torch.tensor(ids[1:]), torch.arange(T), hidden, meta, (cache,)).argmax(-1)
        for pos, tok in drafts.items():
            if pos - 2 < T:  # row pos - 2 predicts the token at pos
                assert tok == int(want[pos - 2]), (pos, tok, int(want[pos - 2]))
                checked += 1
    assert checked >= len(outs) * 8
    assert drafter.rows > 0
    assert stack is None or stack.calls > 0  # the target's steps ran on the decode stack where it binds


class _CountingStack:
    def __init__(self, stack):
        self.stack, self.max_rows, self.calls = stack, stack.max_rows, 0

    def __call__(self, *a):
        self.calls += 1
        return self.stack(*a)


def _count_stack_calls(eng):
    """Wrap the engine's decode stack (bound on the native panels, MTP or not) to count its steps."""
    runner = eng.runner
    if runner.linear.backend != "native":
        return None
    assert runner.decode_stack is not None
    runner.decode_stack = _CountingStack(runner.decode_stack)
    return runner.decode_stack


def test_model_without_mtp_layer_is_refused(tmp_path):
    path = make_moe_model(tmp_path / "m", "deepseek_v3", seed=1, num_hidden_layers=2, num_nextn_predict_layers=1)
    with pytest.raises(InvalidRequestError, match="no multi-token-prediction layer"):
        Engine(str(path), kv_cache_memory=1 << 20, speculative="mtp")


def test_preemption_and_prefix_hits(oracle):
    """A KV budget that forces preemptions (the MTP cache is refilled by the recompute) and a second
    run of the same prompts served from the radix cache (MTP entries shared with the prefix)."""
    from test_engine_core import random_prompts

    plain = Engine(str(oracle), kv_cache_memory=4 << 20, block_size=4)
    spec = Engine(str(oracle), kv_cache_memory=40 * 4 * 576, block_size=4, speculative="mtp", speculative_budget=False)
    prompts = random_prompts(10, seed=9, lo=10, hi=25)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    a = plain.generate(prompts, sp)
    _same(a, spec.generate(prompts, sp))
    assert spec.stats.num_preemptions > 0, "the budget did not force a preemption"
    _same(a, spec.generate(prompts, sp))
    assert spec.stats.cached_prompt_tokens > 0
    assert spec.stats.accepted_draft_tokens > 0
    assert_all_blocks_free(spec)


def test_mtp_layer_stack_is_bitwise_its_per_op_path(oracle):
    """The MTP layer's own decode stack (its block and head norm over the rows eh_proj mixed): every MTP
    batch's logits equal, bit for bit, those of the same batch through the layer per op."""
    eng = Engine(str(oracle), kv_cache_memory=4 << 20, block_size=4, max_num_batched_tokens=16, speculative="mtp",
                 speculative_budget=False)
    runner = eng.runner
    if runner.linear.backend != "native":
        pytest.skip("the native kernels did not build: the panel GEMM is not the linear")
    assert runner.mtp_stacks[0] is not None
    real_prepare, real_forward = runner.prepare, runner.forward_mtp
    twins, checked = {}, []

    def prepare(batch, mtp_depth=None):
        p = real_prepare(batch, mtp_depth)
        if mtp_depth is not None:
            stack, runner.mtp_stacks[mtp_depth] = runner.mtp_stacks[mtp_depth], None
            twins[id(p)] = real_prepare(batch, mtp_depth)  # the same batch in the per-op form
            runner.mtp_stacks[mtp_depth] = stack
        return p

    def forward_mtp(batch, hidden, depth=0):
        out = real_forward(batch, hidden, depth)
        if batch.stack_block_tables is not None:
            assert torch.equal(out, real_forward(twins.pop(id(batch)), hidden, depth))  # (rewrites the same KV)
            checked.append(out.shape[0])
        return out

    runner.prepare, runner.forward_mtp = prepare, forward_mtp
    eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert len(checked) >= 8 and sum(checked) > 0
