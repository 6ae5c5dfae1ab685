"""Paged decode attention: C twin vs reference across block/split boundaries, batch invariance."""

import math

import pytest
import torch

from deepinfer_kernels import KernelInputError, paged_decode_attention
from deepinfer_kernels.paged_attention import (
    SPLIT,
    paged_decode_attention_reference,
    paged_decode_attention_tilelang,
)

H, HKV, D, BS = 9, 3, 64, 16  # SmolLM2-135M's attention shape; GQA group of 3
SCALE = 1 / math.sqrt(D)


def make(lens, num_blocks=80, max_blocks=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max_blocks or max((n + BS - 1) // BS for n in lens)
    q = torch.randn(len(lens), H, D, generator=g)
    kc = torch.randn(num_blocks, BS, HKV, D, generator=g)
    vc = torch.randn(num_blocks, BS, HKV, D, generator=g)
    bt = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in lens]).to(torch.int32)
    return q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32)


def naive(q, kc, vc, bt, cl, scale):
    """Per sequence and head, straight from the definition (float64)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    g = q.shape[1] // kc.shape[2]
    for b in range(q.shape[0]):
        n = int(cl[b])
        pos = torch.arange(n)
        blocks = bt[b].long()[pos // BS]
        k = kc[blocks, pos % BS].double()  # [n, Hkv, D]
        v = vc[blocks, pos % BS].double()
        for h in range(q.shape[1]):
            p = torch.softmax(k[:, h // g] @ q[b, h].double() * scale, 0)
            out[b, h] = p @ v[:, h // g]
    return out


def test_reference_matches_naive_definition():
    args = make([1, 17, 300], seed=1)
    ref = paged_decode_attention_reference(*args, SCALE)
    torch.testing.assert_close(ref.double(), naive(*args, SCALE), rtol=1e-5, atol=1e-5)


# Lengths around block (16) and split (256) edges.
LENS = [1, 15, 16, 17, SPLIT - 1, SPLIT, SPLIT + 1, 2 * SPLIT + 1, 700]


def test_twin_matches_reference_across_block_and_split_boundaries(tilelang_available):
    args = make(LENS, num_blocks=64, seed=2)
    ref = paged_decode_attention_reference(*args, SCALE)
    got = paged_decode_attention_tilelang(*args, SCALE)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-6)


def test_twin_batch_1_and_64(tilelang_available):
    for lens in ([300], [int(x) for x in torch.randint(1, 600, (64,), generator=torch.Generator().manual_seed(4))]):
        args = make(lens, num_blocks=48, seed=len(lens))
        torch.testing.assert_close(
            paged_decode_attention_tilelang(*args, SCALE), paged_decode_attention_reference(*args, SCALE), rtol=1e-5, atol=2e-6
        )


def test_twin_is_batch_and_padding_invariant(tilelang_available):
    q, kc, vc, bt, cl = make(LENS, num_blocks=64, seed=5)
    full = paged_decode_attention_tilelang(q, kc, vc, bt, cl, SCALE)
    for i in (0, 6, 8):
        need = (int(cl[i]) + BS - 1) // BS
        # Alone, and with a block table trimmed to what the sequence needs.
        one = paged_decode_attention_tilelang(q[i : i + 1], kc, vc, bt[i : i + 1, :need].contiguous(), cl[i : i + 1], SCALE)
        assert torch.equal(one[0], full[i])


def test_dispatch_agrees_with_reference_on_cpu():
    args = make([5, 40], seed=6)
    torch.testing.assert_close(
        paged_decode_attention(*args, SCALE), paged_decode_attention_reference(*args, SCALE), rtol=1e-5, atol=2e-6
    )


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: a.__setitem__(4, torch.tensor([0, 5], dtype=torch.int32)), r"context_lens must be in \[1"),
        (lambda a: a.__setitem__(4, torch.tensor([1, 10**6], dtype=torch.int32)), r"context_lens must be in \[1"),
        (lambda a: a.__setitem__(3, torch.full_like(a[3], 999)), "block ids outside"),
        (lambda a: a.__setitem__(1, a[1][:, :, :2]), "multiple of KV heads|v_cache shape"),
        (lambda a: a.__setitem__(0, a[0].double()), "q must have dtype"),
        (lambda a: a.__setitem__(3, a[3].long()), "block_tables must have dtype int32"),
    ],
)
def test_bad_inputs_raise_typed_errors(mutate, match):
    args = list(make([5, 40], seed=7))
    mutate(args)
    with pytest.raises(KernelInputError, match=match):
        paged_decode_attention(*args, SCALE)
