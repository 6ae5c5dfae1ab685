"""deepinfer_kernels.moe_gemm: the native grouped expert GEMM against its torch definition, its batch
invariance (bitwise: a pair's row never depends on which tokens share its expert), and input checks."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import KernelInputError, moe_gemm

if not moe_gemm.available():
    pytest.skip("no C compiler here: the native kernels are not built", allow_module_level=True)


def _experts(E, H, I, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1


def _routing(T, E, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.empty(0, k, dtype=torch.long)


# sizes off the panel width (8 / 16) and the row tiles, an expert with one row, all rows on one expert
@pytest.mark.parametrize("E,H,I,T,k", [(8, 200, 70, 13, 3), (4, 48, 24, 1, 2), (6, 97, 131, 40, 2),
                                       (32, 256, 64, 33, 4), (3, 64, 32, 9, 1)])
def test_matches_reference(E, H, I, T, k):
    gu, down = _experts(E, H, I, seed=E + T)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
    idx = _routing(T, E, k, seed=k)
    out = moe_gemm.moe_experts(x, idx, moe_gemm.pack_experts(gu, down))
    ref = moe_gemm.moe_experts_reference(x, idx, gu, down)
    assert out.shape == (T, k, H)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_silu_range_extremes_match_reference():
    # pre-activations far beyond exp's range: silu must saturate to 0 / identity, never inf or nan
    E, H, I = 2, 32, 24
    gu, down = _experts(E, H, I, seed=3)
    gu[:, :I] *= 400
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(4))
    idx = torch.tensor([[0, 1]] * 5)
    out = moe_gemm.moe_experts(x, idx, moe_gemm.pack_experts(gu, down))
    ref = moe_gemm.moe_experts_reference(x, idx, gu, down)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-4)


def test_a_pairs_row_does_not_depend_on_the_batch():
    E, H, I, k = 8, 160, 88, 2
    gu, down = _experts(E, H, I, seed=5)
    packed = moe_gemm.pack_experts(gu, down)
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(6))
    idx = _routing(37, E, k, seed=7)
    full = moe_gemm.moe_experts(x, idx, packed)
    for t in (0, 5, 36):  # alone, and in a batch where every token shares one of its experts
        alone = moe_gemm.moe_experts(x[t : t + 1], idx[t : t + 1], packed)
        assert torch.equal(alone[0], full[t])
        crowd = idx[t : t + 1].expand(20, k).contiguous()
        xs = torch.cat([x[t : t + 1], torch.randn(19, H)])
        assert torch.equal(moe_gemm.moe_experts(xs, crowd, packed)[0], full[t])


def test_a_strided_input_and_int32_ids_give_the_same_bits():
    E, H, I = 4, 64, 40
    gu, down = _experts(E, H, I, seed=8)
    packed = moe_gemm.pack_experts(gu, down)
    wide = torch.randn(6, H + 16)
    x = wide[:, :H]  # rows H + 16 apart
    idx = _routing(6, E, 2, seed=9)
    a = moe_gemm.moe_experts(x, idx, packed)
    b = moe_gemm.moe_experts(x.contiguous(), idx.int(), packed)
    assert torch.equal(a, b)


def test_empty_batch():
    gu, down = _experts(2, 32, 24)
    out = moe_gemm.moe_experts(torch.empty(0, 32), torch.empty(0, 2, dtype=torch.long), moe_gemm.pack_experts(gu, down))
    assert out.shape == (0, 2, 32)


def test_bad_inputs_are_named():
    gu, down = _experts(4, 32, 24)
    packed = moe_gemm.pack_experts(gu, down)
    x = torch.randn(3, 32)
    with pytest.raises(KernelInputError, match="expert id 4 out of range"):
        moe_gemm.moe_experts(x, torch.tensor([[0, 1], [2, 4], [1, 3]]), packed)
    with pytest.raises(KernelInputError, match="expert id -1"):
        moe_gemm.moe_experts(x, torch.tensor([[0, 1], [2, -1], [1, 3]]), packed)
    with pytest.raises(KernelInputError, match=r"x must be float32 CPU \[T, 32\]"):
        moe_gemm.moe_experts(torch.randn(3, 31), torch.zeros(3, 2, dtype=torch.long), packed)
    with pytest.raises(KernelInputError, match="x must be float32"):
        moe_gemm.moe_experts(x.double(), torch.zeros(3, 2, dtype=torch.long), packed)
    with pytest.raises(KernelInputError, match=r"idx must be an integer CPU tensor \[3, k\]"):
        moe_gemm.moe_experts(x, torch.zeros(2, 2, dtype=torch.long), packed)
    with pytest.raises(KernelInputError, match="idx must be"):
        moe_gemm.moe_experts(x, torch.zeros(3, 2), packed)
    with pytest.raises(KernelInputError, match=r"are not \[E, 2I, H\] and \[E, H, I\]"):
        moe_gemm.pack_experts(gu, down[:, :, :20])
    with pytest.raises(KernelInputError, match="gate_up must be a float32 CPU tensor"):
        moe_gemm.pack_experts(gu[0], down)


# an expert with more rows than the tall tile takes (TALL_MAX = 32) runs on the wide tile, its gate/up
# GEMM in k blocks of 64 (AVX-512; 128 on AVX2) with each row tile's partial sums parked between
# blocks: hidden sizes just under, at and past a block boundary
@pytest.mark.parametrize("H", [32, 64, 65, 147, 300])
def test_k_blocks_keep_a_rows_bits_and_the_reference(H):
    E, I = 3, 40
    gu, down = _experts(E, H, I, seed=11)
    packed = moe_gemm.pack_experts(gu, down)
    x = torch.randn(43, H, generator=torch.Generator().manual_seed(12))
    idx = torch.tensor([[0, 1]] * 41 + [[2, 1], [1, 0]])  # expert 2: one row; 0 and 1: 42 and 43 rows
    out = moe_gemm.moe_experts(x, idx, packed)
    torch.testing.assert_close(out, moe_gemm.moe_experts_reference(x, idx, gu, down), atol=5e-5, rtol=1e-4)
    for t in (0, 41, 42):
        assert torch.equal(moe_gemm.moe_experts(x[t : t + 1], idx[t : t + 1], packed)[0], out[t])


# An expert's rows go to the tall tile (up to 30 rows a tile with AVX-512, 12 on AVX2, in tiles of
# near-equal height) up to 32 rows, to the wide tile (8 x up to 3 panels, chunks split evenly) past
# that: a token's row is the same bits whichever tile and tile height it lands in. Sizes off the panel
# width (I = 40, H = 56: 2.5 and 3.5 panels of 16).
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [2, 12, 13, 24, 25, 30, 31, 32, 33, 49, 100])
def test_tall_and_wide_tiles_give_a_row_the_same_bits(n, weights):
    E, H, I = 2, 56, 40
    gu, down = _experts(E, H, I, seed=n)
    packed = moe_gemm.pack_experts(gu, down, weights=weights)
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(n + 1))
    idx = torch.tensor([[1, 0]] * n)  # every row on both experts: groups of n rows
    out = moe_gemm.moe_experts(x, idx, packed)
    rgu, rdown = (gu.bfloat16().float(), down.bfloat16().float()) if weights == torch.bfloat16 else (gu, down)
    torch.testing.assert_close(out, moe_gemm.moe_experts_reference(x, idx, rgu, rdown), atol=5e-5, rtol=1e-4)
    for t in (0, n // 2, n - 1):
        assert torch.equal(moe_gemm.moe_experts(x[t : t + 1], idx[t : t + 1], packed)[0], out[t])


def test_the_thread_schedule_never_changes_the_bits():
    # dynamic runs of items (the default; here taken from both ends: a 40-row group beside ~11-row
    # ones) and one static block a thread: the same bits
    E, H, I, T, k = 8, 96, 64, 60, 2
    gu, down = _experts(E, H, I, seed=21)
    packed = moe_gemm.pack_experts(gu, down)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(22))
    idx = _routing(T, E, k, seed=23)
    idx[:40, 0] = 3  # one expert with 40+ rows (the wide tile) next to tall ones
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        dynamic = moe_gemm.moe_experts(x, idx, packed)
        moe_gemm.set_dynamic_schedule(False)
        static = moe_gemm.moe_experts(x, idx, packed)
    finally:
        moe_gemm.set_dynamic_schedule(True)
        torch.set_num_threads(threads)
    assert torch.equal(dynamic, static)
    torch.testing.assert_close(dynamic, moe_gemm.moe_experts_reference(x, idx, gu, down), atol=5e-5, rtol=1e-4)


# bf16 weights: the kernel widens each weight to fp32 exactly as it loads it, so its result is the fp32
# kernel's on the weights rounded to bf16, bit for bit (sizes off the tiles; 256 x 64: several k blocks)
@pytest.mark.parametrize("E,H,I,T,k", [(8, 200, 70, 13, 3), (32, 256, 64, 33, 4), (3, 64, 32, 1, 1)])
def test_bf16_weights_are_the_fp32_kernel_on_rounded_weights(E, H, I, T, k):
    gu, down = _experts(E, H, I, seed=E + T)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
    idx = _routing(T, E, k, seed=k)
    packed = moe_gemm.pack_experts(gu, down, weights=torch.bfloat16)
    assert packed.weights == torch.bfloat16
    assert packed.gate_up.nbytes * 2 == moe_gemm.pack_experts(gu, down).gate_up.nbytes
    out = moe_gemm.moe_experts(x, idx, packed)
    gu_r, down_r = gu.bfloat16().float(), down.bfloat16().float()
    assert torch.equal(out, moe_gemm.moe_experts(x, idx, moe_gemm.pack_experts(gu_r, down_r)))
    torch.testing.assert_close(out, moe_gemm.moe_experts_reference(x, idx, gu_r, down_r), atol=2e-5, rtol=1e-4)
    # and near the fp32 weights' result: bf16 keeps 8 significant bits (relative rounding <= 2^-9 per weight)
    ref = moe_gemm.moe_experts_reference(x, idx, gu, down)
    assert float((out - ref).norm() / ref.norm()) < 1e-2
    # batch-invariant like the fp32 kernel
    assert torch.equal(moe_gemm.moe_experts(x[-1:], idx[-1:], packed)[0], out[-1])


def test_weight_dtype_is_checked():
    gu, down = _experts(2, 32, 24)
    with pytest.raises(KernelInputError, match="weights must be"):
        moe_gemm.pack_experts(gu, down, weights=torch.float16)


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_unpack_gives_back_the_packed_stacks(weights):
    gu, down = _experts(5, 70, 29, seed=9)  # off the panel width on both GEMMs
    got_gu, got_down = moe_gemm.unpack_experts(moe_gemm.pack_experts(gu, down, weights=weights))
    assert got_gu.dtype == got_down.dtype == torch.float32
    assert torch.equal(got_gu, gu.to(weights).float()) and torch.equal(got_down, down.to(weights).float())


def _torch_combine(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """MoeBlock's torch combine: products rounded, summed in slot order."""
    weighted = y * w.unsqueeze(-1)
    out = weighted[:, 0]
    for j in range(1, y.shape[1]):
        out = out + weighted[:, j]
    return out


# H off the vector width (a scalar tail), one token, several row tiles, bf16 weights
@pytest.mark.parametrize("E,H,I,T,k,weights", [(8, 200, 70, 13, 3, torch.float32), (6, 97, 40, 1, 2, torch.float32),
                                                (32, 256, 64, 33, 4, torch.float32), (8, 200, 70, 13, 3, torch.bfloat16)])
def test_combined_slots_are_the_torch_combine_bit_for_bit(E, H, I, T, k, weights):
    gu, down = _experts(E, H, I, seed=E + T)
    packed = moe_gemm.pack_experts(gu, down, weights=weights)
    g = torch.Generator().manual_seed(T + 1)
    x = torch.randn(T, H, generator=g)
    idx = _routing(T, E, k, seed=k)
    w = torch.rand(T, k, generator=g) * 2.5
    add = torch.randn(T, H, generator=g)
    y = moe_gemm.moe_experts(x, idx, packed)
    out = moe_gemm.moe_experts(x, idx, packed, weights=w)
    assert out.shape == (T, H)
    assert torch.equal(out, _torch_combine(y, w))
    assert torch.equal(moe_gemm.moe_experts(x, idx, packed, weights=w, add=add), _torch_combine(y, w) + add)
    # batch-invariant: a token alone gets its row's bits
    assert torch.equal(moe_gemm.moe_experts(x[-1:], idx[-1:], packed, weights=w[-1:])[0], out[-1])


def test_extra_experts_run_with_the_stack_as_ids_past_it():
    E, H, I, T, k = 6, 72, 40, 11, 2
    gu, down = _experts(E + 2, H, I, seed=21)
    whole = moe_gemm.pack_experts(gu, down)
    stack, extra = moe_gemm.pack_experts(gu[:E], down[:E]), moe_gemm.pack_experts(gu[E:], down[E:])
    idx = torch.cat([_routing(T, E, k, seed=3), torch.tensor([[E, E + 1]] * T)], 1)  # every token on both extras
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(22))
    assert torch.equal(moe_gemm.moe_experts(x, idx, stack, extra=extra), moe_gemm.moe_experts(x, idx, whole))
    w = torch.rand(T, k + 2)
    assert torch.equal(moe_gemm.moe_experts(x, idx, stack, extra=extra, weights=w), moe_gemm.moe_experts(x, idx, whole, weights=w))
    with pytest.raises(KernelInputError, match=r"expert id 8 out of range \[0, 8\)"):
        moe_gemm.moe_experts(x[:1], torch.tensor([[0, E + 2]]), stack, extra=extra)
    with pytest.raises(KernelInputError, match="extra experts are"):
        moe_gemm.moe_experts(x, idx, stack, extra=moe_gemm.pack_experts(*_experts(2, H, I + 1)))


def test_combine_inputs_are_checked():
    gu, down = _experts(4, 32, 24)
    packed = moe_gemm.pack_experts(gu, down)
    x, idx = torch.randn(3, 32), _routing(3, 4, 2)
    with pytest.raises(KernelInputError, match=r"weights must be float32 CPU \(3, 2\)"):
        moe_gemm.moe_experts(x, idx, packed, weights=torch.ones(3, 3))
    with pytest.raises(KernelInputError, match="add must be float32 CPU .* needs weights"):
        moe_gemm.moe_experts(x, idx, packed, add=torch.ones(3, 32))
    with pytest.raises(KernelInputError, match="add must be"):
        moe_gemm.moe_experts(x, idx, packed, weights=torch.ones(3, 2), add=torch.ones(2, 32))


# ---- bf16 dot products (pack_experts_bf16_dot, csrc/gemm_bf16dot.c's di_moe_experts_bf16dot) ---------------

def _dense_bf16_dot(x, idx, gu, down):
    """[T, k, H] pair by pair through native.gated_linear / linear on bf16-dot panels: the arithmetic the
    grouped call must reproduce bit for bit (x rounded, gated, the intermediate rounded, down)."""
    from deepinfer_kernels import native

    E = gu.shape[0]
    pg = [native.pack_gated_weight(gu[e].contiguous(), bf16_dot=True) for e in range(E)]
    pd = [native.pack_weight(down[e].contiguous(), bf16_dot=True) for e in range(E)]
    out = torch.empty(idx.shape[0], idx.shape[1], down.shape[1])
    for t in range(idx.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            out[t, j] = native.linear(native.gated_linear(x[t : t + 1], pg[e]), pd[e])[0]
    return out


# sizes off the 16-column panel and the 8-row tile, chunks of 1, 2 and 3 blocks, odd H and I (a
# zero-padded last pair), one token, groups of 9 .. 32 rows (the tall tile: (6, 96, ...), (4, 97, 131,
# 60, 2) with odd H and I) and of more (row tiles again: (2, 48, 40, 70, 1))
@pytest.mark.parametrize("E,H,I,T,k", [(8, 200, 70, 13, 3), (4, 97, 131, 1, 2), (6, 96, 48, 40, 2), (3, 64, 33, 30, 1),
                                       (4, 97, 131, 60, 2), (2, 48, 40, 70, 1)])
def test_bf16_dot_experts_are_the_dense_bf16_dot_path_pair_by_pair(E, H, I, T, k):
    gu, down = _experts(E, H, I, seed=E + T)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g)
    idx = _routing(T, E, k, seed=T)
    packed = moe_gemm.pack_experts_bf16_dot(gu, down)
    assert packed.bf16_dot and packed.weights == torch.bfloat16
    y = moe_gemm.moe_experts(x, idx, packed)
    assert torch.equal(y, _dense_bf16_dot(x, idx, gu, down))
    # and within bf16 rounding of the fp32 definition
    ref = moe_gemm.moe_experts_reference(x, idx, gu, down)
    assert (y - ref).abs().max() <= 0.02 * ref.abs().max()
    # a token alone, or the batch reversed, gives each pair the same bits
    assert torch.equal(moe_gemm.moe_experts(x[-1:], idx[-1:], packed)[0], y[-1])
    assert torch.equal(moe_gemm.moe_experts(x.flip(0), idx.flip(0), packed), y.flip(0))
    # the combine: torch's slot-order sum of rounded products, + add
    w = torch.rand(T, k, generator=g) * 2.5
    add = torch.randn(T, H, generator=g)
    assert torch.equal(moe_gemm.moe_experts(x, idx, packed, weights=w), _torch_combine(y, w))
    assert torch.equal(moe_gemm.moe_experts(x, idx, packed, weights=w, add=add), _torch_combine(y, w) + add)


def test_bf16_dot_tall_tile_gives_the_same_bits_as_row_tiles():
    # groups of 9 .. 32 rows run on the tall tile (rows transposed, its gated output rounded and stored
    # transposed for the down GEMM); with it switched off the same groups run on 8-row tiles
    E, H, I, T, k = 4, 130, 75, 64, 2
    gu, down = _experts(E, H, I, seed=31)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(32))
    idx = _routing(T, E, k, seed=33)
    sizes = torch.bincount(idx.flatten(), minlength=E)
    assert ((sizes >= 9) & (sizes <= 32)).any() and (sizes > 32).any()  # both kinds of group
    packed = moe_gemm.pack_experts_bf16_dot(gu, down)
    tall = moe_gemm.moe_experts(x, idx, packed)
    moe_gemm.set_bf16_dot_tall(False)
    try:
        rows = moe_gemm.moe_experts(x, idx, packed)
    finally:
        moe_gemm.set_bf16_dot_tall(True)
    assert torch.equal(tall, rows)
    assert torch.equal(tall, _dense_bf16_dot(x, idx, gu, down))


def test_bf16_dot_experts_widening_fallback_gives_the_same_bits():
    from deepinfer_kernels import native

    E, H, I, T, k = 6, 130, 70, 45, 2  # groups of ~15 rows: the tall tile against the fallback's row tiles
    gu, down = _experts(E, H, I, seed=5)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(6))
    idx = _routing(T, E, k, seed=7)
    packed = moe_gemm.pack_experts_bf16_dot(gu, down)
    dot = moe_gemm.moe_experts(x, idx, packed)
    native.set_bf16_dot_cap(0)
    try:
        widened = moe_gemm.moe_experts(x, idx, packed)
    finally:
        native.set_bf16_dot_cap(None)
    assert torch.equal(dot, widened)


def test_bf16_dot_extra_stack_and_unpack():
    E, H, I, T, k = 6, 72, 40, 11, 2
    gu, down = _experts(E + 2, H, I, seed=21)
    whole = moe_gemm.pack_experts_bf16_dot(gu, down)
    stack, extra = moe_gemm.pack_experts_bf16_dot(gu[:E], down[:E]), moe_gemm.pack_experts_bf16_dot(gu[E:], down[E:])
    idx = torch.cat([_routing(T, E, k, seed=3), torch.tensor([[E, E + 1]] * T)], 1)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(22))
    w = torch.rand(T, k + 2)
    assert torch.equal(moe_gemm.moe_experts(x, idx, stack, extra=extra, weights=w), moe_gemm.moe_experts(x, idx, whole, weights=w))
    with pytest.raises(KernelInputError, match="extra experts are"):  # a widened-bf16 extra stack does not mix in
        moe_gemm.moe_experts(x, idx, stack, extra=moe_gemm.pack_experts(gu[E:], down[E:], weights=torch.bfloat16))
    with pytest.raises(KernelInputError, match=r"expert id 8 out of range \[0, 8\)"):
        moe_gemm.moe_experts(x[:1], torch.tensor([[0, E + 2]]), stack, extra=extra)
    from deepinfer_kernels import native

    g2, d2 = moe_gemm.unpack_experts(whole)
    assert torch.equal(g2, native.to_bf16_dot(gu).float()) and torch.equal(d2, native.to_bf16_dot(down).float())
