"""GPU kernels against the torch references (run on a CUDA machine: pytest -m gpu tests/kernels)."""

import math

import pytest
import torch

from deepinfer_kernels import dispatch, rng
from deepinfer_kernels.noise import noise_tilelang
from deepinfer_kernels.paged_attention import paged_decode_attention_reference, paged_decode_attention_tilelang
from deepinfer_kernels.rmsnorm import fused_add_rmsnorm_reference, fused_add_rmsnorm_tilelang
from deepinfer_kernels.sampling import masked_sample_reference, masked_sample_tilelang

from kernels_testutil import assert_same_draws, pack_bool_mask, random_bitmask

pytestmark = pytest.mark.gpu


def test_gpu_noise_is_bit_identical_to_torch_cpu_and_cuda(cuda_device, tilelang_available):
    h = (torch.arange(1 << rng.UNIFORM_BITS, dtype=torch.int64) << 9) | 0x155
    cpu_ref = rng.gumbel_portable_from_hash(h)
    cuda_ref = rng.gumbel_portable_from_hash(h.to(cuda_device))
    got = noise_tilelang(h.to(cuda_device))
    assert torch.equal(cuda_ref.cpu().view(torch.int32), cpu_ref.view(torch.int32))
    assert torch.equal(got.cpu().view(torch.int32), cpu_ref.view(torch.int32))


@pytest.mark.parametrize("batch,vocab", [(1, 33), (1, 49152), (8, 49152), (64, 129280), (64, 1003)])
def test_gpu_sampling_matches_reference(cuda_device, tilelang_available, batch, vocab):
    g = torch.Generator().manual_seed(batch + vocab)
    logits = torch.randn(batch, vocab, generator=g) * 3
    mask = random_bitmask(g, batch, vocab, 0.5)
    temp = torch.rand(batch, generator=g) + 0.1
    temp[::3] = 0
    keys = torch.tensor([rng.row_key(i, 5) for i in range(batch)], dtype=torch.int64)
    cpu_ref = masked_sample_reference(logits, mask, temp, keys)
    dev = [t.to(cuda_device) for t in (logits, mask, temp, keys)]
    assert_same_draws(masked_sample_reference(*dev), cpu_ref, logits, mask, temp, keys)
    assert_same_draws(masked_sample_tilelang(*dev), cpu_ref, logits, mask, temp, keys)


def test_gpu_sampling_edge_rows(cuda_device, tilelang_available):
    vocab = 10000  # several 4096-token chunks: ties and maxima across chunk edges
    logits = torch.zeros(6, vocab)
    logits[0, [10, 20, 30]] = 5.0
    logits[1, :] = float("-inf")
    logits[4, [4096, 4095, 9000]] = 7.0  # tie across the first chunk edge: 4095 wins
    logits[5, [8192, 9999]] = 3.0  # first max in a later chunk
    allowed = torch.ones(6, vocab, dtype=torch.bool)
    allowed[2] = False
    allowed[3] = False
    allowed[3, vocab - 1] = True
    mask = pack_bool_mask(allowed)
    for temp in (torch.zeros(6), torch.ones(6)):
        keys = torch.arange(6, dtype=torch.int64)
        ref = masked_sample_reference(logits, mask, temp, keys)
        got = masked_sample_tilelang(*(t.to(cuda_device) for t in (logits, mask, temp, keys)))
        assert_same_draws(got, ref, logits, mask, temp, keys, max_differ=0)
        assert ref[2].item() == 0 and ref[3].item() == vocab - 1
    assert ref.tolist()[0] in range(vocab) and masked_sample_reference(logits, mask, torch.zeros(6), keys).tolist() == [
        10, 0, 0, vocab - 1, 4095, 8192
    ]


@pytest.mark.parametrize("hidden", [576, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_rmsnorm(cuda_device, tilelang_available, hidden, dtype):
    g = torch.Generator().manual_seed(hidden)
    x, r = (torch.randn(64, hidden, generator=g).to(cuda_device, dtype) for _ in range(2))
    w = (torch.rand(hidden, generator=g) + 0.5).to(cuda_device, dtype)
    ref_n, ref_h = fused_add_rmsnorm_reference(x, r, w, 1e-5)
    n, h = fused_add_rmsnorm_tilelang(x, r, w, 1e-5)
    assert torch.equal(h, ref_h)
    tol = dict(rtol=2e-6, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(n, ref_n, **tol)
    one, _ = fused_add_rmsnorm_tilelang(x[5:6], r[5:6], w, 1e-5)
    assert torch.equal(one[0], n[5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(9, 3, 64, 16), (32, 8, 128, 16)])
def test_gpu_paged_attention(cuda_device, tilelang_available, dtype, shape):
    h, hkv, d, bs = shape
    lens = [1, 15, 16, 17, 255, 256, 257, 513, 1000, 2049]
    g = torch.Generator().manual_seed(h)
    nb = 400
    mb = max((n + bs - 1) // bs for n in lens)
    q = torch.randn(len(lens), h, d, generator=g)
    kc = torch.randn(nb, bs, hkv, d, generator=g)
    vc = torch.randn(nb, bs, hkv, d, generator=g)
    bt = torch.stack([torch.randperm(nb, generator=g)[:mb] for _ in lens]).to(torch.int32)
    cl = torch.tensor(lens, dtype=torch.int32)
    scale = 1 / math.sqrt(d)
    args = [t.to(cuda_device) for t in (q, kc, vc, bt, cl)]
    args[:3] = [t.to(dtype) for t in args[:3]]
    ref = paged_decode_attention_reference(*args, scale)
    got = paged_decode_attention_tilelang(*args, scale)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), ref.float(), **tol)
    one = paged_decode_attention_tilelang(args[0][8:9], args[1], args[2], args[3][8:9, :63].contiguous(), args[4][8:9], scale)
    assert torch.equal(one[0], got[8])


def test_gpu_dispatch_picks_tilelang(cuda_device, tilelang_available):
    with dispatch.use_backend("auto"):
        for op in dispatch.OPS:
            assert dispatch.selected_backend(op, cuda_device) == "tilelang"
