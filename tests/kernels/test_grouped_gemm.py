"""deepinfer_kernels.grouped_gemm: the tile table, the CPU twin (target "c") against the torch reference,
its batch invariance, the MoE chaining, input errors; on a GPU the CUDA kernel and the engine path."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import KernelInputError, grouped_gemm as G
from deepinfer_kernels import moe_gemm


def _rows(counts, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(int(sum(counts)), K, generator=g)


@pytest.mark.parametrize("counts,block_m", [([5, 0, 70, 1, 3], 64), ([0, 0, 0], 16), ([16, 16], 16), ([1], 1),
                                            ([33, 0, 2, 64, 65], 32)])
def test_tile_table_covers_every_row_once_within_its_expert(counts, block_m):
    c = torch.tensor(counts)
    total = int(c.sum())
    start, end, expert = G.make_tiles(c, total, block_m)
    assert start.dtype == end.dtype == expert.dtype == torch.int32
    assert start.shape[0] == -(-total // block_m) + len(counts)
    first = torch.cumsum(c, 0) - c
    seen = torch.zeros(total, dtype=torch.long)
    for s, e, x in zip(start.tolist(), end.tolist(), expert.tolist()):
        assert 0 <= e - s <= block_m
        if e > s:
            assert first[x] <= s and e <= first[x] + c[x], "a tile straddles two experts"
            seen[s:e] += 1
    assert torch.equal(seen, torch.ones(total, dtype=torch.long))


def test_tile_table_errors():
    with pytest.raises(KernelInputError, match="counts must be a 1-D integer tensor"):
        G.make_tiles(torch.tensor([1.0, 2.0]), 3)
    with pytest.raises(KernelInputError, match="block_m must be a positive int"):
        G.make_tiles(torch.tensor([1, 2]), 3, 0)
    with pytest.raises(KernelInputError, match="total_rows must be a non-negative int"):
        G.make_tiles(torch.tensor([1, 2]), -1)


def test_reference_is_per_expert_matmul():
    counts = [3, 0, 4]
    x = _rows(counts, 8)
    w = torch.randn(3, 6, 8)
    y = G.grouped_gemm_reference(x, w, *G.make_tiles(torch.tensor(counts), 7, 2))
    assert torch.allclose(y[:3], x[:3] @ w[0].T, atol=1e-6) and torch.allclose(y[3:], x[3:] @ w[2].T, atol=1e-6)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("counts,N,K", [([5, 0, 70, 1, 3], 24, 40), ([1], 7, 13), ([129, 2], 33, 64)])
def test_cpu_twin_matches_reference(tilelang_available, gated, counts, N, K):
    E = len(counts)
    x = _rows(counts, K, seed=N)
    w = torch.randn(E, 2 * N if gated else N, K, generator=torch.Generator().manual_seed(K)) * 0.3
    tiles = G.make_tiles(torch.tensor(counts), x.shape[0])
    y = G.grouped_gemm_tilelang(x, w, *tiles, gated=gated)
    ref = G.grouped_gemm_reference(x, w, *tiles, gated=gated)
    torch.testing.assert_close(y, ref, atol=2e-5, rtol=1e-5)


def test_cpu_twin_rows_do_not_depend_on_their_tile_mates(tilelang_available):
    K, N = 48, 16
    w = torch.randn(2, 2 * N, K) * 0.3
    x = torch.randn(70, K)
    full = G.grouped_gemm_tilelang(x, w, *G.make_tiles(torch.tensor([30, 40]), 70), gated=True)
    for r in (0, 29, 30, 69):  # alone in its own tile
        e = 0 if r < 30 else 1
        counts = torch.tensor([1, 0]) if e == 0 else torch.tensor([0, 1])
        one = G.grouped_gemm_tilelang(x[r : r + 1], w, *G.make_tiles(counts, 1), gated=True)
        assert torch.equal(one[0], full[r])


def test_moe_experts_chain_matches_the_native_kernels_definition(tilelang_available):
    E, H, I, T, k = 5, 40, 24, 9, 2
    g = torch.Generator().manual_seed(0)
    gu, down = torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2
    x = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    out = G.moe_experts(x, idx, gu, down)
    torch.testing.assert_close(out, moe_gemm.moe_experts_reference(x, idx, gu, down), atol=2e-5, rtol=1e-5)
    # the same chain on the torch reference GEMM (what a CUDA machine without TileLang would compute)
    torch.testing.assert_close(G.moe_experts(x, idx, gu, down, gemm=G.grouped_gemm_reference), out, atol=2e-5, rtol=1e-5)


def test_bad_inputs_are_named():
    x = torch.randn(4, 8)
    w = torch.randn(2, 6, 8)
    tiles = G.make_tiles(torch.tensor([2, 2]), 4)
    G.check_args(x, w, *tiles, gated=True)
    with pytest.raises(KernelInputError, match="w must have dtype"):
        G.check_args(x, w.double(), *tiles, gated=False)
    with pytest.raises(KernelInputError, match=r"w.shape\[2\] must be 8"):
        G.check_args(x, torch.randn(2, 6, 9), *tiles, gated=False)
    with pytest.raises(KernelInputError, match="gated grouped GEMM needs w"):
        G.check_args(x, torch.randn(2, 5, 8), *tiles, gated=True)
    with pytest.raises(KernelInputError, match="tile_start must have dtype"):
        G.check_args(x, w, tiles[0].long(), tiles[1], tiles[2], gated=False)
    with pytest.raises(KernelInputError, match="tile_end.shape"):
        G.check_args(x, w, tiles[0], tiles[1][:1], tiles[2], gated=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernel_matches_reference(cuda_device, tilelang_available, dtype):
    E, H, I, T, k = 16, 256, 96, 70, 4
    g = torch.Generator().manual_seed(1)
    gu = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(cuda_device, dtype)
    down = (torch.randn(E, H, I, generator=g) * 0.05).to(cuda_device, dtype)
    x = torch.randn(T, H, generator=g).to(cuda_device, dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(cuda_device)
    out = G.moe_experts(x, idx, gu, down)
    ref = moe_gemm.moe_experts_reference(x.float().cpu(), idx.cpu(), gu.float().cpu(), down.float().cpu())
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3  # (fp32 inputs may run as TF32 on the tensor cores)
    torch.testing.assert_close(out.float().cpu(), ref, atol=tol, rtol=tol)
    one = G.moe_experts(x[5:6], idx[5:6], gu, down)  # a row alone equals the row in the batch
    assert torch.equal(one[0], out[5])


@pytest.mark.gpu
def test_gpu_bf16_engine_runs_moe_experts_through_the_kernel(cuda_device, tilelang_available, tmp_path):
    pytest.importorskip("transformers")
    from deepinfer import Engine, SamplingParams
    from deepinfer.engine.models.moe import MoeBlock
    from moe_factory import make_moe_model

    path = make_moe_model(tmp_path / "q3", "qwen3_moe", seed=2)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompts = ["the quick brown fox", "hello world"]
    eng = Engine(str(path), device="cuda", dtype="bfloat16", kv_cache_memory=8 << 20)
    assert eng.runner.expert_kernel_blocks == sum(isinstance(m, MoeBlock) for m in eng.runner.model.modules()) > 0
    ref = Engine(str(path), device="cuda", dtype="float32", kv_cache_memory=8 << 20, kernels="torch")
    assert ref.runner.expert_kernel_blocks == 0
    a, b = eng.generate(prompts, sp), ref.generate(prompts, sp)
    # the first token's logprob against the fp32 engine, at bf16's tolerance (the factory's weights give clear winners)
    for x, y in zip(a, b):
        assert x.token_ids[0] == y.token_ids[0]
        assert abs(x.logprobs[0].logprob - y.logprobs[0].logprob) < 0.05


@pytest.mark.gpu
def test_gpu_fp32_engine_keeps_fp32_expert_gemms(cuda_device, tilelang_available, tmp_path):
    """The kernel multiplies fp32 as TF32 (expert_kernels.py): an fp32 engine keeps torch's fp32 GEMMs under
    "auto", and gets the kernel with a warning when it asks for kernels="tilelang"."""
    pytest.importorskip("transformers")
    from deepinfer import Engine, SamplingParams
    from moe_factory import make_moe_model

    path = make_moe_model(tmp_path / "q3", "qwen3_moe", seed=2)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompts = ["the quick brown fox", "hello world"]
    auto = Engine(str(path), device="cuda", dtype="float32", kv_cache_memory=8 << 20)
    assert auto.runner.expert_kernel_blocks == 0
    ref = Engine(str(path), device="cuda", dtype="float32", kv_cache_memory=8 << 20, kernels="torch")
    a, b = auto.generate(prompts, sp), ref.generate(prompts, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert max(abs(x.logprob - y.logprob) for o, r in zip(a, b) for x, y in zip(o.logprobs, r.logprobs)) < 1e-5
    with pytest.warns(RuntimeWarning, match="TF32"):
        forced = Engine(str(path), device="cuda", dtype="float32", kv_cache_memory=8 << 20, kernels="tilelang")
    assert forced.runner.expert_kernel_blocks > 0


def test_the_kernel_entry_checks_its_inputs():
    x = torch.randn(4, 8)
    tiles = G.make_tiles(torch.tensor([2, 2]), 4)
    with pytest.raises(KernelInputError, match=r"w.shape\[2\] must be 8"):
        G.grouped_gemm_tilelang(x, torch.randn(2, 6, 9), *tiles)
