"""attention.group_prefills: prefill chunks attended in one SDPA call per group (the CUDA runner's
way). On CPU with kernels="torch" the runner's switch is turned on by hand: the grouped step must give
what one call per chunk gives (prefix hits, chunked prefill, GQA and latent attention included), and
the grouping must cover each chunk once within its caps."""

from __future__ import annotations

import pytest
import torch

from deepinfer import Engine, SamplingParams
from deepinfer.engine import attention as A
from deepinfer.engine.attention import PrefillChunk, group_prefills

PROMPTS = ["the quick brown fox jumps over the lazy dog " * 3, "hello", "hello world, how are you today?",
           "the quick brown fox jumps over the lazy dog " * 3 + "and then", "a b c d e f g h i j k l m n o p",
           "one two three"]


def _engine(path, grouped: bool, **kw):
    eng = Engine(str(path), kernels="torch", kv_cache_memory=32 << 20, **kw)
    assert eng.runner.token_attention is None  # the SDPA path, as on CUDA
    eng.runner.group_prefills = grouped
    return eng


def _run(eng):
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    first = eng.generate(PROMPTS[:3], sp)  # then prefix hits: PROMPTS[3] extends PROMPTS[0]
    return first + eng.generate(PROMPTS, sp)


def _prompt_lps(outs):
    return [x.logprob for o in outs for x in o.prompt_logprobs if x is not None]


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 24}], ids=["whole", "chunked"])
@pytest.mark.parametrize("arch", ["qwen3", "llama", "deepseek_v3"])
def test_grouped_prefills_equal_one_call_per_chunk(tiny_models, tmp_path, monkeypatch, arch, kw):
    if arch == "deepseek_v3":
        from moe_factory import make_moe_model

        path = make_moe_model(tmp_path / arch, arch, seed=2)
    else:
        path = tiny_models[arch]
    calls = []
    grouped_attention = A.grouped_prefill_attention
    monkeypatch.setattr(A, "grouped_prefill_attention", lambda *a: calls.append(a[3].shape) or grouped_attention(*a))
    a = _run(_engine(path, True, **kw))
    assert calls and max(b for b, _, _ in calls) > 1  # the grouped path ran, on several chunks at once
    b = _run(_engine(path, False, **kw))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    torch.testing.assert_close(torch.tensor(_prompt_lps(a)), torch.tensor(_prompt_lps(b)), atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor([x.logprob for o in a for x in o.logprobs]),
                               torch.tensor([x.logprob for o in b for x in o.logprobs]), atol=1e-4, rtol=0)


def test_groups_cover_each_chunk_once_within_their_caps(monkeypatch):
    monkeypatch.setattr(A, "GROUP_SCORES_MAX", 600 * 4)  # 4 heads
    monkeypatch.setattr(A, "GROUP_KEYS_MAX", 100 * 4 * 8)  # of dim 8
    bs = 4
    lens = [(3, 10), (1, 7), (12, 12), (5, 5), (2, 30), (6, 9), (40, 40), (1, 1), (3, 28), (1, 25)]  # (q_len, ctx_len)
    chunks, q = [], 0
    for ql, cl in lens:
        chunks.append(PrefillChunk(q, ql, cl, None))
        q += ql
    width = max(-(-cl // bs) for _, cl in lens)
    block_rows = torch.arange(len(lens) * width).view(len(lens), width) * 3 + 1  # distinct, scattered blocks
    groups = group_prefills(chunks, block_rows, bs, "cpu", heads=4, head_dim=8)
    dst = torch.cat([g.dst for g in groups])
    assert dst.numel() == dst.unique().numel()  # no query row twice
    grouped = {c.q_start for c in chunks if c.grouped}
    want = {r for c in chunks if c.grouped for r in range(c.q_start, c.q_start + c.q_len)}
    assert set(dst.tolist()) == want and len(groups) == 3
    assert not chunks[6].grouped  # 40 x 40 alone exceeds the mask cap: one call of its own
    for g in groups:
        B, Lq, Lk = g.shape
        assert B > 1 and B * Lq * Lk <= 600 and B * Lk <= 100
        assert g.mask.shape == (B, 1, Lq, Lk) and g.mask.any(-1).all()  # no query row without a key
    # each real query row sees exactly its causal context, in its own blocks' slots
    for g in groups:
        B, Lq, Lk = g.shape
        rows, slots, mask = g.q_rows.view(B, Lq), g.kv_slots.view(B, Lk), g.mask[:, 0]
        for b in range(B):
            c = next(c for c in chunks if c.q_start == int(rows[b, 0]))
            i = chunks.index(c)
            assert c.q_start in grouped
            for t in range(c.q_len):
                pos = c.ctx_len - c.q_len + t
                assert mask[b, t].nonzero().squeeze(1).tolist() == list(range(pos + 1))
            want_slots = [int(block_rows[i, p // bs]) * bs + p % bs for p in range(c.ctx_len)]
            assert slots[b, : c.ctx_len].tolist() == want_slots
