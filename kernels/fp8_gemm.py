"""Weight-only block-FP8 GEMM (W8A16): y = x @ dequant(w).T, the weights kept as a checkpoint stores them.

  x       [M, K]       activations (bf16 / fp16 on the GPU kernel, fp32 on its CPU twin)
  w       [N, K]       float8_e4m3fn codes, passed as their uint8 bytes
  scale   [N, KB]      fp32, one scale per output row and column block of `block_k` inputs
                       (KB = ceil(K / block_k)): DeepSeek's 128 x 128 block scales with the rows
                       expanded, so projections fused by row concatenation (q|k|v, gate|up) need no
                       block alignment
  lut     [256]        fp32 value of every e4m3 code (`e4m3_table()`: torch's own decoding)
  y       [M, N]       x's dtype

The weight an output reads is lut[w[n, k]] * scale[n, k // block_k], rounded to x's dtype: the same
value the load-time dequantisation (loader/fp8_blocks.py, then the cast to the engine's dtype) gives,
so only the GEMM's summation order differs from running the dequantised checkpoint.

The grouped form (an MoE block's routed experts: `moe_experts` over `ExpertStack`s) is
grouped_gemm.py's kernel built for these weights (fp8_block), on its tile table.

Implementations: the torch reference (dequantise, then one matmul), a GPU-style TileLang kernel (grid
(N tiles, M tiles); the table in shared memory, each BLOCK_N x BLOCK_K weight slice decoded into shared
memory in x's dtype and multiplied by T.gemm into an fp32 accumulator; where those tiles are fewer than
the GPU's multiprocessors, as at decode, a k split into parts summed in order: `split_for`) and its CPU
twin (target "c", fp32: per (row tile, column) a serial dot product over k). Unsplit, a row's result
never depends on the other rows; the split depends on M, so the engine's batch-invariant mode does not
use these kernels (fp8_linear.py). Decoding through the table (not the hardware's fp8 conversion) keeps
one exact definition on every GPU generation and on the CPU.
"""

# No "from __future__ import annotations": TileLang evaluates the kernel signatures at build time.

import torch
import torch.nn.functional as F

from . import _checks, _tilelang
from . import grouped_gemm as G
from .errors import KernelInputError

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
CPU_BLOCK_M = 16
_GPU_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
_LUTS: dict[str, torch.Tensor] = {}


def e4m3_table(device="cpu") -> torch.Tensor:
    """[256] fp32: the value of each float8_e4m3fn code (NaN for the two NaN codes)."""
    key = str(torch.device(device))
    t = _LUTS.get(key)
    if t is None:
        t = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().to(device)
        _LUTS[key] = t
    return t


def check_args(x, w, scale, block_k: int) -> None:
    """Validate shapes, dtypes and devices; raises KernelInputError naming the problem."""
    _checks.tensor("x", x, 2, (torch.float32, torch.float16, torch.bfloat16))
    _checks.tensor("w", w, 2, (torch.uint8, torch.float8_e4m3fn))
    _checks.tensor("scale", scale, 2, (torch.float32,))
    _checks.same_device(x=x, w=w, scale=scale)
    _checks.dim("w", w, 1, x.shape[1], "K of x")
    if not isinstance(block_k, int) or block_k < 1:
        raise KernelInputError(f"block_k must be a positive int, got {block_k!r}")
    _checks.dim("scale", scale, 0, w.shape[0], "N of w")
    _checks.dim("scale", scale, 1, -(-w.shape[1] // block_k), f"ceil(K / block_k={block_k})")


def dequantize(w: torch.Tensor, scale: torch.Tensor, block_k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, K] in `dtype`: every code's value times its row's scale for its column block (in fp32, then
    rounded once to dtype). Where K is whole blocks the scales broadcast over a [N, K / block_k, block_k]
    view of the fp32 codes, multiplied in place: no [N, K] scale tensor (engine/fp8_linear.py runs this
    per call where no kernel serves it)."""
    codes = w.view(torch.float8_e4m3fn) if w.dtype == torch.uint8 else w
    n, k = codes.shape
    out = codes.float()
    if k % block_k == 0:
        out.view(n, k // block_k, block_k).mul_(scale.unsqueeze(2))
    else:
        out.mul_(scale.repeat_interleave(block_k, 1)[:, :k])
    return out.to(dtype)


def fp8_gemm_reference(x, w, scale, block_k: int = 128):
    """The torch definition: dequantise to x's dtype, then F.linear (fp32 accumulation on the GPU)."""
    check_args(x, w, scale, block_k)
    return F.linear(x, dequantize(w, scale, block_k, x.dtype))


def build_cpu(n: int, k: int, block_k: int, block_m: int = CPU_BLOCK_M):
    """CPU twin (target "c", float32): per (row tile, output column), each row's dot product over k in
    order, serially, reading every weight through the table and its scale."""
    import tilelang.cpu.language as T  # noqa: PLC0415 - optional dependency

    M = T.dynamic("M")
    N, K, BM, BK = n, k, block_m, block_k
    KB = -(-k // block_k)

    @T.prim_func
    def fp8_gemm_cpu(
        x: T.Tensor((M, K), "float32"),
        w: T.Tensor((N, K), "uint8"),
        scale: T.Tensor((N, KB), "float32"),
        lut: T.Tensor((256,), "float32"),
        y: T.Tensor((M, N), "float32"),
    ):
        with T.Kernel(T.ceildiv(M, BM), N) as (t, j):
            acc = T.alloc_local((1,), "float32")
            for i in T.serial(BM):
                if t * BM + i < M:
                    acc[0] = T.float32(0)
                    for kk in T.serial(K):
                        acc[0] = acc[0] + x[t * BM + i, kk] * (lut[T.cast(w[j, kk], "int32")] * scale[j, kk // BK])
                    y[t * BM + i, j] = acc[0]

    return fp8_gemm_cpu


def build_gpu(n: int, k: int, block_k: int, dtype: str = "bfloat16", block_m: int = BLOCK_M, block_n: int = BLOCK_N,
              tile_k: int = BLOCK_K, split: int = 1):
    """GPU kernel: grid (column tiles, row tiles), 128 threads; the code table copied to shared memory
    once per block; per k slice the activations staged as they are and the weights decoded (table value
    times scale, rounded to dtype) into shared memory, T.gemm into an fp32 accumulator; rows past M and
    columns past N zero-filled on load and not stored.

    split > 1 (few tiles, as at decode: N / BLOCK_N blocks cannot fill the GPU): a third grid dimension
    of `split` parts of the k slices, each block's fp32 sums written to part [split, M, N], which
    `fp8_gemm_tilelang` adds up in part order."""
    import tilelang.language as T  # noqa: PLC0415 - optional dependency

    M = T.dynamic("M")
    N, K, BM, BN, TK, SB = n, k, block_m, block_n, tile_k, block_k
    KB = -(-k // block_k)
    PER = -(-(-(-k // tile_k)) // split)  # k slices a part

    @T.macro
    def tile(x, w, scale, lut, bn, bm, z, acc):  # acc = x tile (rows bm) . w tile (columns bn), slices of part z
        lut_s = T.alloc_shared((256,), "float32")
        a_s = T.alloc_shared((BM, TK), dtype)
        b_s = T.alloc_shared((BN, TK), dtype)
        for c in T.Parallel(256):
            lut_s[c] = lut[c]
        T.clear(acc)
        for ko in T.Pipelined(PER, num_stages=2):
            for i, kk in T.Parallel(BM, TK):
                a_s[i, kk] = T.if_then_else((bm * BM + i < M) and ((z * PER + ko) * TK + kk < K),
                                            x[T.min(bm * BM + i, M - 1), T.min((z * PER + ko) * TK + kk, K - 1)],
                                            T.cast(0, dtype))
            for j, kk in T.Parallel(BN, TK):
                a_n = T.min(bn * BN + j, N - 1)
                a_k = T.min((z * PER + ko) * TK + kk, K - 1)
                b_s[j, kk] = T.if_then_else((bn * BN + j < N) and ((z * PER + ko) * TK + kk < K),
                                            T.cast(lut_s[T.cast(w[a_n, a_k], "int32")] * scale[a_n, a_k // SB], dtype),
                                            T.cast(0, dtype))
            T.gemm(a_s, b_s, acc, transpose_B=True)

    # (the decorator traces the function as it is defined: only the variant asked for is defined)
    if split == 1:
        @T.prim_func
        def fp8_gemm_gpu(
            x: T.Tensor((M, K), dtype),
            w: T.Tensor((N, K), "uint8"),
            scale: T.Tensor((N, KB), "float32"),
            lut: T.Tensor((256,), "float32"),
            y: T.Tensor((M, N), dtype),
        ):
            with T.Kernel(T.ceildiv(N, BN), T.ceildiv(M, BM), threads=128) as (bn, bm):
                acc = T.alloc_fragment((BM, BN), "float32")
                tile(x, w, scale, lut, bn, bm, 0, acc)
                for i, j in T.Parallel(BM, BN):
                    if (bm * BM + i < M) and (bn * BN + j < N):
                        y[bm * BM + i, bn * BN + j] = T.cast(acc[i, j], dtype)

        return fp8_gemm_gpu

    @T.prim_func
    def fp8_gemm_split_gpu(
        x: T.Tensor((M, K), dtype),
        w: T.Tensor((N, K), "uint8"),
        scale: T.Tensor((N, KB), "float32"),
        lut: T.Tensor((256,), "float32"),
        part: T.Tensor((split, M, N), "float32"),
    ):
        with T.Kernel(T.ceildiv(N, BN), T.ceildiv(M, BM), split, threads=128) as (bn, bm, z):
            acc = T.alloc_fragment((BM, BN), "float32")
            tile(x, w, scale, lut, bn, bm, z, acc)
            for i, j in T.Parallel(BM, BN):
                if (bm * BM + i < M) and (bn * BN + j < N):
                    part[z, bm * BM + i, bn * BN + j] = acc[i, j]

    return fp8_gemm_split_gpu


_SMS: dict[int, int] = {}


def split_for(m: int, n: int, k: int, device: torch.device) -> int:
    """The k split of the CUDA kernel for an [m, k] x [n, k].T product: 1 where its (column, row) tiles
    are as many as the GPU's multiprocessors; else `decode_split(n, k)`, the same for every such m, so a
    shape has two variants at most (fp8_linear.check_kernel compiles both at install). Timed on an H200
    (benchmarks/kernels.py's fp8 rows): 4096 x 7168 split 4 at 1-16 rows 0.087 ms against 0.18 unsplit,
    at 128 rows 0.14 against 0.19; 7168 x 2048 split 2 within noise of unsplit (0.066-0.089 against
    0.072-0.083 ms over two runs)."""
    if -(-n // BLOCK_N) * -(-m // BLOCK_M) >= _sm_count(device):
        return 1
    return decode_split(n, k, device)


def decode_split(n: int, k: int, device: torch.device) -> int:
    """The split of a one-row-tile product: a power of two up to 16 (and the k slices) that gives the
    column tiles about one block a multiprocessor, or more."""
    tiles, slices, sms = -(-n // BLOCK_N), -(-k // BLOCK_K), _sm_count(device)
    s = 1
    while tiles * s < sms and s * 2 <= min(16, slices):
        s *= 2
    return s


def _sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    sms = _SMS.get(idx)
    if sms is None:
        sms = _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return sms


def fp8_gemm_tilelang(x, w, scale, block_k: int = 128, split: int | None = None):
    """Run the TileLang kernel for the tensors' device (bf16 / fp16 on CUDA, fp32 on the CPU twin);
    returns y [M, N]. Compiles once per (device kind, N, K, block_k, dtype, split); M is dynamic.
    split: the CUDA kernel's k split (None: split_for's choice; the parts are summed in order)."""
    check_args(x, w, scale, block_k)
    n, k = w.shape
    codes = w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w
    m = x.shape[0]
    if not m:
        return torch.empty(0, n, dtype=x.dtype, device=x.device)
    if x.is_cuda:
        tdt = _GPU_DTYPES.get(x.dtype)
        if tdt is None:  # T.gemm on fp32 operands runs TF32 on the tensor cores: not an fp32 result
            raise KernelInputError(f"the CUDA fp8_gemm takes bfloat16 or float16 activations, got {x.dtype}")
        s = split_for(m, n, k, x.device) if split is None else split
        kern = _tilelang.compile_cached(("fp8_gemm", "cuda", n, k, block_k, tdt, s),
                                        lambda: build_gpu(n, k, block_k, tdt, split=s), "cuda")
        if s > 1:
            part = torch.empty(s, m, n, dtype=torch.float32, device=x.device)
            kern(x.contiguous(), codes.contiguous(), scale.contiguous(), e4m3_table(x.device), part)
            return part.sum(0).to(x.dtype)
    else:
        if x.dtype != torch.float32:
            raise KernelInputError(f"the CPU TileLang fp8_gemm supports float32 only, got {x.dtype}")
        kern = _tilelang.compile_cached(("fp8_gemm", "c", n, k, block_k), lambda: build_cpu(n, k, block_k), "c")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    kern(x.contiguous(), codes.contiguous(), scale.contiguous(), e4m3_table(x.device), y)
    return y


# ---- grouped: the routed experts of an MoE block, each expert's weights block-FP8 ----------------------
# x [R, K] rows sorted by expert, w [E, N', K] codes (N' = N, or 2N gated: [gate; up]), scale [E, N', KB],
# and grouped_gemm's tile table (make_tiles): y[r] = x[r] @ dequant(w[e]).T, or silu(gate) * up when gated.


def grouped_reference(x, w, scale, block_k, tile_start, tile_end, tile_expert, gated: bool = False):
    """The torch definition, tile by tile: each expert's weights dequantised to x's dtype, then the GEMM."""
    G.check_args(x, w, tile_start, tile_end, tile_expert, gated, scale, block_k)
    deq = torch.stack([dequantize(w[e], scale[e], block_k, x.dtype) for e in range(w.shape[0])]) if w.shape[0] else \
        torch.empty(0, *w.shape[1:], dtype=x.dtype, device=x.device)
    return G.grouped_gemm_reference(x, deq, tile_start, tile_end, tile_expert, gated)


def grouped_tilelang(x, w, scale, block_k, tile_start, tile_end, tile_expert, gated: bool = False):
    """Run the grouped TileLang kernel (grouped_gemm.py's, built for e4m3 weights) for the tensors' device
    (bf16 / fp16 on CUDA, fp32 on the CPU twin); returns y [R, N]. Compiles once per (device kind, N, K,
    gated, block_k, dtype)."""
    G.check_args(x, w, tile_start, tile_end, tile_expert, gated, scale, block_k)
    n = w.shape[1] // 2 if gated else w.shape[1]
    kern = _grouped_kernel(n, x.shape[1], gated, block_k, x.dtype, x.device)
    y = torch.zeros(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] and tile_start.shape[0]:
        codes = w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w
        kern(x.contiguous(), codes.contiguous(), scale.contiguous(), e4m3_table(x.device), tile_start, tile_end,
             tile_expert, y)
    return y


def _grouped_kernel(n: int, k: int, gated: bool, block_k: int, dtype: torch.dtype, device: torch.device):
    if device.type == "cuda":
        tdt = _GPU_DTYPES.get(dtype)
        if tdt is None:  # T.gemm on fp32 operands runs TF32 on the tensor cores: not an fp32 result
            raise KernelInputError(f"the CUDA grouped fp8 GEMM takes bfloat16 or float16 activations, got {dtype}")
        return _tilelang.compile_cached(("grouped_fp8", "cuda", n, k, gated, block_k, tdt),
                                        lambda: G.build_gpu(n, k, gated, tdt, fp8_block=block_k), "cuda")
    if dtype != torch.float32:
        raise KernelInputError(f"the CPU TileLang grouped fp8 GEMM supports float32 only, got {dtype}")
    return _tilelang.compile_cached(("grouped_fp8", "c", n, k, gated, block_k),
                                    lambda: G.build_cpu(n, k, gated, fp8_block=block_k), "c")


class ExpertStack:
    """An MoE block's experts as block-FP8 stacks: codes [E, N', K], scale [E, N', KB]; `shape` is the
    codes' (what grouped_gemm.moe_experts reads)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, block_k: int):
        self.codes, self.scale, self.block_k = codes, scale, block_k

    @property
    def shape(self):
        return self.codes.shape


def grouped_gemm(x, w: ExpertStack, tile_start, tile_end, tile_expert, gated: bool = False):
    """grouped_gemm.moe_experts' `gemm` over FP8 expert stacks (grouped_tilelang)."""
    return grouped_tilelang(x, w.codes, w.scale, w.block_k, tile_start, tile_end, tile_expert, gated)


def moe_experts(x, idx, gate_up: ExpertStack, down: ExpertStack):
    """[T, k, H]: grouped_gemm.moe_experts with every expert's weights block-FP8."""
    return G.moe_experts(x, idx, gate_up, down, gemm=grouped_gemm)
