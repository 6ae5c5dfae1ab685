"""deepinfer_kernels.fp8_gemm: the e4m3 table, the dense and grouped W8A16 block-FP8 GEMMs' CPU twins
(target "c") against the torch definitions, their batch invariance, input errors; on a GPU the CUDA
kernels."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import KernelInputError, fp8_gemm as F8, grouped_gemm as G


def _weights(shape, block_k, seed):
    """Codes spread over e4m3's range (subnormals and large values included) and per-block scales."""
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(*shape, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(*shape[:-1], -(-shape[-1] // block_k), generator=g) * 0.02 + 1e-3
    return codes, scale


def test_table_is_torchs_decoding_of_every_code():
    t = F8.e4m3_table()
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float()
    assert t.shape == (256,) and t.dtype == torch.float32
    assert torch.equal(t.isnan(), want.isnan()) and int(t.isnan().sum()) == 2  # 0x7f and 0xff
    ok = ~want.isnan()
    assert torch.equal(t[ok], want[ok])
    assert t[0x7E] == 448 and t[0x01] == 2.0**-9  # largest normal, smallest subnormal


def test_reference_is_the_dequantised_matmul():
    codes, scale = _weights((24, 40), 16, 0)
    x = torch.randn(5, 40)
    w = torch.stack([torch.stack([codes[n, k].float() * scale[n, k // 16] for k in range(40)]) for n in range(24)])
    torch.testing.assert_close(F8.fp8_gemm_reference(x, codes, scale, 16), x @ w.T, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("M,N,K,block_k", [(1, 24, 40, 16), (37, 40, 300, 128), (70, 7, 13, 4), (16, 128, 256, 128)])
def test_cpu_twin_matches_reference(tilelang_available, M, N, K, block_k):
    codes, scale = _weights((N, K), block_k, N + K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    y = F8.fp8_gemm_tilelang(x, codes, scale, block_k)
    torch.testing.assert_close(y, F8.fp8_gemm_reference(x, codes, scale, block_k), atol=1e-4, rtol=1e-5)
    assert torch.equal(F8.fp8_gemm_tilelang(x, codes.view(torch.uint8), scale, block_k), y)  # codes as bytes


def test_cpu_twin_rows_do_not_depend_on_the_batch(tilelang_available):
    codes, scale = _weights((40, 96), 32, 7)
    x = torch.randn(33, 96)
    full = F8.fp8_gemm_tilelang(x, codes, scale, 32)
    for r in (0, 15, 16, 32):
        assert torch.equal(F8.fp8_gemm_tilelang(x[r : r + 1], codes, scale, 32)[0], full[r])


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("counts,N,K,block_k", [([5, 0, 70, 1, 3], 24, 40, 16), ([1], 7, 13, 8), ([129, 2], 33, 64, 128)])
def test_grouped_cpu_twin_matches_reference(tilelang_available, gated, counts, N, K, block_k):
    E = len(counts)
    codes, scale = _weights((E, 2 * N if gated else N, K), block_k, N)
    x = torch.randn(sum(counts), K, generator=torch.Generator().manual_seed(K))
    tiles = G.make_tiles(torch.tensor(counts), x.shape[0])
    y = F8.grouped_tilelang(x, codes, scale, block_k, *tiles, gated=gated)
    ref = F8.grouped_reference(x, codes, scale, block_k, *tiles, gated=gated)
    torch.testing.assert_close(y, ref, atol=1e-3, rtol=1e-5)


def test_fp8_experts_chain_equals_the_dequantised_experts(tilelang_available):
    E, H, I, T, k, bk = 5, 40, 24, 9, 2, 16
    gu, dn = _weights((E, 2 * I, H), bk, 1), _weights((E, H, I), bk, 2)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3))
    idx = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:k] for t in range(T)])
    out = F8.moe_experts(x, idx, F8.ExpertStack(*gu, bk), F8.ExpertStack(*dn, bk))
    deq = [torch.stack([F8.dequantize(c[e], s[e], bk) for e in range(E)]) for c, s in (gu, dn)]
    ref = G.moe_experts(x, idx, *deq, gemm=G.grouped_gemm_reference)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)
    one = F8.moe_experts(x[4:5], idx[4:5], F8.ExpertStack(*gu, bk), F8.ExpertStack(*dn, bk))
    assert torch.equal(one[0], out[4])  # a row alone equals the row in the batch


def test_entries_check_their_inputs():
    codes, scale = _weights((8, 40), 16, 0)
    x = torch.randn(3, 40)
    with pytest.raises(KernelInputError, match=r"w.shape\[1\] must be 41 \(K of x\), got 40"):
        F8.fp8_gemm_tilelang(torch.randn(3, 41), codes, scale, 16)
    with pytest.raises(KernelInputError, match=r"scale.shape\[1\] must be 3 \(ceil\(K / block_k=16\)\)"):
        F8.fp8_gemm_tilelang(x, codes, scale[:, :2], 16)
    with pytest.raises(KernelInputError, match="w must have dtype uint8, float8_e4m3fn"):
        F8.fp8_gemm_tilelang(x, codes.float(), scale, 16)
    with pytest.raises(KernelInputError, match="block_k must be a positive int"):
        F8.fp8_gemm_reference(x, codes, scale, 0)
    with pytest.raises(KernelInputError, match="supports float32 only"):
        F8.fp8_gemm_tilelang(x.bfloat16(), codes, scale, 16)
    tiles = G.make_tiles(torch.tensor([2, 1]), 3)
    gcodes, gscale = _weights((2, 8, 40), 16, 1)
    with pytest.raises(KernelInputError, match=r"scale must have shape \(2, 8, 3\)"):
        F8.grouped_tilelang(x, gcodes, gscale[:, :4], 16, *tiles)
    with pytest.raises(KernelInputError, match="a gated grouped GEMM needs w"):
        F8.grouped_tilelang(x, gcodes[:, :7], gscale[:, :7], 16, *tiles, gated=True)


def _close(got, want, rel):
    """Equal within `rel` of want's largest magnitude. The sums here reach ~1e3 and are rounded to bf16 /
    fp16; where the summation order differs from the reference's, a rounding of the gated intermediate
    can move by one unit in the last place, and the down GEMM carries that into every output, so an
    output near zero can be far off in relative terms (seen on an H200: 0.17 on an output of 2.2 among
    outputs up to ~7e3; emulated on CPU, fp32 against fp64 sums: 7e-4 of the largest output at most)."""
    torch.testing.assert_close(got.float(), want.float(), atol=rel * want.float().abs().max().item(), rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_kernels_match_reference(cuda_device, tilelang_available, dtype):
    N, K, bk = 320, 512, 128
    codes, scale = _weights((N, K), bk, 11)
    x = torch.randn(70, K, generator=torch.Generator().manual_seed(1)).to(dtype)
    dev = [t.to(cuda_device) for t in (x, codes, scale)]
    y = F8.fp8_gemm_tilelang(*dev, bk)
    ref = F8.fp8_gemm_reference(x.float(), codes, scale, bk)  # fp32 weights: the bf16 rounding is within tolerance
    _close(y.cpu(), ref, 0.02)
    _close(y, F8.fp8_gemm_reference(*dev, bk), 5e-3)  # vs cuBLAS on the same weights
    for split in (1, 2, 4):  # the k split (split_for's choice above) changes only the summation order
        _close(F8.fp8_gemm_tilelang(*dev, bk, split=split), y, 5e-3)
    one = F8.fp8_gemm_tilelang(dev[0][5:6], *dev[1:], bk, split=1)
    assert torch.equal(one[0], F8.fp8_gemm_tilelang(*dev, bk, split=1)[5])  # unsplit: a row alone is the row in the batch
    E, H, I, T, k = 16, 256, 96, 70, 4
    gu, dn = _weights((E, 2 * I, H), bk, 2), _weights((E, H, I), bk, 3)
    g = torch.Generator().manual_seed(4)
    xs = torch.randn(T, H, generator=g).to(cuda_device, dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(cuda_device)
    stacks = [F8.ExpertStack(c.to(cuda_device), s.to(cuda_device), bk) for c, s in (gu, dn)]
    out = F8.moe_experts(xs, idx, *stacks)
    deq = [torch.stack([F8.dequantize(c[e], s[e], bk, dtype) for e in range(E)]).to(cuda_device) for c, s in (gu, dn)]
    _close(out, G.moe_experts(xs, idx, *deq, gemm=G.grouped_gemm_reference), 2e-3)
    one = F8.moe_experts(xs[5:6], idx[5:6], *stacks)
    assert torch.equal(one[0], out[5])


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_gpu_bf16_engine_keeps_fp8_and_runs_the_kernels(cuda_device, tilelang_available, tmp_path, arch):
    """fp8_weights="auto" on a bf16 CUDA engine keeps the projections FP8 (the dense and grouped kernels),
    and runs like the same checkpoint dequantised at load (the same bf16 weights; GEMM order differs)."""
    pytest.importorskip("transformers")
    from deepinfer import Engine, SamplingParams
    from deepinfer.engine.models.moe import MoeBlock
    from fp8_factory import make_fp8_pair
    from moe_factory import make_moe_model

    fp8_dir, ref_dir, _ = make_fp8_pair(make_moe_model(tmp_path / "src", arch, seed=2), tmp_path)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompts = ["the quick brown fox", "hello world"]
    eng = Engine(str(fp8_dir), device="cuda", dtype="bfloat16", kv_cache_memory=8 << 20)
    assert eng.precision == "bfloat16+fp8-weights" and eng.runner.linear.use_kernel
    assert eng.runner.expert_kernel_blocks == sum(isinstance(m, MoeBlock) for m in eng.runner.model.modules()) > 0
    ref = Engine(str(ref_dir), device="cuda", dtype="bfloat16", kv_cache_memory=8 << 20)
    assert ref.precision == "bfloat16" and eng.stats.weight_bytes < ref.stats.weight_bytes
    a, b = eng.generate(prompts, sp), ref.generate(prompts, sp)
    for x, y in zip(a, b):
        assert x.token_ids[0] == y.token_ids[0]
        assert abs(x.logprobs[0].logprob - y.logprobs[0].logprob) < 0.05


def test_k_split_policy_fills_the_gpu_with_two_variants_a_shape_at_most(monkeypatch):
    """split_for (CUDA): no split once the (column, row) tiles reach the multiprocessors; below that the
    shape's one decode split, a power of two up to 16 and the k slices. Checked with a stated SM count
    (132, an H200's), no GPU needed."""
    monkeypatch.setitem(F8._SMS, 0, 132)
    dev = torch.device("cuda", 0)
    assert F8.decode_split(1536, 7168, dev) == 8  # 24 column tiles: 8 parts give 192 blocks
    assert F8.decode_split(7168, 2048, dev) == 2  # 112 tiles: 2 parts
    assert F8.decode_split(36864, 7168, dev) == 1  # 576 tiles fill it alone
    assert F8.decode_split(64, 128, dev) == 2  # two k slices: two parts at most
    for n, k in ((1536, 7168), (7168, 2048), (576, 7168), (64, 128)):
        seen = {F8.split_for(m, n, k, dev) for m in (1, 3, 64, 65, 130, 300, 1000, 5000, 20000)}
        assert seen <= {1, F8.decode_split(n, k, dev)}
        assert F8.split_for(20000, n, k, dev) == 1  # 313+ row tiles
