/* y = x @ W.T (+ bias) in fp32 on CPU, for the decoder's projections at every batch size.
 *
 * W is packed once at load into panels of NR = 48 output columns: panel p holds W[48p .. 48p+48, :]
 * transposed, [K][48], zero-padded past N. A tile of up to MR = 8 rows of x times one panel keeps its
 * 8 x 48 sums in 24 vector registers (AVX-512; other levels: see MR below) while the panel streams
 * through once per tile; threads split
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

#include <immintrin.h>

#if defined(GEMM_BF16) || defined(GEMM_F16)
typedef uint16_t wt_t;
#ifdef GEMM_BF16
#define FN(name) name##_bf16
/* bf16 panels pair the rows k and k + 1 of each column ([K/2][48][2], K padded to even): one 64-byte
 * load holds 16 columns of both, and each widens with one plain integer op (a bf16 is the top half of
 * an fp32: k's is shifted up, k + 1's masked in place). Against 48 consecutive bf16 per k widened by
 * vpmovzxwd + vpslld, which ran 0.94-0.98x the fp32 kernel at 32-128 rows on SmolLM2's shapes (2-core
 * Zen 5: the zero-extension is a cross-lane shuffle); the sum order per output is unchanged. */
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
#endif
#else
typedef float wt_t;
#define FN(name) name##_f32
#endif
#ifndef KPAD
#define KPAD(K) (K) /* the panel's stored rows */
#endif

#define NR 48

/* The register tile, per build level (cpu_level.h): MR rows x CV vectors of VW floats, covering
 * CV * VW of the panel's 48 columns, so a (panel, row tile) item takes NR / (CV * VW) passes over
 * its panel (the later ones from L1 / L2):
 * - AVX-512: 8 rows x 3 zmm = the whole panel, 24 of 32 registers;
 * - AVX2: 4 rows x 3 ymm = half the panel, 12 accumulators + 3 weight vectors + 1 broadcast in the
 *   16 ymm registers (the 8 x 48 tile needed 48 and spilled: 367 us vs F.linear's 86 for one
 *   1536 x 576 row on an AVX2-only EPYC, so oneDNN ran there instead);
 * - generic (SSE2): 3 rows x 4 xmm = a third of the panel, 12 of 16 registers.
 * The tile never changes an output's arithmetic (one multiply-add chain over k in order), so every
 * level's build is batch-invariant, and the AVX2 build gives the AVX-512 build's bits. */
#if defined(__AVX512F__)
#define VW 16
#define MR 8
#define CV 3
#elif defined(__AVX2__)
#define VW 8
#define MR 4
#define CV 3
#else
#define VW 4
#define MR 3
#define CV 4
#endif
#define TW (CV * VW)   /* columns a pass */
#define PASSES (NR / TW)

typedef float vw __attribute__((vector_size(VW * 4)));
typedef float vwu __attribute__((vector_size(VW * 4), aligned(4)));
typedef uint32_t u32w __attribute__((vector_size(VW * 4)));
typedef uint32_t u32wu __attribute__((vector_size(VW * 4), aligned(4)));
/* x in every lane, by the broadcast instruction: splat16's (v16){0} + x first adds 0.0 to the scalar
 * (a vaddss before every broadcast of the inner loop, and no broadcast folded into the FMA). The two
 * differ only for x = -0.0, whose products are zeros added to sums that start at +0.0: same bits. */
#if VW == 16
static inline vw splatw(float x) { return (vw)_mm512_set1_ps(x); }
#elif VW == 8
static inline vw splatw(float x) { return (vw)_mm256_set1_ps(x); }
#else
static inline vw splatw(float x) { return (vw)_mm_set1_ps(x); }
#endif

#if defined(GEMM_F16)
/* VW fp16 weights widened (vcvtph2ps: exact) */
static inline vw wloadw(const uint16_t *p) {
#if VW == 16
    return (vw)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__) /* VW 8 */
    return (vw)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    float t[VW];
    for (int i = 0; i < VW; ++i) t[i] = h2f(p[i]);
    return *(const vwu *)t;
#endif
}
#elif !defined(GEMM_BF16)
static inline vw wloadw(const float *p) { return *(const vwu *)p; }
#endif

/* One cache line of pf (NULL: none) every 4 k steps, into L2: a tile's share of the next panel (see di_gemm) */
#define PF_NEXT(k) do { if (pf && ((k) & 3) == 0) __builtin_prefetch(pf + ((k) >> 2) * 64, 0, 1); } while (0)

/* acc[r][0 .. CV-1] = x[r, :] . columns c0 .. c0 + TW - 1 of the panel w (all k, in order) */
static inline __attribute__((always_inline)) void panel_pass(const int mr, const float *x, int64_t ldx,
                                                             const wt_t *w, int64_t K, int c0, vw acc[MR][CV],
                                                             const char *pf) {
    for (int r = 0; r < mr; ++r)
        for (int c = 0; c < CV; ++c) acc[r][c] = splatw(0.f);
#ifdef GEMM_BF16
    const u32w hi = (u32w){0} + 0xffff0000u;
    int64_t k = 0;
    for (; k + 1 < K; k += 2) {
        PF_NEXT(k);
        const wt_t *wk = w + k * NR + 2 * c0; /* rows k, k + 1 of the pass's columns, side by side */
        u32w a[CV];
        vw e[CV], o[CV];
        for (int c = 0; c < CV; ++c) {
            a[c] = *(const u32wu *)(wk + 2 * VW * c);
            e[c] = (vw)(a[c] << 16);
            o[c] = (vw)(a[c] & hi);
        }
        for (int r = 0; r < mr; ++r) {
            const vw xb = splatw(x[r * ldx + k]), xn = splatw(x[r * ldx + k + 1]);
            for (int c = 0; c < CV; ++c) acc[r][c] += xb * e[c];
            for (int c = 0; c < CV; ++c) acc[r][c] += xn * o[c];
        }
    }
    if (k < K) { /* odd K: the last row, paired with zeros */
        const wt_t *wk = w + k * NR + 2 * c0;
        vw e[CV];
        for (int c = 0; c < CV; ++c) e[c] = (vw)(*(const u32wu *)(wk + 2 * VW * c) << 16);
        for (int r = 0; r < mr; ++r) {
            const vw xb = splatw(x[r * ldx + k]);
            for (int c = 0; c < CV; ++c) acc[r][c] += xb * e[c];
        }
    }
#else
    for (int64_t k = 0; k < K; ++k) {
        PF_NEXT(k);
        const wt_t *wk = w + k * NR + c0;
        vw wv[CV];
        for (int c = 0; c < CV; ++c) wv[c] = wloadw(wk + VW * c);
        for (int r = 0; r < mr; ++r) {
            const vw xb = splatw(x[r * ldx + k]);
            for (int c = 0; c < CV; ++c) acc[r][c] += xb * wv[c];
        }
    }
#endif
}

/* out[r][c0 .. c0 + TW) = acc[r] (rows r < mr of a [MR][NR] buffer) */
static inline __attribute__((always_inline)) void keep_pass(const int mr, vw acc[MR][CV], float out[MR][NR], int c0) {
    for (int r = 0; r < mr; ++r)
        for (int c = 0; c < CV; ++c) *(vwu *)(out[r] + c0 + VW * c) = acc[r][c];
}

/* rows r < mr of out (+ bias) to y, columns [0, ncols) of this panel (ncols < NR only in the last,
 * padded panel) */
static inline __attribute__((always_inline)) void store_rows(const int mr, float out[MR][NR], float *y, int64_t ldy,
                                                             int64_t ncols, const float *bias) {
    float padded[NR]; /* the last panel's bias, zero past N (not read past the caller's N floats) */
    if (bias && ncols < NR) {
        memset(padded, 0, sizeof padded);
        memcpy(padded, bias, sizeof(float) * (size_t)ncols);
        bias = padded;
    }
    for (int r = 0; r < mr; ++r) {
        if (bias)
            for (int c = 0; c < NR; c += 16) store16(out[r] + c, load16(out[r] + c) + load16(bias + c));
        memcpy(y + r * ldy, out[r], sizeof(float) * (size_t)ncols);
    }
}

static inline __attribute__((always_inline)) void tile(const int mr, const float *x, int64_t ldx, const wt_t *wp,
                                                       int64_t K, int64_t p, int gated, float *y, int64_t ldy,
                                                       int64_t ncols, const float *bias, const char *pf,
                                                       const char *pf_up) {
    vw acc[MR][CV];
    float out[MR][NR];
    const int64_t pstride = KPAD(K) * NR;
    const wt_t *wg = wp + (gated ? 2 * p : p) * pstride;
    /* prefetch only from the first pass (the later ones re-read this panel from cache) */
    for (int pass = 0; pass < PASSES; ++pass) {
        panel_pass(mr, x, ldx, wg, K, pass * TW, acc, pass ? 0 : pf);
        keep_pass(mr, acc, out, pass * TW);
    }
    if (gated) {
        float up[MR][NR];
        for (int pass = 0; pass < PASSES; ++pass) {
            panel_pass(mr, x, ldx, wg + pstride, K, pass * TW, acc, pass ? 0 : pf_up);
            keep_pass(mr, acc, up, pass * TW);
        }
        for (int r = 0; r < mr; ++r)
            for (int c = 0; c < NR; c += 16) store16(out[r] + c, silu16(load16(out[r] + c)) * load16(up[r] + c));
    }
    store_rows(mr, out, y + p * NR, ldy, ncols, gated || !bias ? 0 : bias + p * NR);
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
#if MR >= 8
        case 8: tile(8, xr, ldx, wp, K, p, gated, yr, ldy, ncols, bias, pf, pf_up); break;
        case 7: tile(7, xr, ldx, wp, K, p, gated, yr, ldy, ncols, bias, pf, pf_up); break;
        case 6: tile(6, xr, ldx, wp, K, p, gated, yr, ldy, ncols, bias, pf, pf_up); break;
        case 5: tile(5, xr, ldx, wp, K, p, gated, yr, ldy, ncols, bias, pf, pf_up); break;
#endif
#if MR >= 4
        case 4: tile(4, xr, ldx, wp, K, p, gated, yr, ldy, ncols, bias, pf, pf_up); break;
#endif
        case 3: tile(3, xr, ldx, wp, K, p, gated, yr, ldy, ncols, bias, pf, pf_up); break;
        case 2: tile(2, xr, ldx, wp, K, p, gated, yr, ldy, ncols, bias, pf, pf_up); break;
        default: tile(1, xr, ldx, wp, K, p, gated, yr, ldy, ncols, bias, pf, pf_up); break;
        }
    }
    return 0;
}
