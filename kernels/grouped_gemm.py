"""Grouped GEMM for mixture-of-experts layers: rows sorted by expert, each row times its expert's weight.

  x            [R, K]        rows sorted (grouped) by expert
  w            [E, N', K]    the experts' weights (N' = N, or 2N when gated: [gate; up] stacked)
  tile_start   [NT] int32    first row of each row tile (tiles never straddle two experts)
  tile_end     [NT] int32    one past its last row (tile_end - tile_start <= BLOCK_M; equal: an empty tile)
  tile_expert  [NT] int32    the tile's expert
  y            [R, N]        y[r] = x[r] @ w[e].T, or silu(x[r] @ gate_e.T) * (x[r] @ up_e.T) when gated

`make_tiles(counts, R)` builds the tile table on the counts' device without a host sync: it
always has ceil(R / block_m) + E entries (enough for any split of R rows among E experts), the
unused ones empty, so its shape depends only on R and E (a CUDA graph can capture it).

The builders also make the W8A16 variant (fp8_block: e4m3 weights decoded as they are read, with
per-row, per-column-block scales; fp8_gemm.py runs it).

Implementations: the torch reference (per expert: one GEMM over its rows), a GPU-style TileLang
kernel (grid (N tiles, row tiles); per block a BLOCK_M x BLOCK_N tile accumulated in fp32 over
BLOCK_K slices of shared memory with T.gemm, silu * mul in the epilogue when gated) and its CPU twin
(target "c", float32: one (row tile, column) per outer iteration, serial loops). Each output element
is reduced over k by the same code whatever the other rows of its tile, so a row's result does not
depend on which tokens share its expert (batch-invariant). `moe_experts` chains two of them into an
MoE block's routed experts ([T, k, H], as `moe_gemm.moe_experts` on the native CPU kernel).
"""

# No "from __future__ import annotations": TileLang evaluates the kernel signatures at build time.

import torch
import torch.nn.functional as F

from . import _checks, _tilelang
from .errors import KernelInputError

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TL_DTYPE = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def check_args(x, w, tile_start, tile_end, tile_expert, gated: bool, scale=None, fp8_block: int | None = None) -> None:
    """Validate shapes, dtypes and devices; raises KernelInputError naming the problem. fp8_block: w holds
    e4m3 codes (uint8 or float8_e4m3fn) with fp32 `scale` [E, N', ceil(K / fp8_block)] (fp8_gemm.py)."""
    _checks.tensor("x", x, 2, _DTYPES)
    _checks.tensor("w", w, 3, (x.dtype,) if fp8_block is None else (torch.uint8, torch.float8_e4m3fn))
    for name, t in (("tile_start", tile_start), ("tile_end", tile_end), ("tile_expert", tile_expert)):
        _checks.tensor(name, t, 1, (torch.int32,))
        _checks.dim(name, t, 0, tile_start.shape[0], "number of tiles")
    _checks.same_device(x=x, w=w, tile_start=tile_start, tile_end=tile_end, tile_expert=tile_expert)
    _checks.dim("w", w, 2, x.shape[1], "K of x")
    if fp8_block is not None:
        if not isinstance(fp8_block, int) or fp8_block < 1:
            raise KernelInputError(f"block_k must be a positive int, got {fp8_block!r}")
        _checks.tensor("scale", scale, 3, (torch.float32,))
        _checks.same_device(x=x, scale=scale)
        want = (w.shape[0], w.shape[1], -(-w.shape[2] // fp8_block))
        if tuple(scale.shape) != want:
            raise KernelInputError(f"scale must have shape {want} (E, N', ceil(K / block_k={fp8_block})), "
                                   f"got {tuple(scale.shape)}")
    if gated and w.shape[1] % 2:
        raise KernelInputError(f"a gated grouped GEMM needs w [E, 2N, K], got {tuple(w.shape)}")


def make_tiles(counts: torch.Tensor, total_rows: int, block_m: int = BLOCK_M):
    """(tile_start, tile_end, tile_expert), int32 on counts' device, for total_rows rows grouped by
    expert with counts[e] rows each (in expert order): ceil(total_rows / block_m) + E tiles, enough
    for any split, the unused ones empty. total_rows is given, so nothing waits on the device."""
    if not isinstance(counts, torch.Tensor) or counts.dim() != 1 or counts.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(f"make_tiles: counts must be a 1-D integer tensor, got "
                               f"{getattr(counts, 'dtype', type(counts).__name__)} {tuple(getattr(counts, 'shape', ()))}")
    if not isinstance(block_m, int) or block_m < 1:
        raise KernelInputError(f"make_tiles: block_m must be a positive int, got {block_m!r}")
    if not isinstance(total_rows, int) or total_rows < 0:
        raise KernelInputError(f"make_tiles: total_rows must be a non-negative int, got {total_rows!r}")
    counts = counts.long()
    per = (counts + block_m - 1) // block_m  # tiles of each expert
    nt = -(-total_rows // block_m) + counts.shape[0]
    return _tiles(counts, per, torch.cumsum(per, 0) - per, torch.cumsum(counts, 0) - counts, nt, block_m, counts.device)


def _tiles(counts, per, first_tile, first_row, nt: int, block_m: int, dev):
    t = torch.arange(nt, device=dev)
    expert = torch.searchsorted(first_tile + per, t, right=True).clamp(max=counts.shape[0] - 1)
    j = t - first_tile[expert]
    start = first_row[expert] + j * block_m
    end = torch.minimum(start + block_m, first_row[expert] + counts[expert])
    used = j < per[expert]
    start = torch.where(used, start, 0)
    end = torch.where(used, end, 0)
    return start.int(), end.int(), expert.int()


def grouped_gemm_reference(x, w, tile_start, tile_end, tile_expert, gated: bool = False):
    """The torch definition, tile by tile (any tile table the kernels accept)."""
    n = w.shape[1] // 2 if gated else w.shape[1]
    y = torch.zeros(x.shape[0], n, dtype=x.dtype, device=x.device)
    for s, e, ex in zip(tile_start.tolist(), tile_end.tolist(), tile_expert.tolist()):
        if e > s:
            h = x[s:e].float() @ w[ex].float().T
            y[s:e] = (F.silu(h[:, :n]) * h[:, n:] if gated else h).to(x.dtype)
    return y


def _weight(T, w, scale, lut, ex, r, c, fp8_block):
    """Expert ex's weight at (row r, column c): as stored, or (fp8_block) its e4m3 code's table value
    times the row's scale for c's column block (kernels/fp8_gemm.py's definition). Plain Python, with
    the builder's language module T: the builders call it while they trace, so each kernel reads one
    expression or the other."""
    if fp8_block is None:
        return w[ex, r, c]
    return lut[T.cast(w[ex, r, c], "int32")] * scale[ex, r, c // fp8_block]


def build_cpu(n: int, k: int, gated: bool, block_m: int = BLOCK_M, fp8_block: int | None = None):
    """CPU twin (target "c", float32): per (row tile, output column), each row's dot product over k in
    order, serially. fp8_block: the weights are e4m3 codes (uint8) with fp32 scales [E, N', ceil(K /
    fp8_block)] and a 256-entry table (fp8_gemm.py), decoded as they are read."""
    import tilelang.cpu.language as T  # noqa: PLC0415 - optional dependency

    R, E, NT = T.dynamic("R"), T.dynamic("E"), T.dynamic("NT")
    N, K, BM = n, k, block_m
    WN = 2 * n if gated else n
    KB = -(-k // fp8_block) if fp8_block else 1

    @T.macro
    def rows(x, w, scale, lut, tile_start, tile_end, tile_expert, y, t, j):
        acc = T.alloc_local((2,), "float32")
        for i in T.serial(BM):
            if tile_start[t] + i < tile_end[t]:
                acc[0] = T.float32(0)
                acc[1] = T.float32(0)
                for kk in T.serial(K):
                    acc[0] = acc[0] + x[tile_start[t] + i, kk] * _weight(T, w, scale, lut, tile_expert[t], j, kk, fp8_block)
                    if gated:
                        acc[1] = acc[1] + x[tile_start[t] + i, kk] * _weight(T, w, scale, lut, tile_expert[t], N + j, kk,
                                                                                fp8_block)
                if gated:
                    y[tile_start[t] + i, j] = acc[0] / (T.float32(1) + T.exp(-acc[0])) * acc[1]
                else:
                    y[tile_start[t] + i, j] = acc[0]

    if fp8_block is None:  # (only the variant asked for is defined: the decorator traces it)
        @T.prim_func
        def grouped_gemm_cpu(
            x: T.Tensor((R, K), "float32"),
            w: T.Tensor((E, WN, K), "float32"),
            tile_start: T.Tensor((NT,), "int32"),
            tile_end: T.Tensor((NT,), "int32"),
            tile_expert: T.Tensor((NT,), "int32"),
            y: T.Tensor((R, N), "float32"),
        ):
            with T.Kernel(NT, N) as (t, j):
                rows(x, w, None, None, tile_start, tile_end, tile_expert, y, t, j)

        return grouped_gemm_cpu

    @T.prim_func
    def grouped_gemm_fp8_cpu(
        x: T.Tensor((R, K), "float32"),
        w: T.Tensor((E, WN, K), "uint8"),
        scale: T.Tensor((E, WN, KB), "float32"),
        lut: T.Tensor((256,), "float32"),
        tile_start: T.Tensor((NT,), "int32"),
        tile_end: T.Tensor((NT,), "int32"),
        tile_expert: T.Tensor((NT,), "int32"),
        y: T.Tensor((R, N), "float32"),
    ):
        with T.Kernel(NT, N) as (t, j):
            rows(x, w, scale, lut, tile_start, tile_end, tile_expert, y, t, j)

    return grouped_gemm_fp8_cpu


def build_gpu(n: int, k: int, gated: bool, dtype: str = "bfloat16", block_m: int = BLOCK_M, block_n: int = BLOCK_N,
              block_k: int = BLOCK_K, fp8_block: int | None = None):
    """GPU kernel: grid (column tiles, row tiles), 128 threads; a BLOCK_M x BLOCK_N fp32 accumulator
    (two when gated) over BLOCK_K slices staged in shared memory, T.gemm on the tensor cores;
    rows past the tile's end and columns past N are zero-filled on load and not stored.
    fp8_block: e4m3 weights (as build_cpu's), the table copied to shared memory once per block and
    each weight slice decoded into shared memory in `dtype` (W8A16, fp8_gemm.py)."""
    import tilelang.language as T  # noqa: PLC0415 - optional dependency

    R, E, NT = T.dynamic("R"), T.dynamic("E"), T.dynamic("NT")
    N, K, BM, BN, BK = n, k, block_m, block_n, block_k
    WN = 2 * n if gated else n
    KB = -(-k // fp8_block) if fp8_block else 1

    @T.macro
    def load_a(a_s, x, s, e, ko):
        for i, kk in T.Parallel(BM, BK):
            a_s[i, kk] = T.if_then_else((s + i < e) and (ko * BK + kk < K),
                                        x[T.min(s + i, R - 1), T.min(ko * BK + kk, K - 1)], T.cast(0, dtype))

    @T.macro
    def load_b(b_s, w, scale, lut_s, ex, row0, bn, ko):  # w[ex, row0 + (columns of tile bn), k slice ko]
        for j, kk in T.Parallel(BN, BK):
            b_s[j, kk] = T.if_then_else((bn * BN + j < N) and (ko * BK + kk < K),
                                        T.cast(_weight(T, w, scale, lut_s, ex, row0 + T.min(bn * BN + j, N - 1),
                                                       T.min(ko * BK + kk, K - 1), fp8_block), dtype),
                                        T.cast(0, dtype))

    @T.macro
    def plain_tile(x, w, scale, lut_s, tile_start, tile_end, tile_expert, y, bn, t):
        a_s = T.alloc_shared((BM, BK), dtype)
        b_s = T.alloc_shared((BN, BK), dtype)
        acc = T.alloc_fragment((BM, BN), "float32")
        s = tile_start[t]
        e = tile_end[t]
        ex = tile_expert[t]
        T.clear(acc)
        if s < e:
            for ko in T.Pipelined(T.ceildiv(K, BK), num_stages=2):
                load_a(a_s, x, s, e, ko)
                load_b(b_s, w, scale, lut_s, ex, 0, bn, ko)
                T.gemm(a_s, b_s, acc, transpose_B=True)
            for i, j in T.Parallel(BM, BN):
                if (s + i < e) and (bn * BN + j < N):
                    y[s + i, bn * BN + j] = T.cast(acc[i, j], dtype)

    @T.macro
    def gated_tile(x, w, scale, lut_s, tile_start, tile_end, tile_expert, y, bn, t):
        a_s = T.alloc_shared((BM, BK), dtype)
        g_s = T.alloc_shared((BN, BK), dtype)
        u_s = T.alloc_shared((BN, BK), dtype)
        acc_g = T.alloc_fragment((BM, BN), "float32")
        acc_u = T.alloc_fragment((BM, BN), "float32")
        s = tile_start[t]
        e = tile_end[t]
        ex = tile_expert[t]
        T.clear(acc_g)
        T.clear(acc_u)
        if s < e:
            for ko in T.Pipelined(T.ceildiv(K, BK), num_stages=2):
                load_a(a_s, x, s, e, ko)
                load_b(g_s, w, scale, lut_s, ex, 0, bn, ko)
                load_b(u_s, w, scale, lut_s, ex, N, bn, ko)
                T.gemm(a_s, g_s, acc_g, transpose_B=True)
                T.gemm(a_s, u_s, acc_u, transpose_B=True)
            for i, j in T.Parallel(BM, BN):
                if (s + i < e) and (bn * BN + j < N):
                    y[s + i, bn * BN + j] = T.cast(
                        acc_g[i, j] / (T.float32(1) + T.exp(-acc_g[i, j])) * acc_u[i, j], dtype)

    # (the decorator traces the function as it is defined: only the variant asked for is defined)
    if fp8_block is None:
        @T.prim_func
        def grouped_gemm_gpu(
            x: T.Tensor((R, K), dtype),
            w: T.Tensor((E, WN, K), dtype),
            tile_start: T.Tensor((NT,), "int32"),
            tile_end: T.Tensor((NT,), "int32"),
            tile_expert: T.Tensor((NT,), "int32"),
            y: T.Tensor((R, N), dtype),
        ):
            with T.Kernel(T.ceildiv(N, BN), NT, threads=128) as (bn, t):
                if gated:
                    gated_tile(x, w, None, None, tile_start, tile_end, tile_expert, y, bn, t)
                else:
                    plain_tile(x, w, None, None, tile_start, tile_end, tile_expert, y, bn, t)

        return grouped_gemm_gpu

    @T.prim_func
    def grouped_gemm_fp8_gpu(
        x: T.Tensor((R, K), dtype),
        w: T.Tensor((E, WN, K), "uint8"),
        scale: T.Tensor((E, WN, KB), "float32"),
        lut: T.Tensor((256,), "float32"),
        tile_start: T.Tensor((NT,), "int32"),
        tile_end: T.Tensor((NT,), "int32"),
        tile_expert: T.Tensor((NT,), "int32"),
        y: T.Tensor((R, N), dtype),
    ):
        with T.Kernel(T.ceildiv(N, BN), NT, threads=128) as (bn, t):
            lut_s = T.alloc_shared((256,), "float32")
            for c in T.Parallel(256):
                lut_s[c] = lut[c]
            if gated:
                gated_tile(x, w, scale, lut_s, tile_start, tile_end, tile_expert, y, bn, t)
            else:
                plain_tile(x, w, scale, lut_s, tile_start, tile_end, tile_expert, y, bn, t)

    return grouped_gemm_fp8_gpu


def grouped_gemm_tilelang(x, w, tile_start, tile_end, tile_expert, gated: bool = False):
    """Run the TileLang kernel for the tensors' device; returns y [R, N]. Compiles once per
    (device kind, N, K, gated, dtype); rows, experts and tiles are dynamic."""
    check_args(x, w, tile_start, tile_end, tile_expert, gated)
    n = w.shape[1] // 2 if gated else w.shape[1]
    k = x.shape[1]
    if x.is_cuda:
        tdt = _TL_DTYPE[x.dtype]
        kern = _tilelang.compile_cached(("grouped_gemm", "cuda", n, k, gated, tdt), lambda: build_gpu(n, k, gated, tdt), "cuda")
    else:
        if x.dtype != torch.float32:
            raise KernelInputError(f"the CPU TileLang grouped_gemm supports float32 only, got {x.dtype}")
        kern = _tilelang.compile_cached(("grouped_gemm", "c", n, k, gated), lambda: build_cpu(n, k, gated), "c")
    y = torch.zeros(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] and tile_start.shape[0]:
        kern(x.contiguous(), w.contiguous(), tile_start, tile_end, tile_expert, y)
    return y


def moe_experts(x, idx, gate_up, down, gemm=grouped_gemm_tilelang):
    """[T, k, H]: out[t, j] = down_e(silu(gate_e x[t]) * up_e x[t]) for e = idx[t, j], from stacked
    gate_up [E, 2I, H] and down [E, H, I]: a stable sort of the (token, slot) pairs by expert, the gated
    grouped GEMM, the down grouped GEMM, and the rows put back in (token, slot) order. No host sync."""
    T_, k = idx.shape
    flat = idx.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    # (scatter_add, not bincount: CUDA's bincount reads the max back to the host)
    counts = torch.zeros(gate_up.shape[0], dtype=torch.long, device=idx.device).scatter_add_(0, flat, torch.ones_like(flat))
    tiles = make_tiles(counts, flat.numel())
    xs = x.index_select(0, order // k)
    h = gemm(xs, gate_up, *tiles, gated=True)
    ys = gemm(h, down, *tiles, gated=False)
    out = torch.empty_like(ys)
    out.index_copy_(0, order, ys)
    return out.view(T_, k, -1)


def warmup(gate_up, down) -> None:
    """Compile both GEMMs of `moe_experts` for these weights' device, shapes and dtype."""
    i, h = down.shape[2], down.shape[1]
    if gate_up.is_cuda:
        tdt = _TL_DTYPE[gate_up.dtype]
        _tilelang.compile_cached(("grouped_gemm", "cuda", i, h, True, tdt), lambda: build_gpu(i, h, True, tdt), "cuda")
        _tilelang.compile_cached(("grouped_gemm", "cuda", h, i, False, tdt), lambda: build_gpu(h, i, False, tdt), "cuda")
    else:
        _tilelang.compile_cached(("grouped_gemm", "c", i, h, True), lambda: build_cpu(i, h, True), "c")
        _tilelang.compile_cached(("grouped_gemm", "c", h, i, False), lambda: build_cpu(h, i, False), "c")
