"""bi_attention: a query at position p gets the same bits in a full prefill, a chunked prefill, a
prefill after a cached prefix, and a decode step; batched decode rows equal single-row calls."""

import random

import pytest
import torch

from deepinfer.engine.batch_invariant import SPLIT, bi_attention, bi_attention_decode
from deepinfer.errors import InvalidRequestError


def reference_attention(q, k, v, scale, causal_offset):
    """Plain fp64 attention (GQA by repeating kv heads)."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    if causal_offset is not None:
        i = torch.arange(q.shape[0])[:, None]
        j = torch.arange(k.shape[0])[None, :]
        s = s.masked_fill(j > causal_offset + i, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv).float()


CASES = [
    # (kv_len, heads, kv_heads, head_dim)
    (37, 4, 4, 16),
    (SPLIT, 2, 1, 32),
    (SPLIT + 1, 6, 2, 8),
    (600, 9, 3, 64),  # SmolLM2-135M attention geometry
]


@pytest.mark.parametrize("kv_len,h,hkv,d", CASES)
def test_prefill_chunked_decode_bitwise_equal(kv_len, h, hkv, d):
    check_paths(kv_len, h, hkv, d)


def test_paths_equal_with_16_threads():
    """Same check with 16 BLAS threads (another work partition across threads)."""
    old = torch.get_num_threads()
    torch.set_num_threads(16)
    try:
        check_paths(300, 9, 3, 64)
    finally:
        torch.set_num_threads(old)


def check_paths(kv_len, h, hkv, d):
    g = torch.Generator().manual_seed(kv_len * 7 + h)
    q = torch.randn(kv_len, h, d, generator=g)
    k = torch.randn(kv_len, hkv, d, generator=g)
    v = torch.randn(kv_len, hkv, d, generator=g)
    scale = d**-0.5
    full = bi_attention(q, k, v, scale=scale, causal_offset=0)
    torch.testing.assert_close(full, reference_attention(q, k, v, scale, 0), rtol=1e-5, atol=1e-5)

    # chunked prefill with random chunk sizes (each chunk sees all keys up to its end)
    rng = random.Random(kv_len)
    pos, parts = 0, []
    while pos < kv_len:
        end = min(kv_len, pos + rng.randint(1, 90))
        parts.append(bi_attention(q[pos:end], k[:end], v[:end], scale=scale, causal_offset=pos))
        pos = end
    assert torch.equal(torch.cat(parts), full)

    # cached prefix: the first c tokens' KV exist, only the rest is computed
    c = rng.randint(1, kv_len - 1)
    tail = bi_attention(q[c:], k, v, scale=scale, causal_offset=c)
    assert torch.equal(tail, full[c:])

    # decode steps at positions around the split boundaries and at random places
    positions = {0, kv_len - 1, min(kv_len - 1, SPLIT - 1), min(kv_len - 1, SPLIT)} | {
        rng.randrange(kv_len) for _ in range(4)
    }
    for p in sorted(positions):
        step = bi_attention(q[p : p + 1], k[: p + 1], v[: p + 1], scale=scale, causal_offset=p)
        assert torch.equal(step[0], full[p]), p


def test_keys_beyond_the_causal_limit_do_not_matter():
    """A query's output ignores the values of keys it cannot see (prefill computes them all)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, 4, 16, generator=g)
    k = torch.randn(400, 2, 16, generator=g)
    v = torch.randn(400, 2, 16, generator=g)
    a = bi_attention(q, k, v, scale=0.25, causal_offset=100)
    k2, v2 = k.clone(), v.clone()
    k2[105:] = torch.randn(295, 2, 16, generator=g) * 100
    v2[105:] = 1e6
    assert torch.equal(bi_attention(q, k2, v2, scale=0.25, causal_offset=100), a)


def test_non_causal_matches_reference():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(7, 4, 32, generator=g)
    k = torch.randn(300, 2, 32, generator=g)
    v = torch.randn(300, 2, 32, generator=g)
    out = bi_attention(q, k, v, scale=0.2, causal_offset=None)
    torch.testing.assert_close(out, reference_attention(q, k, v, 0.2, None), rtol=1e-5, atol=1e-5)


def test_query_that_sees_no_key_is_zero():
    q = torch.randn(3, 2, 8)
    k = torch.randn(4, 2, 8)
    out = bi_attention(q, k, k.clone(), scale=1.0, causal_offset=-2)
    assert torch.equal(out[:2], torch.zeros(2, 2, 8))  # queries 0, 1 see keys <= -2, -1
    torch.testing.assert_close(out[2], reference_attention(q[2:], k[:1], k[:1], 1.0, 0)[0])


def test_batched_decode_rows_equal_single_calls(threads):
    g = torch.Generator().manual_seed(5)
    h, hkv, d = 9, 3, 64
    lengths = [1, 255, 256, 257, 700, 40]
    l_max = max(lengths) + 3
    q = torch.randn(len(lengths), h, d, generator=g)
    k = torch.randn(len(lengths), l_max, hkv, d, generator=g)
    v = torch.randn(len(lengths), l_max, hkv, d, generator=g)
    out = bi_attention_decode(q, k, v, lengths, scale=0.125)
    for b, n in enumerate(lengths):
        single = bi_attention(q[b : b + 1], k[b, :n], v[b, :n], scale=0.125, causal_offset=n - 1)
        assert torch.equal(out[b], single[0]), b
    # a sub-batch gives the same bits too
    sub = bi_attention_decode(q[2:4], k[2:4, :300], v[2:4, :300], lengths[2:4], scale=0.125)
    assert torch.equal(sub, out[2:4])


def test_attention_shape_errors():
    q = torch.randn(2, 6, 8)
    k = torch.randn(5, 4, 8)
    with pytest.raises(InvalidRequestError, match="multiple of num kv heads"):
        bi_attention(q, k, k, scale=1.0, causal_offset=3)
    with pytest.raises(InvalidRequestError, match="head dims"):
        bi_attention(q, torch.randn(5, 3, 4), torch.randn(5, 3, 4), scale=1.0, causal_offset=3)
    with pytest.raises(InvalidRequestError, match="lengths must lie"):
        bi_attention_decode(q, torch.randn(2, 5, 3, 8), torch.randn(2, 5, 3, 8), [1, 9], scale=1.0)
    with pytest.raises(InvalidRequestError, match="one entry per row"):
        bi_attention_decode(q, torch.randn(2, 5, 3, 8), torch.randn(2, 5, 3, 8), [1], scale=1.0)
