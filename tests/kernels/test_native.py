"""deepinfer_kernels.native: the C token attention and fused add+RMSNorm against their torch definitions,
their batch invariance (bitwise), and their input checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer_kernels import KernelInputError, native

if not native.available():
    pytest.skip("no C compiler here: the native kernels are not built", allow_module_level=True)


def _cache(S, Hkv, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g)


@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (4, 4, 80), (8, 2, 16), (8, 1, 160), (2, 1, 576), (3, 1, 72)])
def test_token_attention_matches_reference_for_decode_and_prefill_rows(H, Hkv, D):
    """(160, 576: latent attention's one KV head past 128 values, the wide vector path; 72 the plain loop)"""
    S = 400
    kc, vc = _cache(S, Hkv, D)
    g = torch.Generator().manual_seed(1)
    # three sequences with scattered slots: two decoding (1 token), one prefilling 7 tokens after 5 cached
    idx = torch.randperm(S, generator=g)[:3 * 40].view(3, 40)
    row = torch.tensor([0, 1] + [2] * 7)
    lens = torch.tensor([33, 40] + list(range(6, 13)))
    q = torch.randn(9, H, D, generator=g)
    out = native.token_attention(q, kc, vc, idx, row, lens, D**-0.5, 40)
    ref = native.token_attention_reference(q, kc, vc, idx, row, lens, D**-0.5)
    assert torch.allclose(out, ref, atol=2e-6, rtol=1e-5)
    # and the torch SDPA path agrees on the prefilling sequence (a causal chunk after a cached prefix)
    slots = idx[2, :12]
    k, v = kc[slots], vc[slots]
    mask = torch.arange(12)[None, :] <= torch.arange(5, 12)[:, None]
    sdpa = F.scaled_dot_product_attention(
        q[2:].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=D**-0.5, enable_gqa=True
    ).transpose(0, 1)
    assert torch.allclose(out[2:], sdpa, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (4, 1, 160)])
def test_token_attention_is_batch_invariant_and_path_independent(H, Hkv, D):
    S = 600
    kc, vc = _cache(S, Hkv, D, seed=2)
    g = torch.Generator().manual_seed(3)
    idx = torch.randperm(S, generator=g)[:8 * 60].view(8, 60)
    q = torch.randn(60, H, D, generator=g)
    # sequence 5 prefilled whole: token p sees slots idx[5, :p+1]
    prefill = native.token_attention(q, kc, vc, idx, torch.full((60,), 5), torch.arange(1, 61), 0.125, 60)
    for p in (0, 17, 59):
        # the same token as a decode step, alone and at a random place in a batch of other decodes
        alone = native.token_attention(q[p:p + 1], kc, vc, idx[5:6], torch.tensor([0]), torch.tensor([p + 1]), 0.125, 60)
        others = torch.randn(7, H, D, generator=g)
        batch_q = torch.cat([others[:3], q[p:p + 1], others[3:]])
        rows = torch.tensor([0, 1, 2, 5, 3, 4, 6, 7])
        lens = torch.tensor([60, 3, 41, p + 1, 12, 60, 1, 30])
        batched = native.token_attention(batch_q, kc, vc, idx, rows, lens, 0.125, 60)
        assert torch.equal(alone[0], prefill[p])
        assert torch.equal(batched[3], prefill[p])


@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (14, 2, 64), (8, 2, 128), (6, 3, 48), (5, 5, 80), (7, 1, 160),
                                   (3, 1, 576)])
def test_token_attention_heads_of_a_kv_group_get_the_bits_of_one_head_alone(H, Hkv, D):
    # the kernel runs a KV head's query heads together (chunks of up to 4, 2 at D > 64); each head's
    # output must be the bits it gets computed alone (one query head over its own KV head)
    S = 300
    kc, vc = _cache(S, Hkv, D, seed=5)
    g = torch.Generator().manual_seed(6)
    idx = torch.randperm(S, generator=g)[:3 * 70].view(3, 70)
    row, lens = torch.tensor([0, 1, 2, 2]), torch.tensor([1, 16, 17, 70])
    q = torch.randn(4, H, D, generator=g)
    out = native.token_attention(q, kc, vc, idx, row, lens, D**-0.5, 70)
    for h in range(H):
        kh = h // (H // Hkv)
        alone = native.token_attention(q[:, h:h + 1].contiguous(), kc[:, kh:kh + 1].contiguous(),
                                       vc[:, kh:kh + 1].contiguous(), idx, row, lens, D**-0.5, 70)
        assert torch.equal(out[:, h], alone[:, 0]), h
    ref = native.token_attention_reference(q, kc, vc, idx, row, lens, D**-0.5)
    assert torch.allclose(out, ref, atol=2e-6, rtol=1e-5)


def test_token_attention_skips_tokens_with_zero_length_and_reads_strided_queries():
    H, Hkv, D = 4, 2, 32
    kc, vc = _cache(50, Hkv, D, seed=4)
    qkv = torch.randn(3, (H + 2 * Hkv) * D)
    q = qkv[:, : H * D].view(3, H, D)  # rows strided like the engine's fused projection
    idx = torch.arange(50).view(1, 50)
    out = torch.full((3, H, D), 7.0)
    native.token_attention(q, kc, vc, idx, torch.zeros(3, dtype=torch.long), torch.tensor([5, 0, 9]), 0.2, 50, out=out)
    assert torch.equal(out[1], torch.full((H, D), 7.0))
    ref = native.token_attention_reference(q.contiguous(), kc, vc, idx, torch.zeros(3, dtype=torch.long), torch.tensor([5, 1, 9]), 0.2)
    assert torch.allclose(out[[0, 2]], ref[[0, 2]], atol=2e-6)


def test_token_attention_rejects_bad_inputs():
    kc, vc = _cache(10, 2, 16)
    q = torch.randn(2, 4, 16)
    idx, row, lens = torch.zeros(1, 4, dtype=torch.long), torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.long)
    with pytest.raises(KernelInputError, match="float32"):
        native.token_attention(q.double(), kc, vc, idx, row, lens, 1.0, 4)
    with pytest.raises(KernelInputError, match="int64"):
        native.token_attention(q, kc, vc, idx.int(), row, lens, 1.0, 4)
    with pytest.raises(KernelInputError, match="max_len"):
        native.token_attention(q, kc, vc, idx, row, lens, 1.0, 5)
    with pytest.raises(KernelInputError, match="does not fit"):
        native.token_attention(torch.randn(2, 3, 16), kc, vc, idx, row, lens, 1.0, 4)


def test_add_rmsnorm_matches_torch_and_is_row_invariant():
    g = torch.Generator().manual_seed(5)
    x, r, w = torch.randn(40, 576, generator=g), torch.randn(40, 576, generator=g), torch.randn(576, generator=g)
    out, res = native.add_rmsnorm(x, r, w, 1e-5)
    assert torch.equal(res, x + r)
    assert torch.allclose(out, F.rms_norm(x + r, (576,), w, 1e-5), atol=1e-5, rtol=1e-5)
    plain, same = native.add_rmsnorm(x, None, w, 1e-6)
    assert same is x and torch.allclose(plain, F.rms_norm(x, (576,), w, 1e-6), atol=1e-5, rtol=1e-5)
    for k in (1, 2, 15, 16, 17, 39):  # below and above the row count where it goes parallel
        assert torch.equal(native.add_rmsnorm(x[:k], r[:k], w, 1e-5)[0], out[:k])
    with pytest.raises(KernelInputError, match="weight"):
        native.add_rmsnorm(x, r, torch.ones(5), 1e-5)


@pytest.mark.parametrize("n,k", [(96, 64), (100, 70), (49, 33), (1536, 576), (32, 256)])
def test_linear_matches_f_linear_and_rows_do_not_depend_on_the_batch(n, k):
    # N not a multiple of the 48-column panel exercises the padded last panel; N = 32 (one panel, an
    # MoE router's shape) has the threads split that panel's row tiles
    g = torch.Generator().manual_seed(6)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    pw = native.pack_weight(w)
    x = torch.randn(37, k, generator=g)
    full = native.linear(x, pw, b)
    ref = F.linear(x.double(), w.double(), b.double())
    assert full.shape == (37, n) and torch.allclose(full.double(), ref, atol=1e-4 * k**0.5, rtol=1e-5)
    for m in (1, 2, 7, 8, 9, 16, 36):  # every row-tile size, alone and mixed
        assert torch.equal(native.linear(x[:m], pw, b), full[:m]), m
        assert torch.equal(native.linear(x[37 - m :], pw, b), full[37 - m :]), m
    assert torch.equal(native.linear(x, pw) + b, full)  # the bias is added once, after the whole sum
    # rows read with a stride (a view into a wider tensor) give the same bits
    wide = torch.randn(37, k + 5, generator=g)
    wide[:, :k] = x
    assert torch.equal(native.linear(wide[:, :k], pw, b), full)
    assert native.linear(x[:0], pw).shape == (0, n)


def test_gated_linear_matches_silu_times_up_and_is_row_invariant():
    g = torch.Generator().manual_seed(7)
    inter, k = 100, 64
    w = torch.randn(2 * inter, k, generator=g) / k**0.5
    pw = native.pack_gated_weight(w)
    x = torch.randn(20, k, generator=g)
    gate, up = F.linear(x.double(), w.double()).chunk(2, -1)
    out = native.gated_linear(x, pw)
    assert torch.allclose(out.double(), F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    for m in (1, 3, 8, 13):
        assert torch.equal(native.gated_linear(x[:m], pw), out[:m])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(100, 70), (49, 33), (1536, 576)])
def test_16bit_panels_compute_bit_for_bit_what_fp32_panels_compute_on_the_widened_weights(dtype, n, k):
    g = torch.Generator().manual_seed(8)
    w16 = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    if dtype == torch.float16:  # subnormal halves widen to normal singles: exercise them too
        w16[0, :8] = torch.tensor([6e-8, -6e-8, 3e-6, -1e-5, 0.0, -0.0, 6e-5, 65504.0]).to(dtype)
    x, b = torch.randn(13, k, generator=g), torch.randn(n, generator=g)
    pw16, pw32 = native.pack_weight(w16), native.pack_weight(w16.float())
    assert pw16.panels.dtype == dtype  # half the bytes (bf16 pads an odd K by one row: rows k, k + 1 pair up)
    assert pw16.panels.nbytes * 2 == pw32.panels.nbytes * (k + k % 2 if dtype == torch.bfloat16 else k) // k
    for m in (1, 8, 13):
        assert torch.equal(native.linear(x[:m], pw16, b), native.linear(x[:m], pw32, b)), m
    gw16 = w16[: 2 * (n // 2)].contiguous()
    got = native.gated_linear(x, native.pack_gated_weight(gw16))
    assert torch.equal(got, native.gated_linear(x, native.pack_gated_weight(gw16.float())))
    # rows read back from the panels (a tied embedding's lookups) are the weight's rows, widened
    ids = torch.tensor([[0, n - 1], [n // 2, 3]])
    assert torch.equal(native.packed_rows(pw16, ids), w16.float()[ids])
    assert torch.equal(native.packed_rows(pw32, ids), w16.float()[ids])
    with pytest.raises(KernelInputError, match="float32, bfloat16 or float16"):
        native.pack_weight(w16.double())


def test_linear_rejects_bad_inputs():
    pw = native.pack_weight(torch.randn(10, 8))
    with pytest.raises(KernelInputError, match=r"\[M, 8\]"):
        native.linear(torch.randn(3, 9), pw)
    with pytest.raises(KernelInputError, match="float32"):
        native.linear(torch.randn(3, 8).double(), pw)
    with pytest.raises(KernelInputError, match="bias"):
        native.linear(torch.randn(3, 8), pw, torch.randn(11))
    with pytest.raises(KernelInputError, match="gated_linear"):
        native.linear(torch.randn(3, 8), native.pack_gated_weight(torch.randn(10, 8)))
    with pytest.raises(KernelInputError, match="gated"):
        native.pack_gated_weight(torch.randn(9, 8))


def test_rope_store_kv_matches_torch_rotary_and_cache_write():
    from deepinfer.engine.models.layers import RotaryEmbedding

    H, Hkv, D, T, S = 6, 2, 32, 5, 40
    g = torch.Generator().manual_seed(8)
    rot = RotaryEmbedding(D, 128, 10000.0, None)
    pos = torch.tensor([0, 3, 17, 60, 127])
    cos, sin = rot.tables(pos, torch.float32)
    wide = torch.randn(T, (H + 2 * Hkv) * D + 3, generator=g)
    qkv = wide[:, : (H + 2 * Hkv) * D]  # rows strided like a view into a wider buffer
    slots = torch.tensor([7, 0, 39, 12, 5])
    kc, vc = torch.zeros(S, Hkv, D), torch.zeros(S, Hkv, D)
    q = native.rope_store_kv(qkv, H, Hkv, cos, sin, slots, kc, vc)
    qk = rot.apply(qkv[:, : (H + Hkv) * D].reshape(T, H + Hkv, D), (cos, sin))
    assert torch.allclose(q, qk[:, :H], atol=1e-6) and torch.allclose(kc[slots], qk[:, H:], atol=1e-6)
    assert torch.equal(vc[slots], qkv[:, (H + Hkv) * D :].reshape(T, Hkv, D))
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[slots] = False
    assert not kc[untouched].any() and not vc[untouched].any()
    with pytest.raises(KernelInputError, match="outside"):
        native.rope_store_kv(qkv, H, Hkv, cos, sin, torch.tensor([7, 0, 40, 12, 5]), kc, vc)
    with pytest.raises(KernelInputError, match="does not fit"):
        native.rope_store_kv(qkv, H + 1, Hkv, cos, sin, slots, kc, vc)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_rope_store_kv_with_qk_norm_is_the_norm_kernel_then_the_rotation(kv_dtype):
    """Qwen3's per-head q / k RMSNorm in the same call: bit for bit add_rmsnorm on every head, then the
    plain rotation and cache write; and within fp32 rounding of torch's rms_norm + rotary."""
    from deepinfer.engine.models.layers import RotaryEmbedding

    H, Hkv, D, T, S, eps = 4, 2, 128, 6, 40, 1e-6
    g = torch.Generator().manual_seed(10)
    rot = RotaryEmbedding(D, 256, 1e6, None)
    cos, sin = rot.tables(torch.tensor([0, 1, 5, 77, 200, 255]), torch.float32)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g) * 3
    qw, kw = torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5
    slots = torch.tensor([3, 0, 39, 12, 5, 20])
    kc, vc = torch.zeros(S, Hkv, D, dtype=kv_dtype), torch.zeros(S, Hkv, D, dtype=kv_dtype)
    q = native.rope_store_kv(qkv, H, Hkv, cos, sin, slots, kc, vc, q_norm=qw, k_norm=kw, eps=eps)
    normed = qkv.clone()
    heads = normed[:, : (H + Hkv) * D].view(T, H + Hkv, D)
    heads[:, :H] = native.add_rmsnorm(heads[:, :H].reshape(-1, D), None, qw, eps)[0].view(T, H, D)
    heads[:, H:] = native.add_rmsnorm(heads[:, H:].reshape(-1, D), None, kw, eps)[0].view(T, Hkv, D)
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    assert torch.equal(q, native.rope_store_kv(normed, H, Hkv, cos, sin, slots, kc2, vc2))
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    x = qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D)
    ref_q = rot.apply(F.rms_norm(x[:, :H], (D,), qw, eps), (cos, sin))
    ref_k = rot.apply(F.rms_norm(x[:, H:], (D,), kw, eps), (cos, sin))
    tol = 1e-5 if kv_dtype == torch.float32 else 1e-2
    assert torch.allclose(q, ref_q, atol=1e-5) and torch.allclose(kc[slots].float(), ref_k, atol=tol, rtol=tol)
    with pytest.raises(KernelInputError, match="both or neither"):
        native.rope_store_kv(qkv, H, Hkv, cos, sin, slots, kc, vc, q_norm=qw)
    with pytest.raises(KernelInputError, match="weights for head dim"):
        native.rope_store_kv(qkv, H, Hkv, cos, sin, slots, kc, vc, q_norm=qw[:64], k_norm=kw)


@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (8, 2, 128), (6, 3, 48), (4, 2, 40), (5, 5, 80), (4, 1, 160)])
def test_token_attention_over_a_bf16_cache_is_the_fp32_kernel_on_the_widened_cache(H, Hkv, D):
    """bf16 values widen to fp32 exactly, so the bf16 build must give the fp32 build's bits on
    cache.float(), on the vector path and (D 40) the plain loop, decodes and prefill rows alike."""
    S, T, L = 300, 21, 90
    g = torch.Generator().manual_seed(D)
    kc, vc = (x.to(torch.bfloat16) for x in _cache(S, Hkv, D, seed=D))
    q = torch.randn(T, H, D, generator=g)
    idx = torch.randint(0, S, (T, L), generator=g)
    row, lens = torch.arange(T), torch.randint(0, L + 1, (T,), generator=g)
    lens[0], lens[1] = 1, L  # one key; the longest context (lens 0 rows are skipped, both builds)
    out = torch.zeros(T, H, D)
    got = native.token_attention(q, kc, vc, idx, row, lens, D**-0.5, L, out=out.clone())
    want = native.token_attention(q, kc.float(), vc.float(), idx, row, lens, D**-0.5, L, out=out.clone())
    assert torch.equal(got, want)
    ref = native.token_attention_reference(q, kc.float(), vc.float(), idx, row, lens, D**-0.5)
    live = lens > 0
    assert torch.allclose(got[live], ref[live], atol=2e-5)


def test_rope_store_kv_into_bf16_caches_rounds_as_torch():
    """k and v stored in bf16 are torch's rounding (Tensor.to: nearest even, a NaN as 0xFFFF) of what
    the fp32 build stores, ties and NaN included; q is the fp32 build's."""
    from deepinfer.engine.models.layers import RotaryEmbedding

    H, Hkv, D, T, S = 6, 2, 32, 5, 40
    g = torch.Generator().manual_seed(9)
    cos, sin = RotaryEmbedding(D, 128, 10000.0, None).tables(torch.tensor([0, 3, 17, 60, 127]), torch.float32)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g)
    v0 = (H + Hkv) * D
    # v values on rounding ties (bf16's last bit even and odd), and a NaN
    qkv[0, v0 : v0 + 3] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, float("nan")])
    slots = torch.tensor([7, 0, 39, 12, 5])
    k32, v32 = torch.zeros(S, Hkv, D), torch.zeros(S, Hkv, D)
    k16, v16 = torch.zeros(S, Hkv, D, dtype=torch.bfloat16), torch.zeros(S, Hkv, D, dtype=torch.bfloat16)
    q32 = native.rope_store_kv(qkv, H, Hkv, cos, sin, slots, k32, v32)
    q16 = native.rope_store_kv(qkv, H, Hkv, cos, sin, slots, k16, v16)
    assert torch.equal(q16, q32)
    assert torch.equal(k16.view(torch.int16), k32.to(torch.bfloat16).view(torch.int16))
    # a NaN is stored as 0xFFFF, what torch's vectorised conversion (its AVX2 / AVX-512 builds) gives; its
    # scalar one (ATEN_CPU_CAPABILITY=default, as under DEEPINFER_CPU=generic) gives 0x7FC0: compare the
    # NaN's bits with the vectorised rounding's, every other value with torch's at the level in force
    nan = v32.isnan()
    assert torch.equal(v16.view(torch.int16)[~nan], v32.to(torch.bfloat16).view(torch.int16)[~nan])
    assert (v16.view(torch.int16)[nan] == -1).all() and nan.sum() == 1
    assert v16[7, 0, :2].tolist() == [1.0, 1 + 2**-6] and v16[7, 0, 2].isnan()


@pytest.mark.parametrize("interleave", [True, False])
def test_mla_rope_latent_is_torch_rotary_and_the_norm_kernel_bit_for_bit(interleave):
    """Latent attention's rope and cache write: each head's rope part de-interleaved (DeepSeek's pairs)
    and rotated exactly as RotaryEmbedding.apply computes it in torch (products rounded, then summed),
    the latent normed by add_rmsnorm, the entry [normed latent | rotated rope key] at its slot; a bf16
    cache holds torch's rounding of the fp32 entry. A slot outside the cache raises, the others written."""
    from deepinfer.engine.models.layers import RotaryEmbedding
    from deepinfer.engine.models.mla import deinterleave

    H, nope, rope, r, T, S, eps = 3, 16, 32, 48, 5, 40, 1e-6
    g = torch.Generator().manual_seed(11)
    rot = RotaryEmbedding(rope, 128, 10000.0, None)
    cos, sin = rot.tables(torch.tensor([0, 3, 17, 60, 127]), torch.float32)
    q = torch.randn(T, H, nope + rope, generator=g) * 2
    wide = torch.randn(T, r + rope + 5, generator=g) * 3
    ckv = wide[:, : r + rope]  # rows strided like kv_a's slice of a fused projection
    w = torch.rand(r, generator=g) + 0.5
    slots = torch.tensor([7, 0, 39, 12, 5])
    pe = (lambda x: deinterleave(x)) if interleave else (lambda x: x)
    want_q = rot.apply(pe(q[..., nope:]), (cos, sin))
    want_entry = torch.cat([native.add_rmsnorm(ckv[:, :r], None, w, eps)[0],
                            rot.apply(pe(ckv[:, None, r:]), (cos, sin))[:, 0]], -1)
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.zeros(S, 1, r + rope, dtype=dtype)
        q_full = torch.full((T, H, r + rope), 7.0)
        native.mla_rope_latent(q, ckv, cos, sin, w, eps, interleave, slots, cache, q_full, nope)
        assert torch.equal(q_full[..., r:], want_q) and bool((q_full[..., :r] == 7.0).all())
        assert torch.equal(cache[slots, 0].view(torch.int16) if dtype == torch.bfloat16 else cache[slots, 0],
                           want_entry.to(dtype).view(torch.int16) if dtype == torch.bfloat16 else want_entry)
        untouched = torch.ones(S, dtype=torch.bool)
        untouched[slots] = False
        assert not cache[untouched].any()
    ref_latent = F.rms_norm(ckv[:, :r], (r,), w, eps)
    assert torch.allclose(want_entry[:, :r], ref_latent, atol=1e-5)
    cache = torch.zeros(S, 1, r + rope)
    with pytest.raises(KernelInputError, match="outside"):
        native.mla_rope_latent(q, ckv, cos, sin, w, eps, interleave, torch.tensor([7, 0, 40, 12, 5]), cache,
                               torch.empty(T, H, r + rope), nope)
    assert torch.equal(cache[7, 0], want_entry[0]) and torch.equal(cache[5, 0], want_entry[4])
    with pytest.raises(KernelInputError, match="do not fit"):
        native.mla_rope_latent(q, ckv[:, :-2], cos, sin, w, eps, interleave, slots, cache,
                               torch.empty(T, H, r + rope), nope)
    with pytest.raises(KernelInputError, match="q_full"):
        native.mla_rope_latent(q, ckv, cos, sin, w, eps, interleave, slots, cache, torch.empty(T, H, r), nope)


@pytest.mark.parametrize("inter", [1536, 16, 37])
def test_silu_mul_matches_torch_and_is_row_invariant(inter):
    g = torch.Generator().manual_seed(5)
    gu = torch.randn(6, 2 * inter, generator=g) * 8  # silu's tails: exp(-|g|) down to ~e^-40
    gu[0, :4] = torch.tensor([0.0, -0.0, 90.0, -30.0])
    out = native.silu_mul(gu)
    ref = F.silu(gu[:, :inter].double()) * gu[:, inter:].double()
    assert out.shape == (6, inter) and out.dtype == torch.float32
    assert torch.allclose(out.double(), ref, rtol=1e-6, atol=1e-30)
    # a row's bits do not depend on the other rows (nor on where the row's tail falls)
    assert torch.equal(native.silu_mul(gu[3:4]), out[3:4])
    wide = torch.cat([gu[:, :inter], torch.zeros(6, 5), gu[:, inter:], torch.zeros(6, 5)], 1)
    assert torch.equal(native.silu_mul(wide)[:, :inter], out)


def test_silu_mul_reads_strided_rows_and_rejects_bad_inputs():
    gu = torch.randn(4, 64)
    view = torch.cat([gu, torch.randn(4, 8)], 1)[:, :64]  # rows 72 apart
    assert torch.equal(native.silu_mul(view), native.silu_mul(gu))
    with pytest.raises(KernelInputError, match="silu_mul"):
        native.silu_mul(torch.randn(4, 63))
    with pytest.raises(KernelInputError, match="silu_mul"):
        native.silu_mul(torch.randn(4, 64, dtype=torch.float64))
    assert native.silu_mul(torch.empty(0, 64)).shape == (0, 32)


@pytest.mark.parametrize("shape", [(128, 49152), (1, 49152), (7, 37), (3, 16), (5, 1), (2, 33)])
def test_argmax_rows_is_torch_argmax(shape):
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    x = torch.randn(*shape, generator=g)
    assert torch.equal(native.argmax_rows(x), x.argmax(-1))
    # a row's maximum repeated later, and in the vector part and the scalar tail alike
    x[:, -1] = x.max(-1).values
    assert torch.equal(native.argmax_rows(x), x.argmax(-1))


def test_argmax_rows_ties_infinities_nans_and_signed_zeros_as_torch():
    x = torch.zeros(7, 50)
    x[0, 10] = x[0, 40] = 1.0  # tie: the first
    x[1] = float("-inf")  # all -inf: index 0
    x[2, 3], x[2, 5] = float("inf"), float("nan")  # a NaN wins over +inf
    x[3] = -0.0
    x[3, 7] = 0.0  # -0 and +0 compare equal: the first
    x[4, 48] = x[4, 49] = float("nan")  # the first NaN, in the tail
    x[5] = float("-inf")
    x[5, 45] = -1e30
    x[6, 20] = float("nan")  # a NaN in the vector part, after the maximum
    x[6, 2] = 5.0
    assert native.argmax_rows(x).tolist() == x.argmax(-1).tolist() == [10, 0, 5, 0, 48, 45, 20]


def test_argmax_rows_reads_strided_rows_and_rejects_bad_inputs():
    base = torch.randn(6, 80, generator=torch.Generator().manual_seed(3))
    x = base[:, 5:70]  # rows 80 apart
    assert torch.equal(native.argmax_rows(x), x.argmax(-1))
    assert native.argmax_rows(torch.empty(0, 9)).shape == (0,)
    with pytest.raises(KernelInputError):
        native.argmax_rows(base.double())
    with pytest.raises(KernelInputError):
        native.argmax_rows(base.t())  # columns not dense
    with pytest.raises(KernelInputError):
        native.argmax_rows(torch.empty(3, 0))


def test_fma_peak_runs_its_chains_and_rejects_bad_inputs():
    # the wrapper checks the loop's checksum (every chain converges to 2) before it reports a rate
    rate = native.fma_peak(seconds=0.01, repeats=1)
    assert rate > 0 and rate == rate and rate != float("inf")
    for bad in (dict(seconds=0), dict(seconds=-1.0), dict(seconds=float("nan")), dict(repeats=0)):
        with pytest.raises(KernelInputError, match="fma_peak"):
            native.fma_peak(**bad)
