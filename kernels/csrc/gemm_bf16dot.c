/* y = x @ W.T (+ bias), and the gated silu(x @ gate.T) * (x @ up.T), as bf16 dot products accumulated in
 * fp32 (Engine(dtype="bfloat16") on CPU): W in bf16 pair panels (the layout gemm_bf16.c reads: panel p
 * holds columns 48p .. 48p + 47 as [K/2][48][2], rows k and k + 1 of a column side by side, K padded to
 * even with zeros), x rounded to bf16 once per call into pairs (x[2j], x[2j + 1]) per row.
 *
 * Arithmetic, per output: acc = 0, then for j = 0 .. K/2 - 1 in order: acc += x[2j+1] w[2j+1] (rounded to
 * fp32), acc += x[2j] w[2j] (rounded): what one vdpbf16ps lane does (AVX512_BF16; measured on the Zen 5
 * host: 0 mismatches in 3.2M random lanes against that order, 361k against the other order, 237k
 * against one rounding of both products). A product of two bf16 is exact in fp32, so the sums are the
 * only roundings. The order depends on nothing but k, so a row's result never depends on M or on the
 * tile it lands in (batch-invariant for every M, M = 1 included).
 *
 * Rounding x: to nearest, ties to even; NaN stays a (quiet) NaN of the same sign; fp32 subnormals become
 * zero of the same sign (vdpbf16ps treats bf16 subnormal inputs as zero, so flushing them here gives
 * both paths the same inputs; |x| < 2^-126 is far below any activation that matters); values that
 * round past the bf16 maximum become infinities. The packer flushes subnormal weights the same way
 * (native.pack_weight(..., bf16_dot=True)).
 *
 * Two tiles of 8 rows x 48 columns (24 accumulators in zmm registers, as gemm.c): vdpbf16ps where the
 * CPU has AVX512_BF16 (2 products per fp32 lane per instruction, half the instructions and half the
 * weight bytes of gemm.c's fp32 tile), else the same products widened to fp32 and added in the same
 * order with the portable 16-lane vectors (vec16.h). Their bits are equal except where vdpbf16ps
 * flushes a subnormal result to zero (a product or running sum below 2^-126 in magnitude: the fallback
 * keeps the subnormal); tests/kernels/test_gemm_bf16dot.py compares the two on random data.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_level.h"
#include "expert_sort.h"
#include "transpose32.h"
#include "vec16.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* Software prefetch this far ahead in a panel (3 lines a pair step). Grouped experts (32 x [2 x 256 x 1024]
 * + [1024 x 256], top-4, 2 threads, best of 30, two runs each) at 8 / 32 / 128 / 512 tokens: 132 / 216-223 /
 * 545-567 / 692-709 GFLOP/s with 8 KiB, 119-127 / 196-228 / 506-527 / 648-697 with 4 KiB, 72 / 128 / 397 /
 * 610 without; the dense pair over all 512 x 4 rows 768-807 vs 759-764 without. */
#define BFDOT_PF 8192

#define NR 48
#define MR 8

#include "panel_tile.h"

typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16u __attribute__((vector_size(64), aligned(4)));

/* one fp32 to bf16 as described above */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN, made quiet */
    if (!(u & 0x7f800000u)) return (uint16_t)((u >> 16) & 0x8000u);           /* zero or subnormal */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);                /* nearest even (may reach inf) */
}

/* row m of x as Kp pairs (odd K: the last pair's high half is zero) */
static void round_row(const float *x, int64_t K, uint32_t *out) {
    const int64_t Kp = (K + 1) / 2;
    for (int64_t j = 0; j < K / 2; ++j)
        out[j] = (uint32_t)to_bf16(x[2 * j]) | (uint32_t)to_bf16(x[2 * j + 1]) << 16;
    if (K % 2) out[Kp - 1] = to_bf16(x[K - 1]);
}

/* the fallback's products: lane c of the 16 columns at w gets acc += xh * w.hi, then acc += xl * w.lo */
static inline __attribute__((always_inline)) v16 dot_pair(v16 acc, u32x16 w, v16 xh, v16 xl) {
    const u32x16 hi = (u32x16){0} + 0xffff0000u;
    acc += xh * (v16)(w & hi);
    acc += xl * (v16)(w << 16);
    return acc;
}

static inline __attribute__((always_inline)) v16 bf16_lo(uint32_t p) {
    const uint32_t u = p << 16;
    float f;
    memcpy(&f, &u, 4);
    return splat16(f);
}

static inline __attribute__((always_inline)) v16 bf16_hi(uint32_t p) {
    const uint32_t u = p & 0xffff0000u;
    float f;
    memcpy(&f, &u, 4);
    return splat16(f);
}

/* acc[r][c] for c < nv (the others zero): row r of xb (mr rows, Kp pairs a row) . column block c, whose
 * pair row j is the 16 pairs at w + j * rs + c * cs (Kp of them, in order): the dense GEMM's 48-column
 * panels are rs = 48, cs = 16, nv = 3; the grouped experts' 16-column panels rs = 16, cs = a panel's
 * length (see di_moe_experts_bf16dot). Without AVX512_BF16. */
static inline __attribute__((always_inline)) void tile_widen(const int mr, const int nv, const uint32_t *xb,
                                                             int64_t Kp, const uint32_t *w, int64_t rs, int64_t cs,
                                                             v16 acc[MR][3]) {
    for (int r = 0; r < mr; ++r)
        for (int c = 0; c < 3; ++c) acc[r][c] = splat16(0.f);
    for (int64_t j = 0; j < Kp; ++j) {
        u32x16 wv[3];
        for (int c = 0; c < nv; ++c) wv[c] = *(const u32x16u *)(w + j * rs + c * cs);
        for (int r = 0; r < mr; ++r) {
            const uint32_t p = xb[r * Kp + j];
            const v16 xh = bf16_hi(p), xl = bf16_lo(p);
            for (int c = 0; c < nv; ++c) acc[r][c] = dot_pair(acc[r][c], wv[c], xh, xl);
        }
    }
}

#define BF16DOT __attribute__((target("avx512f,avx512bw,avx512bf16")))

/* the same with vdpbf16ps, each block's stream prefetched BFDOT_PF ahead */
static inline __attribute__((always_inline)) BF16DOT void tile_dot(const int mr, const int nv, const uint32_t *xb,
                                                                   int64_t Kp, const uint32_t *w, int64_t rs,
                                                                   int64_t cs, v16 acc[MR][3]) {
    __m512 a[MR][3];
    for (int r = 0; r < mr; ++r)
        for (int c = 0; c < 3; ++c) a[r][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < Kp; ++j) {
        __m512i wv[3];
        for (int c = 0; c < nv; ++c) {
            __builtin_prefetch((const char *)(w + j * rs + c * cs) + BFDOT_PF);
            wv[c] = _mm512_loadu_si512(w + j * rs + c * cs);
        }
        for (int r = 0; r < mr; ++r) {
            const __m512i xp = _mm512_set1_epi32((int)xb[r * Kp + j]);
            for (int c = 0; c < nv; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], (__m512bh)wv[c], (__m512bh)xp);
        }
    }
    for (int r = 0; r < mr; ++r)
        for (int c = 0; c < 3; ++c) acc[r][c] = (v16)a[r][c];
}

/* One row tile: mr rows of xb against nv column blocks at w (gated: those are the gate's, the up's
 * blocks up_off after them, and the tile is silu(gate) * up), ncols columns into y (rows ldy apart),
 * + bias (not with gated). The two bodies differ only in the tile function, so each is this macro
 * expanded with its own target. */
#define TILE_BODY(TILEFN)                                                                    \
    v16 acc[MR][3];                                                                          \
    TILEFN(mr, nv, xb, Kp, w, rs, cs, acc);                                                  \
    if (gated) {                                                                             \
        v16 up[MR][3];                                                                       \
        TILEFN(mr, nv, xb, Kp, w + up_off, rs, cs, up);                                      \
        for (int r = 0; r < mr; ++r)                                                         \
            for (int c = 0; c < nv; ++c) acc[r][c] = silu16(acc[r][c]) * up[r][c];           \
    }                                                                                        \
    store_tile(mr, acc, y, ldy, ncols, bias);

#define TILE_ARGS                                                                                            \
    const int mr, const int nv, const uint32_t *xb, int64_t Kp, const uint32_t *w, int64_t rs, int64_t cs,  \
        int64_t up_off, int gated, float *y, int64_t ldy, int64_t ncols, const float *bias

static inline __attribute__((always_inline)) void tile_w(TILE_ARGS) { TILE_BODY(tile_widen) }

static inline __attribute__((always_inline)) BF16DOT void tile_d(TILE_ARGS) { TILE_BODY(tile_dot) }

/* every row tile of M rows (the last one shorter) against the same blocks: each (rows, blocks) shape
 * its own unrolled copy (always inlined, so a caller's constant strides and block count fold in) */
#define ROWS_BODY(TILE)                                                                                 \
    for (int64_t r0 = 0; r0 < M; r0 += MR) {                                                            \
        const uint32_t *xr = xb + r0 * Kp;                                                              \
        float *yr = y + r0 * ldy;                                                                       \
        const int mr = M - r0 < MR ? (int)(M - r0) : MR;                                                \
        switch (mr * 4 + nv) {                                                                          \
        case 8 * 4 + 3: TILE(8, 3, xr, Kp, w, rs, cs, up_off, gated, yr, ldy, ncols, bias); break;       \
        case 8 * 4 + 2: TILE(8, 2, xr, Kp, w, rs, cs, up_off, gated, yr, ldy, ncols, bias); break;       \
        case 8 * 4 + 1: TILE(8, 1, xr, Kp, w, rs, cs, up_off, gated, yr, ldy, ncols, bias); break;       \
        case 7 * 4 + 3: TILE(7, 3, xr, Kp, w, rs, cs, up_off, gated, yr, ldy, ncols, bias); break;       \
        case 7 * 4 + 2: TILE(7, 2, xr, Kp, w, rs, cs, up_off, gated, yr, ldy, ncols, bias); break;       \
        case 7 * 4 + 1: TILE(7, 1, xr, Kp, w, rs, cs, up_off, gated, yr, ldy, ncols, bias); break;       \
        case 6 * 4 + 3: TILE(6, 3, xr, Kp, w, rs, cs, up_off, gated, yr, ldy, ncols, bias); break;       \
        case 6 * 4 + 2: TILE(6, 2, xr, Kp, w, rs, cs, up_off, gated, yr, ldy, ncols, bias); break;       \
        case 6 * 4 + 1: TILE(6, 1, xr, Kp, w, rs, cs, up_off, gated, yr, ldy, ncols, bias); break;       \
        case 5 * 4 + 3: TILE(5, 3, xr, Kp, w, rs, cs, up_off, gated, yr, ldy, ncols, bias); break;       \
        case 5 * 4 + 2: TILE(5, 2, xr, Kp, w, rs, cs, up_off, gated, yr, ldy, ncols, bias); break;       \
        case 5 * 4 + 1: TILE(5, 1, xr, Kp, w, rs, cs, up_off, gated, yr, ldy, ncols, bias); break;       \
        case 4 * 4 + 3: TILE(4, 3, xr, Kp, w, rs, cs, up_off, gated, yr, ldy, ncols, bias); break;       \
        case 4 * 4 + 2: TILE(4, 2, xr, Kp, w, rs, cs, up_off, gated, yr, ldy, ncols, bias); break;       \
        case 4 * 4 + 1: TILE(4, 1, xr, Kp, w, rs, cs, up_off, gated, yr, ldy, ncols, bias); break;       \
        case 3 * 4 + 3: TILE(3, 3, xr, Kp, w, rs, cs, up_off, gated, yr, ldy, ncols, bias); break;       \
        case 3 * 4 + 2: TILE(3, 2, xr, Kp, w, rs, cs, up_off, gated, yr, ldy, ncols, bias); break;       \
        case 3 * 4 + 1: TILE(3, 1, xr, Kp, w, rs, cs, up_off, gated, yr, ldy, ncols, bias); break;       \
        case 2 * 4 + 3: TILE(2, 3, xr, Kp, w, rs, cs, up_off, gated, yr, ldy, ncols, bias); break;       \
        case 2 * 4 + 2: TILE(2, 2, xr, Kp, w, rs, cs, up_off, gated, yr, ldy, ncols, bias); break;       \
        case 2 * 4 + 1: TILE(2, 1, xr, Kp, w, rs, cs, up_off, gated, yr, ldy, ncols, bias); break;       \
        case 1 * 4 + 3: TILE(1, 3, xr, Kp, w, rs, cs, up_off, gated, yr, ldy, ncols, bias); break;       \
        case 1 * 4 + 2: TILE(1, 2, xr, Kp, w, rs, cs, up_off, gated, yr, ldy, ncols, bias); break;       \
        default: TILE(1, 1, xr, Kp, w, rs, cs, up_off, gated, yr, ldy, ncols, bias); break;              \
        }                                                                                               \
    }

#define ROWS_ARGS                                                                                        \
    const uint32_t *xb, int64_t M, int64_t Kp, const uint32_t *w, int64_t rs, int64_t cs, int64_t up_off, \
        int nv, int gated, float *y, int64_t ldy, int64_t ncols, const float *bias

static inline __attribute__((always_inline)) void rows_w(ROWS_ARGS) { ROWS_BODY(tile_w) }

static inline __attribute__((always_inline)) BF16DOT void rows_d(ROWS_ARGS) { ROWS_BODY(tile_d) }

/* the dense GEMM's panel p (48 columns; gated: gate panel 2p, up panel 2p + 1) for all M rows */
#define PANEL_CALL(ROWS)                                                                                   \
    const int64_t pw = Kp * NR; /* uint32 pairs per panel */                                               \
    ROWS(xb, M, Kp, wp + (gated ? 2 : 1) * p * pw, NR, 16, pw, 3, gated, y + p * NR, ldy, ncols,          \
         !gated && bias ? bias + p * NR : 0);

static void panel_widen(const uint32_t *xb, int64_t M, int64_t Kp, const uint32_t *wp, int64_t p, int gated,
                        float *y, int64_t ldy, int64_t ncols, const float *bias) {
    PANEL_CALL(rows_w)
}

static BF16DOT void panel_dot(const uint32_t *xb, int64_t M, int64_t Kp, const uint32_t *wp, int64_t p, int gated,
                              float *y, int64_t ldy, int64_t ncols, const float *bias) {
    PANEL_CALL(rows_d)
}

/* 1: vdpbf16ps, 0: the widening fallback; di_gemm_bf16dot_set_cap(0) forces the fallback (tests) */
static volatile int use_cap = 1;

int di_gemm_bf16dot_level(void) { return use_cap && di_cpu_level() >= 3; }

void di_gemm_bf16dot_set_cap(int cap) { use_cap = cap > 0; }

/* x: [M, K] fp32, rows ldx apart; wp: bf16 pair panels (2 * P of them when gated, P = ceil(N / 48));
 * y: [M, N] rows ldy apart (gated: N is the gate/up width); bias: [N] or NULL (not with gated).
 * Returns 0, or -1 when the scratch for x's bf16 copy (M * ceil(K / 2) * 4 bytes) cannot be allocated. */
int di_gemm_bf16dot(const float *x, int64_t ldx, int64_t M, const uint16_t *wp16, int64_t K, int64_t N, int gated,
                    const float *bias, float *y, int64_t ldy) {
    const int64_t Kp = (K + 1) / 2, P = (N + NR - 1) / NR;
    const uint32_t *wp = (const uint32_t *)wp16;
    uint32_t *xb = malloc(sizeof(uint32_t) * (size_t)(M * Kp) + 1);
    if (!xb) return -1;
    const int dot = di_gemm_bf16dot_level();
#pragma omp parallel if (M * N * K >= 32768)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) round_row(x + m * ldx, K, xb + m * Kp);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < P; ++p) {
            const int64_t ncols = N - p * NR < NR ? N - p * NR : NR;
            if (dot)
                panel_dot(xb, M, Kp, wp, p, gated, y, ldy, ncols, bias);
            else
                panel_widen(xb, M, Kp, wp, p, gated, y, ldy, ncols, bias);
        }
    }
    free(xb);
    return 0;
}

/* ---- the routed experts of an MoE layer as bf16 dot products (Engine(dtype="bfloat16") on MoE models) ----
 *
 * moe_gemm.c's grouped expert pair with this file's arithmetic: for every (token t, slot j) with expert
 * e = idx[t, j], y[t * k + j] = down_e @ bf16(silu(gate_e @ bf16(x[t])) * (up_e @ bf16(x[t]))), each
 * output one vdpbf16ps chain over the pairs in order, as in the GEMM above (so a pair's result depends
 * only on its token and expert, whatever the batch, and equals the dense GEMM's on the same weights).
 * In one call: a stable counting sort of the pairs by expert, x rounded once per token and copied to
 * its pairs' rows in expert order, items of one expert's column blocks (runs_of below) for gate/up and
 * then for down, and the slot combine.
 *
 * Weights (kernels/moe_gemm.py, pack_experts_bf16_dot): 16-column pair panels, [Kp][16] pairs each
 * (row j: pairs 2j, 2j + 1 of 16 output columns, zero-padded past N and past an odd K); per expert the
 * gate/up as 2 * ceil(I / 16) panels over K = H (gate panel q, then up panel q), the down as
 * ceil(H / 16) panels over K = I; experts one after another. A column block is one sequential stream:
 * with the dense GEMM's 48-column panels a 16-column tile read every third line, and two threads
 * streaming such panels reached 229-275 GFLOP/s against 326-376 sequentially (m = 16 rows, vdpbf16ps,
 * 400 MB of panels, 2 threads, the same prefetch; a standalone C loop on the 2-core host). The last
 * chunk also stops at the last block with columns (I = 256: 16 blocks, where 48-column panels computed
 * 288 columns).
 *
 * Two tiles, chosen per expert group by its row count n:
 * - TALL_MIN <= n <= TALL_MAX (the routed experts at decode): the tall tile, up to TMT rows x one
 *   16-column block (one accumulator a row, the broadcasts memory operands), so every weight is read
 *   once, by one pass. The group's rows are copied transposed first (pair j of row r at xt[j * m + r]:
 *   each broadcast a constant offset from one pointer), and its gated output is rounded and stored
 *   transposed the same way ([Ip][m] a tile), the down GEMM's input. (With 8-row tiles a block came
 *   from memory for the first tile and from cache for the next, and the stream idled meanwhile:
 *   moe_gemm.c's fp32 kernel made the same change, see its header.) Only with AVX512_BF16.
 * - otherwise (a few rows, or a shared expert's / a prefill's many): row tiles of MR rows x up to 3
 *   blocks, the GEMM above's tiles on this layout.
 *
 * Combine (wts given): out[t] = sum over j in order of wts[t, j] * y[t * k + j] (each product rounded,
 * then added), + add[t]: moe_gemm.c's combine_rows, called through di_moe_combine_rows. */
/* moe_gemm.c's slot combine (one implementation for both grouped kernels), y's rows found through pos */
void di_moe_combine_rows(const float *y, int64_t ldy, const int64_t *pos, int64_t t0, int64_t t1, int64_t k,
                         const float *wts, const float *add, int64_t ldadd, float *out, int64_t ldo, int64_t H);

#define EW 16 /* columns of an expert panel */
#define TMT 30
#define TALL_MIN 9
#define TALL_MAX 32

/* the tall tile for groups of TALL_MIN .. TALL_MAX rows (1, the default) or row tiles for every group
 * (0): the same bits either way; di_bf16dot_set_tall switches it for side-by-side runs and tests */
static volatile int di_bf16dot_tall_on = 1;
void di_bf16dot_set_tall(int on) { di_bf16dot_tall_on = on != 0; }

static inline int tall_group(int tall_ok, int64_t n) { return tall_ok && n >= TALL_MIN && n <= TALL_MAX; }

/* n rows of one group against nv of its expert's 16-column blocks (gated: gate blocks at w, each up block
 * ps after its gate block, the next gate block 2 ps on), ncols columns into y */
static void expert_rows_widen(const uint32_t *xb, int64_t n, int64_t Kp, const uint32_t *w, int64_t ps, int nv,
                              int gated, float *y, int64_t ldy, int64_t ncols) {
    rows_w(xb, n, Kp, w, EW, gated ? 2 * ps : ps, ps, nv, gated, y, ldy, ncols, 0);
}

static BF16DOT void expert_rows_dot(const uint32_t *xb, int64_t n, int64_t Kp, const uint32_t *w, int64_t ps, int nv,
                                    int gated, float *y, int64_t ldy, int64_t ncols) {
    rows_d(xb, n, Kp, w, EW, gated ? 2 * ps : ps, ps, nv, gated, y, ldy, ncols, 0);
}

/* the tall tile: acc[r] = row r . the 16 columns of the panel w ([Kp][16]) */
static inline __attribute__((always_inline)) BF16DOT void tall_dot(const int m, const uint32_t *xt, const uint32_t *w,
                                                                   int64_t Kp, __m512 acc[TMT]) {
#pragma GCC unroll 32
    for (int r = 0; r < m; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < Kp; ++j) {
        __builtin_prefetch((const char *)(w + j * EW) + BFDOT_PF, 0, 1);
        const __m512i wv = _mm512_loadu_si512(w + j * EW);
        const uint32_t *xj = xt + j * m;
#pragma GCC unroll 32
        for (int r = 0; r < m; ++r)
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)wv, (__m512bh)_mm512_set1_epi32((int)xj[r]));
    }
}

/* gate/up block (gate panel wg, up panel wu; col0 its first column, ncols of them): h = silu(gate) * up
 * rounded to pairs into ht, the tile's [Ip][m] block */
static inline __attribute__((always_inline)) BF16DOT void tall_gated(const int m, const uint32_t *xt, int64_t Hp,
                                                                     const uint32_t *wg, const uint32_t *wu,
                                                                     int64_t col0, int64_t ncols, uint32_t *ht) {
    __m512 acc[TMT];
    float g[TMT][16];
    tall_dot(m, xt, wg, Hp, acc);
    for (int r = 0; r < m; ++r) _mm512_storeu_ps(g[r], acc[r]);
    tall_dot(m, xt, wu, Hp, acc);
    const int64_t np = (ncols + 1) / 2;
    for (int r = 0; r < m; ++r) {
        float a[16];
        store16(a, silu16(load16(g[r])) * (v16)acc[r]);
        for (int64_t q = 0; q < np; ++q)
            ht[(col0 / 2 + q) * m + r] =
                (uint32_t)to_bf16(a[2 * q]) | (2 * q + 1 < ncols ? (uint32_t)to_bf16(a[2 * q + 1]) << 16 : 0u);
    }
}

/* down block (panel w): out rows, ncols columns each */
static inline __attribute__((always_inline)) BF16DOT void tall_down(const int m, const uint32_t *ht, int64_t Ip,
                                                                    const uint32_t *w, float *const *out,
                                                                    int64_t ncols) {
    __m512 acc[TMT];
    tall_dot(m, ht, w, Ip, acc);
    for (int r = 0; r < m; ++r) {
        float a[16];
        _mm512_storeu_ps(a, acc[r]);
        memcpy(out[r], a, sizeof(float) * (size_t)ncols);
    }
}

#define TALL_CASES(X) X(30) X(29) X(28) X(27) X(26) X(25) X(24) X(23) X(22) X(21) X(20) X(19) X(18) X(17) X(16) \
                      X(15) X(14) X(13) X(12) X(11) X(10)

/* gate/up blocks b0 .. b0 + nv - 1 for every tile of a tall group of n rows at sorted position s0 (its
 * tiles transposed in xs, tile t0 at xs + (s0 + t0) * Hp), into hb the same way; wgu: the expert's stack */
static BF16DOT void tall_gated_chunk(int64_t n, int64_t s0, const uint32_t *xs, int64_t Hp, const uint32_t *wgu,
                                     int64_t b0, int nv, int64_t I, uint32_t *hb, int64_t Ip) {
    for (int64_t b = b0; b < b0 + nv; ++b) {
        const uint32_t *wg = wgu + 2 * b * Hp * EW, *wu = wg + Hp * EW;
        const int64_t col0 = b * EW, ncols = I - col0 < EW ? I - col0 : EW;
        for (int64_t i = 0; i * TMT < n; ++i) {
            int64_t t0;
            const int m = split_even(n, TMT, i, &t0);
            const uint32_t *xt = xs + (s0 + t0) * Hp;
            uint32_t *ht = hb + (s0 + t0) * Ip;
            switch (m) {
#define GATED(mm) case mm: tall_gated(mm, xt, Hp, wg, wu, col0, ncols, ht); break;
            TALL_CASES(GATED)
#undef GATED
            default: tall_gated(TALL_MIN, xt, Hp, wg, wu, col0, ncols, ht); break; /* (m >= TALL_MIN) */
            }
        }
    }
}

/* down blocks b0 .. b0 + nv - 1 (wd: the expert's stack) for every tile of a tall group: ys rows */
static BF16DOT void tall_down_chunk(int64_t n, int64_t s0, const uint32_t *hb, int64_t Ip, const uint32_t *wd,
                                    int64_t b0, int nv, int64_t H, float *ys) {
    for (int64_t b = b0; b < b0 + nv; ++b) {
        const uint32_t *w = wd + b * Ip * EW;
        const int64_t col0 = b * EW, ncols = H - col0 < EW ? H - col0 : EW;
        for (int64_t i = 0; i * TMT < n; ++i) {
            int64_t t0;
            const int m = split_even(n, TMT, i, &t0);
            const uint32_t *ht = hb + (s0 + t0) * Ip;
            float *out[TMT];
            for (int r = 0; r < m; ++r) out[r] = ys + (s0 + t0 + r) * H + col0;
            switch (m) {
#define DOWN(mm) case mm: tall_down(mm, ht, Ip, w, out, ncols); break;
            TALL_CASES(DOWN)
#undef DOWN
            default: tall_down(TALL_MIN, ht, Ip, w, out, ncols); break;
            }
        }
    }
}

/* An item of one GEMM over the groups (C runs of near-equal length of the P blocks an expert): group
 * g's rows against run q of its expert's panels (w, or the extra stack xw past E; `stride`
 * pairs an expert), 3 blocks at a time; in: the rows (Kp pairs a row; a tall group's tiles transposed);
 * gated: into hb (tall) or h (N columns a row); else into out (N columns a row). Rows in sorted order. */
static void group_item(int dot, int tall_ok, int gated, int64_t g, int64_t q, int64_t C, int64_t P,
                       const int64_t *gexp, const int64_t *gstart, int64_t E, const uint32_t *w, const uint32_t *xw,
                       int64_t stride, const uint32_t *in, int64_t Kp, float *out, int64_t N, uint32_t *hb,
                       int64_t Ip) {
    const int64_t e = gexp[g], s0 = gstart[g], n = gstart[g + 1] - s0;
    const uint32_t *we = e < E ? w + e * stride : xw + (e - E) * stride;
    int64_t first;
    const int size = split_parts(P, C, q, &first);
    const int64_t end = first + size;
    const int64_t ps = Kp * EW;
    for (int64_t b0 = first; b0 < end; b0 += 3) {
        const int nv = end - b0 < 3 ? (int)(end - b0) : 3;
        if (tall_group(tall_ok, n)) {
            if (gated)
                tall_gated_chunk(n, s0, in, Kp, we, b0, nv, N, hb, Ip);
            else
                tall_down_chunk(n, s0, in, Kp, we, b0, nv, N, out);
            continue;
        }
        const int64_t ncols = N - b0 * EW < nv * EW ? N - b0 * EW : nv * EW;
        const uint32_t *wc = we + (gated ? 2 : 1) * b0 * ps;
        if (dot)
            expert_rows_dot(in + s0 * Kp, n, Kp, wc, ps, nv, gated, out + s0 * N + b0 * EW, N, ncols);
        else
            expert_rows_widen(in + s0 * Kp, n, Kp, wc, ps, nv, gated, out + s0 * N + b0 * EW, N, ncols);
    }
}

/* How many runs an expert's P blocks (block_bytes each) are split into: about RUN_BYTES_BF of weights a
 * run, so each thread reads long sequential streams (at the start of an item its prefetches have not
 * run ahead yet), but at least 4 items a thread over the G groups (a dense one-expert call is one group).
 * Qwen3-MoE-shaped model, bf16 dot, its 8 MoE layers in turn, 128 tokens (~16 rows an expert), 2
 * threads, three alternating rounds: runs of 96 KiB (about the 3 blocks of the first version) 281-297
 * GFLOP/s, 256 KiB 333-340, 1 MiB (one run an expert here) 334-352; at 32 tokens 114-116, 119-125, 122-143. */
#ifndef RUN_BYTES_BF
#define RUN_BYTES_BF (1 << 20)
#endif
static inline int64_t runs_of(int64_t P, int64_t block_bytes, int64_t G, int nthreads) {
    int64_t c = (P * block_bytes + RUN_BYTES_BF - 1) / RUN_BYTES_BF;
    const int64_t least = (4 * nthreads + G - 1) / G;
    if (c < least) c = least;
    return c < 1 ? 1 : c > P ? P : c;
}

/* x: [T, H] rows ldx apart; idx: [T, k] ids in [0, E + xE): below E the stack gu / down, the others the
 * extra stack xgu / xdown (a shared expert's chunks, same layout); h: scratch [T * k, I]; y: [T * k, H]
 * rows ldy apart (written when wts is NULL); with wts ([T, k]) out [T, H] rows ldo apart gets the
 * combine (+ add, rows ldadd apart, when not NULL) and y is not written.
 * Returns 0, -1 for an expert id out of range (nothing written), -2 when out of memory. */
int di_moe_experts_bf16dot(const float *x, int64_t ldx, int64_t T, int64_t k, const int64_t *idx, int64_t E,
                           const uint16_t *gu16, const uint16_t *down16, int64_t xE, const uint16_t *xgu16,
                           const uint16_t *xdown16, int64_t H, int64_t I, float *h, float *y, int64_t ldy,
                           const float *wts, const float *add, int64_t ldadd, float *out, int64_t ldo) {
    const int64_t R = T * k;
    if (R == 0) return 0;
    const int64_t Eall = E + (xgu16 && xdown16 ? xE : 0);
    for (int64_t i = 0; i < R; ++i)
        if (idx[i] < 0 || idx[i] >= Eall) return -1;
    const int64_t Hp = (H + 1) / 2, Ip = (I + 1) / 2, Pg = (I + EW - 1) / EW, Pd = (H + EW - 1) / EW;
    const int64_t gstride = 2 * Pg * Hp * EW, dstride = Pd * Ip * EW; /* uint32 pairs per expert */
    int64_t *count = calloc((size_t)Eall + 1, sizeof(int64_t));
    int64_t *pair = malloc(sizeof(int64_t) * (size_t)R); /* sorted position -> t * k + j */
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)R);  /* t * k + j -> sorted position */
    int64_t *gstart = malloc(sizeof(int64_t) * (size_t)(Eall + 1));
    int64_t *gexp = malloc(sizeof(int64_t) * (size_t)Eall);
    uint32_t *xb = malloc(sizeof(uint32_t) * (size_t)(T * Hp) + 1);
    uint32_t *xs = malloc(sizeof(uint32_t) * (size_t)(R * Hp) + 1);
    uint32_t *hb = malloc(sizeof(uint32_t) * (size_t)(R * Ip) + 1);
    float *ys = malloc(sizeof(float) * (size_t)(R * H) + 1);
    if (!count || !pair || !pos || !gstart || !gexp || !xb || !xs || !hb || !ys) {
        free(count); free(pair); free(pos); free(gstart); free(gexp); free(xb); free(xs); free(hb); free(ys);
        return -2;
    }
    const int64_t G = sort_by_expert(idx, R, Eall, count, pair, pos, gstart, gexp);
    /* items: the groups past TALL_MAX rows first, largest first (a shared expert's group holds every
     * token, and its ids past the routed ones made it last, one thread finishing it alone), then the
     * others in expert order; the bits do not depend on the order. (All groups largest first ran the two
     * threads on the large, compute-bound groups together and then on the small, memory-bound ones:
     * Qwen3-MoE-shaped model, its 8 MoE layers in turn, bf16 dot, 128 tokens, 2 threads, three alternating
     * rounds: 308-332 GFLOP/s against 319-346 in expert order.) */
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(G ? G : 1));
    if (!order) {
        free(count); free(pair); free(pos); free(gstart); free(gexp); free(xb); free(xs); free(hb); free(ys);
        return -2;
    }
    int64_t n_wide = 0;
    for (int64_t g = 0; g < G; ++g) {
        const int64_t n = gstart[g + 1] - gstart[g];
        if (n <= TALL_MAX) continue;
        int64_t i = n_wide++;
        for (; i > 0 && gstart[order[i - 1] + 1] - gstart[order[i - 1]] < n; --i) order[i] = order[i - 1];
        order[i] = g;
    }
    for (int64_t g = 0, i = n_wide; g < G; ++g)
        if (gstart[g + 1] - gstart[g] <= TALL_MAX) order[i++] = g;
#ifdef _OPENMP
    const int nthreads = omp_get_max_threads();
#else
    const int nthreads = 1;
#endif
    const int64_t Cg = runs_of(Pg, 2 * Hp * EW * 4, G, nthreads), Cd = runs_of(Pd, Ip * EW * 4, G, nthreads);
    const uint32_t *gu = (const uint32_t *)gu16, *dn = (const uint32_t *)down16;
    const uint32_t *xgu = (const uint32_t *)xgu16, *xdn = (const uint32_t *)xdown16;
    const int dot = di_gemm_bf16dot_level();
    const int tall_ok = dot && di_bf16dot_tall_on;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) round_row(x + t * ldx, H, xb + t * Hp);
        /* each pair's x row in sorted order: a tall group's transposed, a tile at a time */
#pragma omp for schedule(static)
        for (int64_t g = 0; g < G; ++g) {
            const int64_t s0 = gstart[g], n = gstart[g + 1] - s0;
            if (!tall_group(tall_ok, n)) {
                for (int64_t s = s0; s < s0 + n; ++s) memcpy(xs + s * Hp, xb + pair[s] / k * Hp, sizeof(uint32_t) * (size_t)Hp);
                continue;
            }
            for (int64_t i = 0; i * TMT < n; ++i) {
                int64_t t0;
                const int m = split_even(n, TMT, i, &t0);
                const void *src[TMT];
                for (int r = 0; r < m; ++r) src[r] = xb + pair[s0 + t0 + r] / k * Hp;
                transpose_rows32(src, m, Hp, xs + (s0 + t0) * Hp);
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < G * Cg; ++it)
            group_item(dot, tall_ok, 1, order[it / Cg], it % Cg, Cg, Pg, gexp, gstart, E, gu, xgu, gstride, xs, Hp, h, I,
                       hb, Ip);
        /* the other groups' h rounded to pairs (a tall group's is in hb already) */
#pragma omp for schedule(static)
        for (int64_t g = 0; g < G; ++g) {
            const int64_t s0 = gstart[g], n = gstart[g + 1] - s0;
            if (!tall_group(tall_ok, n))
                for (int64_t s = s0; s < s0 + n; ++s) round_row(h + s * I, I, hb + s * Ip);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < G * Cd; ++it)
            group_item(dot, tall_ok, 0, order[it / Cd], it % Cd, Cd, Pd, gexp, gstart, E, dn, xdn, dstride, hb, Ip, ys, H,
                       0, 0);
        if (wts) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; ++t) di_moe_combine_rows(ys, H, pos, t, t + 1, k, wts, add, ldadd, out, ldo, H);
        } else {
#pragma omp for schedule(static)
            for (int64_t s = 0; s < R; ++s) memcpy(y + pair[s] * ldy, ys + s * H, sizeof(float) * (size_t)H);
        }
    }
    free(count); free(pair); free(pos); free(gstart); free(gexp); free(xb); free(xs); free(hb); free(ys); free(order);
    return 0;
}
