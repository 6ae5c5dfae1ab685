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

#include "expert_sort.h"
#include "vec16.h"

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

/* acc[r][0..2] = xb[r, :] . panel w (Kp pairs, in order), without AVX512_BF16 */
static inline __attribute__((always_inline)) void tile_widen(const int mr, const uint32_t *xb, int64_t Kp,
                                                             const uint32_t *w, v16 acc[MR][3]) {
    for (int r = 0; r < mr; ++r)
        for (int c = 0; c < 3; ++c) acc[r][c] = splat16(0.f);
    for (int64_t j = 0; j < Kp; ++j) {
        const uint32_t *wj = w + j * NR;
        const u32x16 w0 = *(const u32x16u *)wj, w1 = *(const u32x16u *)(wj + 16), w2 = *(const u32x16u *)(wj + 32);
        for (int r = 0; r < mr; ++r) {
            const uint32_t p = xb[r * Kp + j];
            const v16 xh = bf16_hi(p), xl = bf16_lo(p);
            acc[r][0] = dot_pair(acc[r][0], w0, xh, xl);
            acc[r][1] = dot_pair(acc[r][1], w1, xh, xl);
            acc[r][2] = dot_pair(acc[r][2], w2, xh, xl);
        }
    }
}

#define BF16DOT __attribute__((target("avx512f,avx512bw,avx512bf16")))

/* the same with vdpbf16ps */
static inline __attribute__((always_inline)) BF16DOT void tile_dot(const int mr, const uint32_t *xb, int64_t Kp,
                                                                   const uint32_t *w, v16 acc[MR][3]) {
    __m512 a[MR][3];
    for (int r = 0; r < mr; ++r)
        for (int c = 0; c < 3; ++c) a[r][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < Kp; ++j) {
        const uint32_t *wj = w + j * NR;
        __builtin_prefetch((const char *)wj + BFDOT_PF);
        __builtin_prefetch((const char *)wj + BFDOT_PF + 64);
        __builtin_prefetch((const char *)wj + BFDOT_PF + 128);
        const __m512i w0 = _mm512_loadu_si512(wj), w1 = _mm512_loadu_si512(wj + 16), w2 = _mm512_loadu_si512(wj + 32);
        for (int r = 0; r < mr; ++r) {
            const __m512i xp = _mm512_set1_epi32((int)xb[r * Kp + j]);
            a[r][0] = _mm512_dpbf16_ps(a[r][0], (__m512bh)w0, (__m512bh)xp);
            a[r][1] = _mm512_dpbf16_ps(a[r][1], (__m512bh)w1, (__m512bh)xp);
            a[r][2] = _mm512_dpbf16_ps(a[r][2], (__m512bh)w2, (__m512bh)xp);
        }
    }
    for (int r = 0; r < mr; ++r)
        for (int c = 0; c < 3; ++c) acc[r][c] = (v16)a[r][c];
}

/* One tile: mr rows of xb against panel p (gated: gate panel 2p and up panel 2p + 1). The two bodies
 * differ only in the tile function, so each is this macro expanded with its own target. */
#define TILE_BODY(TILEFN)                                                                     \
    v16 acc[MR][3];                                                                           \
    const int64_t pw = Kp * NR; /* uint32 pairs per panel */                                  \
    if (!gated) {                                                                             \
        TILEFN(mr, xb, Kp, wp + p * pw, acc);                                                 \
        store_tile(mr, acc, y + p * NR, ldy, ncols, bias ? bias + p * NR : 0);                \
        return;                                                                               \
    }                                                                                         \
    v16 up[MR][3];                                                                            \
    TILEFN(mr, xb, Kp, wp + 2 * p * pw, acc);                                                 \
    TILEFN(mr, xb, Kp, wp + (2 * p + 1) * pw, up);                                            \
    for (int r = 0; r < mr; ++r)                                                              \
        for (int c = 0; c < 3; ++c) acc[r][c] = silu16(acc[r][c]) * up[r][c];                 \
    store_tile(mr, acc, y + p * NR, ldy, ncols, 0);

static inline __attribute__((always_inline)) void tile_w(const int mr, const uint32_t *xb, int64_t Kp,
                                                         const uint32_t *wp, int64_t p, int gated, float *y,
                                                         int64_t ldy, int64_t ncols, const float *bias) {
    TILE_BODY(tile_widen)
}

static inline __attribute__((always_inline)) BF16DOT void tile_d(const int mr, const uint32_t *xb, int64_t Kp,
                                                                 const uint32_t *wp, int64_t p, int gated,
                                                                 float *y, int64_t ldy, int64_t ncols,
                                                                 const float *bias) {
    TILE_BODY(tile_dot)
}

/* every tile of panel p: rows in tiles of MR, the last one shorter */
#define PANEL_BODY(TILE)                                                                     \
    for (int64_t r0 = 0; r0 < M; r0 += MR) {                                                 \
        const uint32_t *xr = xb + r0 * Kp;                                                   \
        float *yr = y + r0 * ldy;                                                            \
        switch (M - r0 < MR ? (int)(M - r0) : MR) {                                          \
        case 8: TILE(8, xr, Kp, wp, p, gated, yr, ldy, ncols, bias); break;                  \
        case 7: TILE(7, xr, Kp, wp, p, gated, yr, ldy, ncols, bias); break;                  \
        case 6: TILE(6, xr, Kp, wp, p, gated, yr, ldy, ncols, bias); break;                  \
        case 5: TILE(5, xr, Kp, wp, p, gated, yr, ldy, ncols, bias); break;                  \
        case 4: TILE(4, xr, Kp, wp, p, gated, yr, ldy, ncols, bias); break;                  \
        case 3: TILE(3, xr, Kp, wp, p, gated, yr, ldy, ncols, bias); break;                  \
        case 2: TILE(2, xr, Kp, wp, p, gated, yr, ldy, ncols, bias); break;                  \
        default: TILE(1, xr, Kp, wp, p, gated, yr, ldy, ncols, bias); break;                 \
        }                                                                                    \
    }

static void panel_widen(const uint32_t *xb, int64_t M, int64_t Kp, const uint32_t *wp, int64_t p, int gated,
                        float *y, int64_t ldy, int64_t ncols, const float *bias) {
    PANEL_BODY(tile_w)
}

static BF16DOT void panel_dot(const uint32_t *xb, int64_t M, int64_t Kp, const uint32_t *wp, int64_t p, int gated,
                              float *y, int64_t ldy, int64_t ncols, const float *bias) {
    PANEL_BODY(tile_d)
}

/* 1: vdpbf16ps, 0: the widening fallback; di_gemm_bf16dot_set_cap(0) forces the fallback (tests) */
static volatile int use_cap = 1;

int di_gemm_bf16dot_level(void) {
    __builtin_cpu_init();
    return use_cap && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
}

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
 * e = idx[t, j], y[t * k + j] = down_e @ bf16(silu(gate_e @ bf16(x[t])) * (up_e @ bf16(x[t]))), each GEMM
 * a bf16 pair-panel GEMM as above (so every output is one chain over k in order: a pair's result depends
 * only on its token and expert, whatever the batch). In one call: a stable counting sort of the pairs by
 * expert, x rounded once per token and copied to its pairs' rows in expert order, one item per (expert,
 * panel) for gate/up and then for down, and the slot combine. The weights: per expert the panels
 * pack_gated_weight / pack_weight(bf16_dot=True) lay out (gate/up: 2 * ceil(I / 48) panels over K = H,
 * down: ceil(H / 48) panels over K = I), experts one after another.
 *
 * Combine (wts given): out[t] = sum over j in order of wts[t, j] * y[t * k + j] (each product rounded,
 * then added), + add[t]: moe_gemm.c's combine_rows, called through di_moe_combine_rows. */
/* moe_gemm.c's slot combine (one implementation for both grouped kernels), y's rows found through pos */
void di_moe_combine_rows(const float *y, int64_t ldy, const int64_t *pos, int64_t t0, int64_t t1, int64_t k,
                         const float *wts, const float *add, int64_t ldadd, float *out, int64_t ldo, int64_t H);

/* Item `it` of one GEMM over the expert groups (P panels an expert): group it / P's rows (sorted positions
 * gstart[g] ..) of `in` (pairs, Kp a row) against panel it % P of its expert's weights (w, or the extra
 * stack xw past E; `stride` pairs an expert) into out (N columns a row, same sorted rows). */
static void group_item(int dot, int64_t it, int64_t P, const int64_t *gexp, const int64_t *gstart, int64_t E,
                       const uint32_t *w, const uint32_t *xw, int64_t stride, const uint32_t *in, int64_t Kp,
                       int gated, float *out, int64_t N) {
    const int64_t g = it / P, p = it % P, e = gexp[g], s0 = gstart[g], n = gstart[g + 1] - s0;
    const uint32_t *wp = e < E ? w + e * stride : xw + (e - E) * stride;
    const int64_t ncols = N - p * NR < NR ? N - p * NR : NR;
    if (dot)
        panel_dot(in + s0 * Kp, n, Kp, wp, p, gated, out + s0 * N, N, ncols, 0);
    else
        panel_widen(in + s0 * Kp, n, Kp, wp, p, gated, out + s0 * N, N, ncols, 0);
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
    const int64_t Hp = (H + 1) / 2, Ip = (I + 1) / 2, Pg = (I + NR - 1) / NR, Pd = (H + NR - 1) / NR;
    const int64_t gstride = 2 * Pg * Hp * NR, dstride = Pd * Ip * NR; /* uint32 pairs per expert */
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
    const uint32_t *gu = (const uint32_t *)gu16, *dn = (const uint32_t *)down16;
    const uint32_t *xgu = (const uint32_t *)xgu16, *xdn = (const uint32_t *)xdown16;
    const int dot = di_gemm_bf16dot_level();
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) round_row(x + t * ldx, H, xb + t * Hp);
#pragma omp for schedule(static)
        for (int64_t s = 0; s < R; ++s) memcpy(xs + s * Hp, xb + pair[s] / k * Hp, sizeof(uint32_t) * (size_t)Hp);
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < G * Pg; ++it) group_item(dot, it, Pg, gexp, gstart, E, gu, xgu, gstride, xs, Hp, 1, h, I);
#pragma omp for schedule(static)
        for (int64_t s = 0; s < R; ++s) round_row(h + s * I, I, hb + s * Ip);
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < G * Pd; ++it) group_item(dot, it, Pd, gexp, gstart, E, dn, xdn, dstride, hb, Ip, 0, ys, H);
        if (wts) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; ++t) di_moe_combine_rows(ys, H, pos, t, t + 1, k, wts, add, ldadd, out, ldo, H);
        } else {
#pragma omp for schedule(static)
            for (int64_t s = 0; s < R; ++s) memcpy(y + pair[s] * ldy, ys + s * H, sizeof(float) * (size_t)H);
        }
    }
    free(count); free(pair); free(pos); free(gstart); free(gexp); free(xb); free(xs); free(hb); free(ys);
    return 0;
}
