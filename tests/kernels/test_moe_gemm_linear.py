"""deepinfer_kernels.moe_gemm.linear: the plain projection on the expert kernel's register tile, against
torch, its row invariance (bitwise: a row's result never depends on M or the tile it lands in, across
k blocks and threads), and input checks."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import KernelInputError, moe_gemm

if not moe_gemm.available():
    pytest.skip("no C compiler here: the native kernels are not built", allow_module_level=True)


def _stack(seed, E, H, I):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1


def _w(n, k, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1


# N off the panel width (24 / 48) and below one panel; K past one k block (256 / 128 steps) and odd; M off the row tile
@pytest.mark.parametrize("M,N,K", [(1, 544, 1024), (3, 32, 64), (33, 768, 384), (8, 1024, 512), (17, 5, 7),
                                   (130, 160, 1000)])
def test_matches_torch(M, N, K):
    w = _w(N, K, seed=N)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    y = moe_gemm.linear(x, moe_gemm.pack_linear(w))
    assert y.shape == (M, N)
    torch.testing.assert_close(y, x @ w.t(), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_bits_do_not_depend_on_the_batch(threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w = _w(200, 700, seed=1)
        p = moe_gemm.pack_linear(w)
        x = torch.randn(67, 700, generator=torch.Generator().manual_seed(2))
        full = moe_gemm.linear(x, p)
        for lo, hi in ((0, 1), (5, 6), (3, 10), (0, 33), (64, 67)):
            assert torch.equal(moe_gemm.linear(x[lo:hi], p), full[lo:hi])
    finally:
        torch.set_num_threads(old)


def test_strided_input_and_empty_batch():
    w = _w(48, 96, seed=3)
    p = moe_gemm.pack_linear(w)
    big = torch.randn(9, 200, generator=torch.Generator().manual_seed(4))
    x = big[:, 10:106]  # rows 200 apart
    assert torch.equal(moe_gemm.linear(x, p), moe_gemm.linear(x.contiguous(), p))
    assert moe_gemm.linear(torch.empty(0, 96), p).shape == (0, 48)


def test_bad_inputs_are_named():
    p = moe_gemm.pack_linear(_w(24, 16))
    with pytest.raises(KernelInputError, match=r"linear: x must be float32 CPU \[M, 16\]"):
        moe_gemm.linear(torch.randn(3, 17), p)
    with pytest.raises(KernelInputError, match="linear: x"):
        moe_gemm.linear(torch.randn(3, 16, dtype=torch.float64), p)
    with pytest.raises(KernelInputError, match="pack_linear: w"):
        moe_gemm.pack_linear(torch.randn(4, 4, 4))
    with pytest.raises(KernelInputError, match="pack_linear: w"):
        moe_gemm.pack_linear(torch.empty(0, 4))


def test_thread_schedules_and_prefetch_targets_give_the_same_bits():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        E, H, I, T, k = 8, 256, 96, 40, 2
        packed = moe_gemm.pack_experts(*_stack(9, E, H, I))
        g = torch.Generator().manual_seed(90)
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        x = torch.randn(T, H, generator=g)
        p = moe_gemm.pack_linear(_w(300, 256, seed=8))
        outs = []
        for dynamic, prefetch_next in ((False, False), (True, False), (False, True), (True, True)):
            moe_gemm.set_dynamic_schedule(dynamic)
            moe_gemm.set_prefetch_next(prefetch_next)
            outs.append((moe_gemm.moe_experts(x, idx, packed), moe_gemm.linear(x, p)))
    finally:
        moe_gemm.set_dynamic_schedule(True)
        moe_gemm.set_prefetch_next(True)
        torch.set_num_threads(old)
    assert all(torch.equal(o[0], outs[0][0]) and torch.equal(o[1], outs[0][1]) for o in outs[1:])
    torch.testing.assert_close(outs[0][0], moe_gemm.moe_experts_reference(x, idx, *_stack(9, E, H, I)), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(outs[1][1], x @ _w(300, 256, seed=8).t(), atol=2e-5, rtol=1e-4)


def test_huge_page_packing_keeps_values_and_bits():
    from deepinfer_kernels import huge_pages

    t = torch.randn(3 << 20, generator=torch.Generator().manual_seed(10))  # 12 MiB
    c = huge_pages.copy(t.view(3, -1))
    assert c.data_ptr() % huge_pages.HUGE == 0 and c.is_contiguous() and torch.equal(c.view(-1), t)
    small = huge_pages.copy(t[:100])
    assert torch.equal(small, t[:100])
    g = torch.Generator().manual_seed(11)
    gu, down = torch.randn(4, 2 * 96, 512, generator=g) * 0.1, torch.randn(4, 512, 96, generator=g) * 0.1
    x, idx = torch.randn(9, 512, generator=g), torch.randint(0, 4, (9, 2), generator=g)
    a = moe_gemm.moe_experts(x, idx, moe_gemm.pack_experts(gu, down, huge=True))
    b = moe_gemm.moe_experts(x, idx, moe_gemm.pack_experts(gu, down, huge=False))
    assert torch.equal(a, b)
    w = _w(1000, 1100, seed=12)  # 4.3 MiB packed: past one huge page
    xl = torch.randn(5, 1100, generator=g)
    assert torch.equal(moe_gemm.linear(xl, moe_gemm.pack_linear(w, huge=True)), moe_gemm.linear(xl, moe_gemm.pack_linear(w, huge=False)))
