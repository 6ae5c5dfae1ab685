"""Paged decode attention (one query token per sequence) over a block-paged KV cache.

  q            [B, H, D]                          float32 (bf16/fp16 too on GPU)
  k_cache      [num_blocks, block_size, Hkv, D]   same dtype as q
  v_cache      [num_blocks, block_size, Hkv, D]
  block_tables [B, max_blocks] int32              block ids of each sequence, in order
  context_lens [B] int32                          keys per sequence, 1 <= len <= max_blocks*block_size
  out          [B, H, D] = softmax(scale * q . K^T) V, query head h reading KV head h // (H/Hkv)

The KV length is cut into fixed splits of SPLIT keys. Each split is reduced to (max, sum,
unnormalised acc) with an online softmax over tiles of TILE keys, and the splits are merged
with log-sum-exp in ascending order. Nothing depends on the batch or on max_blocks, only on
the sequence's own keys, so the result is batch-invariant. The GPU kernel runs the splits as
parallel thread blocks plus a merge kernel; the CPU twin (target "c") runs the same splits,
tiles and merge serially, with the arithmetic shared through tl_math.
"""

# No "from __future__ import annotations": TileLang evaluates the kernel signatures at build time.

import torch

from . import _checks, _tilelang
from .errors import KernelInputError

SPLIT = 256
TILE = 32
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TL_DTYPE = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def check_args(q, k_cache, v_cache, block_tables, context_lens, scale) -> None:
    """Validate shapes, dtypes and (for CPU tensors, where it costs no device sync) values."""
    _checks.tensor("q", q, 3, _DTYPES)
    _checks.tensor("k_cache", k_cache, 4, (q.dtype,))
    _checks.tensor("v_cache", v_cache, 4, (q.dtype,))
    _checks.tensor("block_tables", block_tables, 2, (torch.int32,))
    _checks.tensor("context_lens", context_lens, 1, (torch.int32,))
    _checks.same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, context_lens=context_lens)
    b, h, d = q.shape
    nb, bs, hkv, dk = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise KernelInputError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if dk != d:
        raise KernelInputError(f"k_cache head dim {dk} != q head dim {d}")
    if hkv == 0 or h % hkv:
        raise KernelInputError(f"query heads {h} must be a multiple of KV heads {hkv} (GQA)")
    _checks.dim("block_tables", block_tables, 0, b, "batch size of q")
    _checks.dim("context_lens", context_lens, 0, b, "batch size of q")
    if not isinstance(scale, (int, float)):
        raise KernelInputError(f"scale must be a number, got {type(scale).__name__}")
    if context_lens.device.type == "cpu" and b:
        cap = block_tables.shape[1] * bs
        if int(context_lens.min()) < 1 or int(context_lens.max()) > cap:
            raise KernelInputError(
                f"context_lens must be in [1, max_blocks*block_size = {cap}], got "
                f"[{int(context_lens.min())}, {int(context_lens.max())}]"
            )
        used = block_tables.long()
        need = (context_lens.long() + bs - 1) // bs
        cols = torch.arange(block_tables.shape[1])[None, :] < need[:, None]
        ids = used[cols]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= nb):
            raise KernelInputError(f"block_tables hold block ids outside [0, {nb}) within the context")


def paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale: float):
    """Plain masked softmax attention in float32 (gathering each sequence's blocks)."""
    b, h, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    g = h // hkv
    if b == 0:
        return torch.empty_like(q)
    nblk = int((int(context_lens.max()) + bs - 1) // bs)
    ids = block_tables[:, :nblk].long()
    k = k_cache[ids].reshape(b, nblk * bs, hkv, d).float()
    v = v_cache[ids].reshape(b, nblk * bs, hkv, d).float()
    qg = q.float().reshape(b, hkv, g, d)
    scores = torch.einsum("bkgd,bnkd->bkgn", qg, k) * scale
    pos = torch.arange(nblk * bs, device=q.device)
    valid = pos[None, :] < context_lens.long()[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("bkgn,bnkd->bkgd", p, v).reshape(b, h, d).to(q.dtype)


def build_cpu(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, scale: float):
    """CPU twin (target "c", float32): per (sequence, head), splits -> tiles -> merge, serially."""
    import tilelang.cpu.language as T  # noqa: PLC0415 - optional dependency

    from .tl_math import C_PRELUDE, make_math  # noqa: PLC0415

    M = make_math(cuda=False)
    B, NB, MB = T.dynamic("B"), T.dynamic("NB"), T.dynamic("MB")
    H, HKV, D, BS = num_heads, num_kv_heads, head_dim, block_size
    G = H // HKV
    NINF = -T.infinity("float32")

    @T.prim_func
    def paged_decode_attention_cpu(
        q: T.Tensor((B, H, D), "float32"),
        k_cache: T.Tensor((NB, BS, HKV, D), "float32"),
        v_cache: T.Tensor((NB, BS, HKV, D), "float32"),
        block_tables: T.Tensor((B, MB), "int32"),
        context_lens: T.Tensor((B,), "int32"),
        out: T.Tensor((B, H, D), "float32"),
    ):
        with T.Kernel(B, H, prelude=C_PRELUDE) as (b, h):
            sc = T.alloc_local((TILE,), "float32")
            acc = T.alloc_local((D,), "float32")
            o = T.alloc_local((D,), "float32")
            st = T.alloc_local((6,), "float32")  # m, l, M, L, tile max, dot product
            ctx = context_lens[b]
            kvh = h // G
            st[2] = NINF
            st[3] = T.float32(0)
            for d in T.serial(D):
                o[d] = T.float32(0)
            for s in T.serial(T.ceildiv(ctx, SPLIT)):
                st[0] = NINF
                st[1] = T.float32(0)
                for d in T.serial(D):
                    acc[d] = T.float32(0)
                for t in T.serial(T.ceildiv(T.min(SPLIT, ctx - s * SPLIT), TILE)):
                    st[4] = st[0]
                    for i in T.serial(TILE):
                        sc[i] = NINF
                        if s * SPLIT + t * TILE + i < ctx:
                            st[5] = T.float32(0)
                            for d in T.serial(D):
                                st[5] = st[5] + q[b, h, d] * k_cache[
                                    block_tables[b, (s * SPLIT + t * TILE + i) // BS], (s * SPLIT + t * TILE + i) % BS, kvh, d
                                ]
                            sc[i] = M.fmul(st[5], M.c(scale))
                            st[4] = T.max(st[4], sc[i])
                    # Online-softmax rescale of the split's running state to the new max.
                    st[1] = M.fmul(st[1], M.rescale(st[0], st[4]))
                    for d in T.serial(D):
                        acc[d] = M.fmul(acc[d], M.rescale(st[0], st[4]))
                    for i in T.serial(TILE):
                        if s * SPLIT + t * TILE + i < ctx:
                            st[5] = M.rescale(sc[i], st[4])
                            st[1] = st[1] + st[5]
                            for d in T.serial(D):
                                acc[d] = acc[d] + st[5] * v_cache[
                                    block_tables[b, (s * SPLIT + t * TILE + i) // BS], (s * SPLIT + t * TILE + i) % BS, kvh, d
                                ]
                    st[0] = st[4]
                # Log-sum-exp merge of split s into the running total, in ascending split order.
                st[4] = T.max(st[2], st[0])
                st[3] = M.fadd(M.fmul(st[3], M.rescale(st[2], st[4])), M.fmul(st[1], M.rescale(st[0], st[4])))
                for d in T.serial(D):
                    o[d] = M.fadd(M.fmul(o[d], M.rescale(st[2], st[4])), M.fmul(acc[d], M.rescale(st[0], st[4])))
                st[2] = st[4]
            for d in T.serial(D):
                out[b, h, d] = M.fdiv(o[d], st[3])

    return paged_decode_attention_cpu


def build_gpu_split(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, scale: float, dtype: str = "float32"):
    """GPU split kernel: grid (splits, H, B); each block reduces one split of one (seq, head)
    over TILE-key tiles gathered into shared memory through the block table."""
    import tilelang.language as T  # noqa: PLC0415 - optional dependency

    from .tl_math import make_math  # noqa: PLC0415

    M = make_math(cuda=True)
    B, NB, MB, NS = T.dynamic("B"), T.dynamic("NB"), T.dynamic("MB"), T.dynamic("NS")
    H, HKV, D, BS = num_heads, num_kv_heads, head_dim, block_size
    G = H // HKV
    NT = 128
    NINF = -T.infinity("float32")

    @T.prim_func
    def paged_decode_attention_split(
        q: T.Tensor((B, H, D), dtype),
        k_cache: T.Tensor((NB, BS, HKV, D), dtype),
        v_cache: T.Tensor((NB, BS, HKV, D), dtype),
        block_tables: T.Tensor((B, MB), "int32"),
        context_lens: T.Tensor((B,), "int32"),
        part_m: T.Tensor((B, H, NS), "float32"),
        part_l: T.Tensor((B, H, NS), "float32"),
        part_acc: T.Tensor((B, H, NS, D), "float32"),
    ):
        with T.Kernel(NS, H, B, threads=NT) as (s, h, b):
            qf = T.alloc_fragment((D,), "float32")
            k_s = T.alloc_shared((TILE, D), "float32")
            v_s = T.alloc_shared((TILE, D), "float32")
            prod = T.alloc_fragment((TILE, D), "float32")
            sc = T.alloc_fragment((TILE,), "float32")
            tmax = T.alloc_fragment((1,), "float32")
            tsum = T.alloc_fragment((1,), "float32")
            acc = T.alloc_fragment((D,), "float32")
            pv = T.alloc_fragment((TILE, D), "float32")
            pvs = T.alloc_fragment((D,), "float32")
            m = T.alloc_var("float32")
            l = T.alloc_var("float32")
            mnew = T.alloc_var("float32")
            ctx = context_lens[b]
            kvh = h // G
            m = NINF
            l = T.float32(0)
            for d in T.Parallel(D):
                qf[d] = T.Cast("float32", q[b, h, d])
                acc[d] = T.float32(0)
            for t in T.serial(T.ceildiv(T.max(T.min(SPLIT, ctx - s * SPLIT), 0), TILE)):
                for i, d in T.Parallel(TILE, D):
                    pos = s * SPLIT + t * TILE + i
                    blk = block_tables[b, T.min(pos, ctx - 1) // BS]
                    k_s[i, d] = T.if_then_else(pos < ctx, T.Cast("float32", k_cache[blk, pos % BS, kvh, d]), T.float32(0))
                    v_s[i, d] = T.if_then_else(pos < ctx, T.Cast("float32", v_cache[blk, pos % BS, kvh, d]), T.float32(0))
                for i, d in T.Parallel(TILE, D):
                    prod[i, d] = k_s[i, d] * qf[d]
                T.reduce_sum(prod, sc, dim=1)
                for i in T.Parallel(TILE):
                    sc[i] = T.if_then_else(s * SPLIT + t * TILE + i < ctx, M.fmul(sc[i], M.c(scale)), NINF)
                T.reduce_max(sc, tmax, dim=0)
                mnew = T.max(m, tmax[0])
                for i in T.Parallel(TILE):
                    sc[i] = M.rescale(sc[i], mnew)
                T.reduce_sum(sc, tsum, dim=0)
                for i, d in T.Parallel(TILE, D):
                    pv[i, d] = sc[i] * v_s[i, d]
                T.reduce_sum(pv, pvs, dim=0)
                for d in T.Parallel(D):
                    acc[d] = M.fmul(acc[d], M.rescale(m, mnew)) + pvs[d]
                l = M.fmul(l, M.rescale(m, mnew)) + tsum[0]
                m = mnew
            for d in T.Parallel(D):
                part_acc[b, h, s, d] = acc[d]
            part_m[b, h, s] = m
            part_l[b, h, s] = l

    return paged_decode_attention_split


def build_gpu_merge(num_heads: int, head_dim: int, dtype: str = "float32"):
    """GPU merge kernel: grid (H, B); log-sum-exp merge of the splits in ascending order."""
    import tilelang.language as T  # noqa: PLC0415 - optional dependency

    from .tl_math import make_math  # noqa: PLC0415

    M = make_math(cuda=True)
    B, NS = T.dynamic("B"), T.dynamic("NS")
    H, D = num_heads, head_dim
    NT = 64 if D % 64 == 0 else 32
    NINF = -T.infinity("float32")

    @T.prim_func
    def paged_decode_attention_merge(
        context_lens: T.Tensor((B,), "int32"),
        part_m: T.Tensor((B, H, NS), "float32"),
        part_l: T.Tensor((B, H, NS), "float32"),
        part_acc: T.Tensor((B, H, NS, D), "float32"),
        out: T.Tensor((B, H, D), dtype),
    ):
        with T.Kernel(H, B, threads=NT) as (h, b):
            o = T.alloc_fragment((D,), "float32")
            mt = T.alloc_var("float32")
            lt = T.alloc_var("float32")
            mn = T.alloc_var("float32")
            mt = NINF
            lt = T.float32(0)
            for d in T.Parallel(D):
                o[d] = T.float32(0)
            for s in T.serial(T.ceildiv(context_lens[b], SPLIT)):
                mn = T.max(mt, part_m[b, h, s])
                for d in T.Parallel(D):
                    o[d] = M.fadd(M.fmul(o[d], M.rescale(mt, mn)), M.fmul(part_acc[b, h, s, d], M.rescale(part_m[b, h, s], mn)))
                lt = M.fadd(M.fmul(lt, M.rescale(mt, mn)), M.fmul(part_l[b, h, s], M.rescale(part_m[b, h, s], mn)))
                mt = mn
            for d in T.Parallel(D):
                out[b, h, d] = T.Cast(dtype, M.fdiv(o[d], lt))

    return paged_decode_attention_merge


def paged_decode_attention_tilelang(q, k_cache, v_cache, block_tables, context_lens, scale: float):
    """Run the TileLang kernel(s) for the tensors' device; returns out [B, H, D] in q's dtype.

    Compiles once per (device kind, heads, KV heads, head dim, block size, scale, dtype); batch,
    pool size and max_blocks are dynamic.
    """
    b, h, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    scale = float(scale)
    args = (q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), block_tables.contiguous(), context_lens.contiguous())
    if b == 0:
        return torch.empty_like(q)
    if not q.is_cuda:
        if q.dtype != torch.float32:
            raise KernelInputError(f"the CPU TileLang paged attention supports float32 only, got {q.dtype}")
        kern = _tilelang.compile_cached(("paged_attn", "c", h, hkv, d, bs, scale), lambda: build_cpu(h, hkv, d, bs, scale), "c")
        out = torch.empty_like(q)
        kern(*args, out)
        return out
    tdt = _TL_DTYPE[q.dtype]
    split = _tilelang.compile_cached(
        ("paged_attn_split", "cuda", h, hkv, d, bs, scale, tdt), lambda: build_gpu_split(h, hkv, d, bs, scale, tdt), "cuda"
    )
    merge = _tilelang.compile_cached(("paged_attn_merge", "cuda", h, d, tdt), lambda: build_gpu_merge(h, d, tdt), "cuda")
    ns = (block_tables.shape[1] * bs + SPLIT - 1) // SPLIT
    part_m = torch.empty(b, h, ns, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(b, h, ns, d, dtype=torch.float32, device=q.device)
    split(*args, part_m, part_l, part_acc)
    out = torch.empty_like(q)
    merge(args[4], part_m, part_l, part_acc, out)
    return out
