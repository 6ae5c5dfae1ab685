"""Benchmark (not a test): overhead of the batch-invariant ops over plain torch.

Run: .venv/bin/python benchmarks/bi_ops.py
Prints best-of-N milliseconds (best-of because the machine may be shared and noisy).
"""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from common import best_ms  # noqa: E402
from deepinfer.engine.batch_invariant import bi_attention, bi_matmul  # noqa: E402


def bench_matmul():
    print("bi_matmul vs F.linear, ms (best of N); K x N from SmolLM2-135M")
    for k_dim, n_dim in [(576, 576), (576, 1536), (1536, 576), (576, 49152)]:
        w = torch.randn(n_dim, k_dim)
        for m in [1, 8, 32, 128]:
            x = torch.randn(m, k_dim)
            reps = 7 if n_dim > 10000 else 50
            base = best_ms(lambda: F.linear(x, w), reps)
            pad = best_ms(lambda: bi_matmul(x, w, scheme="ttiles"), reps)
            tpad = best_ms(lambda: bi_matmul(x, w, scheme="tpad16"), reps)
            tiles = best_ms(lambda: bi_matmul(x, w, scheme="tiles"), reps)
            print(
                f"  K={k_dim:5d} N={n_dim:5d} M={m:3d}: linear {base:8.3f}  ttiles {pad:8.3f} ({pad / base:5.2f}x)  tpad16 {tpad:8.3f} ({tpad / base:5.2f}x)"
                f"  tiles {tiles:8.3f} ({tiles / base:5.2f}x)"
            )


def bench_attention():
    print("bi_attention vs F.scaled_dot_product_attention (9 heads, 3 kv heads, D=64), ms")
    h, hkv, d = 9, 3, 64
    for q_len, kv_len in [(1, 512), (1, 2048), (128, 128), (512, 512)]:
        q = torch.randn(q_len, h, d)
        k = torch.randn(kv_len, hkv, d)
        v = torch.randn(kv_len, hkv, d)
        off = kv_len - q_len
        qq = q.transpose(0, 1)[None]
        kk = k.repeat_interleave(h // hkv, 1).transpose(0, 1)[None]
        vv = v.repeat_interleave(h // hkv, 1).transpose(0, 1)[None]
        mask = torch.arange(kv_len)[None, :] <= (off + torch.arange(q_len))[:, None]
        base = best_ms(lambda: F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask), 10)
        ours = best_ms(lambda: bi_attention(q, k, v, scale=d**-0.5, causal_offset=off), 10)
        print(f"  q_len={q_len:4d} kv_len={kv_len:5d}: sdpa {base:8.3f}  bi {ours:8.3f} ({ours / base:5.2f}x)")


if __name__ == "__main__":
    bench_matmul()
    bench_attention()
