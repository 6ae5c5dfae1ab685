"""The same batch-invariance checks on a CUDA device (skipped without one)."""

import random

import pytest
import torch

from deepinfer.engine.batch_invariant import (
    SPLIT,
    bi_attention,
    bi_attention_decode,
    bi_log_softmax,
    bi_matmul,
    bi_rmsnorm,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
KS = [1, 2, 3, 5, 7, 8, 13, 16, 31, 64, 65, 100, 200]


def bad_prefixes(fn, x, ks=KS):
    full = fn(x)
    return [k for k in ks if not torch.equal(fn(x[:k]), full[:k])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_dim,n_dim", [(576, 576), (576, 1536), (1536, 576), (576, 49152)])
def test_cuda_bi_matmul(k_dim, n_dim, dtype):
    g = torch.Generator(device="cuda").manual_seed(k_dim + n_dim)
    x = torch.randn(256, k_dim, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n_dim, k_dim, device="cuda", generator=g) * 0.05).to(dtype)
    assert bad_prefixes(lambda t: bi_matmul(t, w), x) == []


def test_cuda_rows_ops():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 131072, device="cuda", generator=g)
    w = torch.rand(131072, device="cuda", generator=g)
    assert bad_prefixes(lambda t: bi_rmsnorm(t, w, 1e-5), x) == []
    assert bad_prefixes(bi_log_softmax, x) == []


def test_cuda_attention_paths():
    g = torch.Generator(device="cuda").manual_seed(1)
    kv_len, h, hkv, d = 700, 9, 3, 64
    q = torch.randn(kv_len, h, d, device="cuda", generator=g)
    k = torch.randn(kv_len, hkv, d, device="cuda", generator=g)
    v = torch.randn(kv_len, hkv, d, device="cuda", generator=g)
    full = bi_attention(q, k, v, scale=0.125, causal_offset=0)
    rng = random.Random(0)
    pos, parts = 0, []
    while pos < kv_len:
        end = min(kv_len, pos + rng.randint(1, 120))
        parts.append(bi_attention(q[pos:end], k[:end], v[:end], scale=0.125, causal_offset=pos))
        pos = end
    assert torch.equal(torch.cat(parts), full)
    for p in [0, SPLIT - 1, SPLIT, 511, 699]:
        step = bi_attention(q[p : p + 1], k[: p + 1], v[: p + 1], scale=0.125, causal_offset=p)
        assert torch.equal(step[0], full[p]), p
    lengths = [1, 256, 257, 700]
    kb = torch.zeros(4, 700, hkv, d, device="cuda")
    vb = torch.zeros(4, 700, hkv, d, device="cuda")
    for b, n in enumerate(lengths):
        kb[b, :n], vb[b, :n] = k[:n], v[:n]
    qs = q[[0, 255, 256, 699]]
    out = bi_attention_decode(qs, kb, vb, lengths, scale=0.125)
    for b, n in enumerate(lengths):
        assert torch.equal(out[b], full[n - 1]), b
