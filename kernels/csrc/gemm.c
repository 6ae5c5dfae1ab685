/* y = x @ W.T (+ bias) in fp32 on CPU, for the decoder's projections at every batch size.
 *
 * W is packed once at load into panels of NR = 48 output columns: panel p holds W[48p .. 48p+48, :]
 * transposed, [K][48], zero-padded past N. A tile of up to MR = 8 rows of x times one panel keeps its
 * 8 x 48 sums in 24 vector registers while the panel streams through once per tile; threads split
 * the (panel, row tile) items in contiguous blocks, each tile prefetching its share of the next
 * panel. Against oneDNN's prepacked GEMM on SmolLM2's shapes with the weights coming from
 * memory (2-core AVX-512, benchmarks/kernels.py): 1.4-2.2x at 1 row, 1.1-1.5x at 4, 1.1-1.25x
 * at 32, 1.0-1.2x at 128 and about equal at prefill sizes.
 *
 * Every output element is one multiply-add chain over k = 0 .. K-1 in order, whatever the number of
 * rows or the tile a row lands in, so a row's result never depends on the other rows (batch-invariant
 * for every M, M = 1 included).
 *
 * Gated variant (silu(x @ gate.T) * (x @ up.T)): the packer interleaves gate and up panels (2j is
 * gate columns 48j.., 2j+1 the same up columns); a tile computes both and writes the product.
 *
 * The panels' storage type: fp32, or (gemm_w16.c includes this file with GEMM_BF16 / GEMM_F16
 * defined) a bf16 or fp16 checkpoint's own 16-bit values, widened to fp32 in registers as loaded.
 * Both widenings are exact, and the multiply-add chain is this file's, so a 16-bit build computes
 * bit for bit what the fp32 build computes on the same weights widened, reading half the bytes.
 */
#include <stdint.h>
#include <string.h>

#include "vec16.h"

#if defined(GEMM_BF16) || defined(GEMM_F16)
typedef uint16_t wt_t;
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
#if defined(__AVX512F__) || (defined(GEMM_F16) && defined(__F16C__))
#include <immintrin.h>
#endif
#ifdef GEMM_BF16
#define FN(name) name##_bf16
/* bf16 panels pair the rows k and k + 1 of each column ([K/2][48][2], K padded to even): one 64-byte
 * load holds 16 columns of both, and each widens with one plain integer op (a bf16 is the top half of
 * an fp32: k's is shifted up, k + 1's masked in place). Against 48 consecutive bf16 per k widened by
 * vpmovzxwd + vpslld, which ran 0.94-0.98x the fp32 kernel at 32-128 rows on SmolLM2's shapes (2-core
 * Zen 5: the zero-extension is a cross-lane shuffle); the sum order per output is unchanged. */
typedef uint32_t u32x16u __attribute__((vector_size(64), aligned(4)));
#define KPAD(K) (((K) + 1) & ~(int64_t)1)
#else
#define FN(name) name##_f16
#if !defined(__AVX512F__) && !defined(__F16C__)
/* one IEEE half to single, exactly (subnormal halves are normal singles) */
static inline float h2f(uint16_t h) {
    const uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t u;
    if (e == 0x1f)
        u = s | 0x7f800000u | (m << 13);
    else if (e)
        u = s | ((e + 112u) << 23) | (m << 13);
    else {
        const float f = (float)m * 0x1p-24f; /* exact: m < 2^10 */
        memcpy(&u, &f, 4);
        u |= s;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}
#endif
/* 16 fp16 widened (vcvtph2ps: exact) */
static inline v16 wload16(const uint16_t *p) {
#if defined(__AVX512F__)
    return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#else
    float t[16];
#if defined(__F16C__)
    _mm256_storeu_ps(t, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)));
    _mm256_storeu_ps(t + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8))));
#else
    for (int i = 0; i < 16; ++i) t[i] = h2f(p[i]);
#endif
    return load16(t);
#endif
}
#endif
#else
typedef float wt_t;
#define FN(name) name##_f32
static inline v16 wload16(const float *p) { return load16(p); }
#endif
#ifndef KPAD
#define KPAD(K) (K) /* the panel's stored rows */
#endif

#define NR 48
#define MR 8

#include "panel_tile.h"

/* One cache line of pf (NULL: none) every 4 k steps, into L2: a tile's share of the next panel (see di_gemm) */
#define PF_NEXT(k) do { if (pf && ((k) & 3) == 0) __builtin_prefetch(pf + ((k) >> 2) * 64, 0, 1); } while (0)

/* acc[r][0..2] = x[r, :] . panel (all k, in order) */
static inline __attribute__((always_inline)) void panel_tile(const int mr, const float *x, int64_t ldx,
                                                             const wt_t *w, int64_t K, v16 acc[MR][3],
                                                             const char *pf) {
    for (int r = 0; r < mr; ++r)
        for (int c = 0; c < 3; ++c) acc[r][c] = splat16(0.f);
#ifdef GEMM_BF16
    const u32x16 hi = (u32x16){0} + 0xffff0000u;
    int64_t k = 0;
    for (; k + 1 < K; k += 2) {
        PF_NEXT(k);
        const wt_t *wk = w + k * NR; /* rows k, k + 1 of 48 columns: 96 bf16 */
        const u32x16 a0 = *(const u32x16u *)wk, a1 = *(const u32x16u *)(wk + 32), a2 = *(const u32x16u *)(wk + 64);
        const v16 e0 = (v16)(a0 << 16), e1 = (v16)(a1 << 16), e2 = (v16)(a2 << 16);
        const v16 o0 = (v16)(a0 & hi), o1 = (v16)(a1 & hi), o2 = (v16)(a2 & hi);
        for (int r = 0; r < mr; ++r) {
            const v16 xb = splat16(x[r * ldx + k]), xn = splat16(x[r * ldx + k + 1]);
            acc[r][0] += xb * e0;
            acc[r][1] += xb * e1;
            acc[r][2] += xb * e2;
            acc[r][0] += xn * o0;
            acc[r][1] += xn * o1;
            acc[r][2] += xn * o2;
        }
    }
    if (k < K) { /* odd K: the last row, paired with zeros */
        const wt_t *wk = w + k * NR;
        const v16 e0 = (v16)(*(const u32x16u *)wk << 16), e1 = (v16)(*(const u32x16u *)(wk + 32) << 16),
                  e2 = (v16)(*(const u32x16u *)(wk + 64) << 16);
        for (int r = 0; r < mr; ++r) {
            const v16 xb = splat16(x[r * ldx + k]);
            acc[r][0] += xb * e0;
            acc[r][1] += xb * e1;
            acc[r][2] += xb * e2;
        }
    }
#else
    for (int64_t k = 0; k < K; ++k) {
        PF_NEXT(k);
        const wt_t *wk = w + k * NR;
        const v16 w0 = wload16(wk), w1 = wload16(wk + 16), w2 = wload16(wk + 32);
        for (int r = 0; r < mr; ++r) {
            const v16 xb = splat16(x[r * ldx + k]);
            acc[r][0] += xb * w0;
            acc[r][1] += xb * w1;
            acc[r][2] += xb * w2;
        }
    }
#endif
}

static inline __attribute__((always_inline)) void tile(const int mr, const float *x, int64_t ldx, const wt_t *wp,
                                                       int64_t K, int64_t p, int gated, float *y, int64_t ldy,
                                                       int64_t ncols, const float *bias, const char *pf,
                                                       const char *pf_up) {
    v16 acc[MR][3];
    if (!gated) {
        panel_tile(mr, x, ldx, wp + p * KPAD(K) * NR, K, acc, pf);
        store_tile(mr, acc, y + p * NR, ldy, ncols, bias ? bias + p * NR : 0);
        return;
    }
    v16 up[MR][3];
    panel_tile(mr, x, ldx, wp + 2 * p * KPAD(K) * NR, K, acc, pf);
    panel_tile(mr, x, ldx, wp + (2 * p + 1) * KPAD(K) * NR, K, up, pf_up);
    for (int r = 0; r < mr; ++r)
        for (int c = 0; c < 3; ++c) acc[r][c] = silu16(acc[r][c]) * up[r][c];
    store_tile(mr, acc, y + p * NR, ldy, ncols, 0);
}

/* x: [M, K] rows ldx apart; wp: packed panels (2 * P of them when gated); y: [M, N] rows ldy apart,
 * N = output columns (for gated: the gate/up width); bias: [N] or NULL (not with gated). */
int FN(di_gemm)(const float *x, int64_t ldx, int64_t M, const wt_t *wp, int64_t K, int64_t N, int gated,
                const float *bias, float *y, int64_t ldy) {
    const int64_t P = (N + NR - 1) / NR;
    const int64_t tiles = (M + MR - 1) / MR;
    /* Each row tile of panel p prefetches its share of panel p + 1 (the one this thread takes next
     * under the static schedule) into L2, spread over its k loop: otherwise the first tile of every
     * panel waits on memory for the whole panel while the others find it in L2. 48 fp32 weights of
     * K = 1024 (250 MB, from memory), 2 threads, builds alternating in one process, paired median of 8:
     * 1.03x at 1 row, 1.06x at 8, 1.03x at 32, 1.04x at 128, 1.03x at 512. Same bits either way. */
    const int64_t panel_bytes = (int64_t)sizeof(wt_t) * KPAD(K) * NR;
    const int64_t share = ((panel_bytes + tiles - 1) / tiles + 63) / 64 * 64;
    /* Threads split (panel, row tile) items in order, contiguous blocks each: the panels when there
     * are several (as before), and a single panel's row tiles (an MoE router's 32 columns) too, which
     * otherwise ran on one thread: 1.76x at 128 rows, 1.97x at 2048 on [32, 1024] weights (2 threads,
     * paired median of 8); the projections' shapes (1536 and 1024 columns) unchanged. */
#pragma omp parallel for schedule(static) if (P * tiles > 1 && M * N * K >= 32768)
    for (int64_t item = 0; item < P * tiles; ++item) {
        const int64_t p = item / tiles, t = item % tiles;
        const int64_t ncols = N - p * NR < NR ? N - p * NR : NR;
        const char *next = p + 1 < P ? (const char *)(wp + (gated ? 2 : 1) * (p + 1) * KPAD(K) * NR) : 0;
        const int64_t r0 = t * MR;
        const float *xr = x + r0 * ldx;
        float *yr = y + r0 * ldy;
        const char *pf = next ? next + t * share : 0, *pf_up = next && gated ? pf + panel_bytes : 0;
        switch (M - r0 < MR ? (int)(M - r0) : MR) {
        case 8: tile(8, xr, ldx, wp, K, p, gated, yr, ldy, ncols, bias, pf, pf_up); break;
        case 7: tile(7, xr, ldx, wp, K, p, gated, yr, ldy, ncols, bias, pf, pf_up); break;
        case 6: tile(6, xr, ldx, wp, K, p, gated, yr, ldy, ncols, bias, pf, pf_up); break;
        case 5: tile(5, xr, ldx, wp, K, p, gated, yr, ldy, ncols, bias, pf, pf_up); break;
        case 4: tile(4, xr, ldx, wp, K, p, gated, yr, ldy, ncols, bias, pf, pf_up); break;
        case 3: tile(3, xr, ldx, wp, K, p, gated, yr, ldy, ncols, bias, pf, pf_up); break;
        case 2: tile(2, xr, ldx, wp, K, p, gated, yr, ldy, ncols, bias, pf, pf_up); break;
        default: tile(1, xr, ldx, wp, K, p, gated, yr, ldy, ncols, bias, pf, pf_up); break;
        }
    }
    return 0;
}
