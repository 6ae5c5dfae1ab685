/* y = x @ W.T for block-quantised W at many rows of x in bf16 dot products with fp32 accumulation (the
 * quant mode "bf16", Engine(dtype="bfloat16") on a GGUF checkpoint): AVX512_BF16's vdpbf16ps does two
 * bf16 products per fp32 lane per instruction, where qgemm_outer.c's fp32 FMA does one.
 *
 * The shape of qgemm_outer.c's AVX-512 kernel with bf16 operands: x is rounded to bf16 (round to
 * nearest even, vcvtneps2bf16) and transposed once per call into pairs xP [K / 2][Mp] (32 bits each:
 * x[r, 2p] low, x[r, 2p + 1] high; Mp = M rounded up to 16, zero rows past M); the weights are
 * dequantised to fp32 16 rows at a time (the formats' dequantisers) and rounded to bf16 the same way,
 * so a weight row read as 32-bit words is its pairs already; an 8 x 48 register tile (24 zmm: 8 weight
 * rows by 48 rows of x) sweeps xP: per pair, three loads of xP and eight broadcasts of one weight
 * pair feed 24 vdpbf16ps.
 *
 * Order: each output is one vdpbf16ps chain over the pairs p = 0 .. K/2 - 1 in order from 0, whatever M
 * or the tile a row falls in: a row's result does not depend on the batch. The products of two bf16
 * values are exact in fp32, so the result is the fp32 dot product of the bf16-rounded operands up to
 * the rounding of the running sum (how the instruction adds a pair into the lane is the CPU's).
 *
 * Needs di_q_cpu_level() 3 (AVX-512 F/BW/DQ/VL and AVX512_BF16); returns 1 elsewhere (quant.py then runs
 * the exact outer kernel). */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "qgemm.h"
#include "qgemm_avx2.h"

#define BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c")))
#define WR 16 /* weight rows per group */
#define XV 3  /* 16-row vectors of x per register tile, at most */
/* xP bytes per pass over the weights: as qgemm_outer.c's (L2: 1 MB per core on the Zen 5 host) */
#define XB_BYTES (640 << 10)

/* dst[i] = bf16(src[i]), i < n (a multiple of 16), round to nearest even */
BF16 static void round_bf16(const float *src, int64_t n, uint16_t *dst) {
    for (int64_t i = 0; i < n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
}

/* acc[j][c] lane i = sum over pairs p of w[j * K2 + p] . xP[p * ldt + 16 c + i] for j < wr (K2 = K / 2
 * pairs); y[r, j] for r < mr, j < nj */
BF16 static inline __attribute__((always_inline)) void tile_bf16(const int wr, const int xv, const uint32_t *w,
                                                                 int64_t K2, const uint32_t *xP, int64_t ldt, int mr,
                                                                 int nj, float *y, int64_t ldy) {
    __m512 acc[WR][XV];
    for (int j = 0; j < wr; ++j)
        for (int c = 0; c < xv; ++c) acc[j][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < K2; ++p) {
        __m512bh xp[XV];
        for (int c = 0; c < xv; ++c) xp[c] = (__m512bh)_mm512_load_si512(xP + p * ldt + 16 * c);
        for (int j = 0; j < wr; ++j) {
            const __m512bh wb = (__m512bh)_mm512_set1_epi32((int)w[j * K2 + p]);
            for (int c = 0; c < xv; ++c) acc[j][c] = _mm512_dpbf16_ps(acc[j][c], wb, xp[c]);
        }
    }
    float t[WR][16 * XV] __attribute__((aligned(64)));
    for (int j = 0; j < wr; ++j)
        for (int c = 0; c < xv; ++c) _mm512_store_ps(t[j] + 16 * c, acc[j][c]);
    /* 8 x 8 transposes where whole: one float at a time (a branch per column) took ~12% of the int8
     * kernel's tiles, which stored the same way (perf, SmolLM2 at 128 rows) */
    const int m8 = wr == 8 && nj == 8 ? mr / 8 * 8 : 0;
    for (int r = 0; r < m8; r += 8) transpose8(t[0] + r, 16 * XV, y + r * ldy, ldy);
    for (int r = m8; r < mr; ++r)
        for (int j = 0; j < nj; ++j) y[r * ldy + j] = t[j][r];
}

BF16 static int outer_bf16(const float *x, int64_t ldx, int64_t M, const uint8_t *w, int64_t row_bytes, int fmt,
                           int64_t N, int64_t K, float *y, int64_t ldy) {
    const int64_t K2 = K / 2, ldt = (M + 15) / 16 * 16, groups = (N + WR - 1) / WR;
    /* rows of x per pass over the weights, so that a pass's slice of xP stays in L2 */
    int64_t mb = XB_BYTES / (2 * K) / (16 * XV) * (16 * XV);
    if (mb < 16 * XV) mb = 16 * XV;
    uint16_t *xb = aligned_alloc(64, (size_t)(M * K) * sizeof(uint16_t));
    uint32_t *xP = aligned_alloc(64, (size_t)(K2 * ldt) * sizeof(uint32_t));
    if (!xb || !xP) {
        free(xb);
        free(xP);
        return 1;
    }
    const int par = groups > 1 && M * N * K >= 32768;
    int failed = 0;
#pragma omp parallel if (par)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; ++r) round_bf16(x + r * ldx, K, xb + r * K);
        /* xb as [M][K2] 32-bit pairs, transposed in 8 x 8 blocks (K2 is a multiple of 16), the rows
         * past the last whole 8 one by one */
        const int64_t m8 = M / 8 * 8;
        const uint32_t *xw = (const uint32_t *)xb;
#pragma omp for schedule(static)
        for (int64_t p0 = 0; p0 < K2; p0 += 16) {
            for (int64_t p = p0; p < p0 + 16; p += 8)
                for (int64_t r = 0; r < m8; r += 8)
                    transpose8((const float *)(xw + r * K2 + p), K2, (float *)(xP + p * ldt + r), ldt);
            for (int64_t p = p0; p < p0 + 16; ++p) {
                uint32_t *d = xP + p * ldt;
                for (int64_t r = m8; r < M; ++r) d[r] = xw[r * K2 + p];
                for (int64_t r = M; r < ldt; ++r) d[r] = 0;
            }
        }
        float *wf = aligned_alloc(64, (size_t)(WR * K) * sizeof(float));
        uint16_t *wb = aligned_alloc(64, (size_t)(WR * K) * sizeof(uint16_t));
        if (!wf || !wb) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t m0 = 0; m0 < M; m0 += mb) {
            const int64_t m1 = M - m0 < mb ? M : m0 + mb;
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; ++g) {
                if (!wf || !wb) continue;
                const int64_t n0 = g * WR;
                const int nj = N - n0 < WR ? (int)(N - n0) : WR;
                for (int j = 0; j < WR; ++j) {
                    if (j < nj) di_q_dequant_row(fmt, 2, w + (n0 + j) * row_bytes, K, wf + j * K);
                    else memset(wf + j * K, 0, sizeof(float) * (size_t)K);
                }
                prefetch_next_group(w, row_bytes, n0, N, WR);
                round_bf16(wf, WR * K, wb);
                const uint32_t *wp = (const uint32_t *)wb;
                OUTER_GROUP_TILES(tile_bf16, wp, K2, xP, ldt, m0, m1, nj, y + n0, ldy);
            }
        }
        free(wf);
        free(wb);
    }
    free(xb);
    free(xP);
    return failed;
}

/* y [M, N] (rows ldy apart) = x [M, K] (rows ldx apart) @ W.T in bf16 products, W as rows of blocks
 * (row_bytes apart); 1 when refused (di_q_cpu_level() below 3, unknown format, K not whole blocks, no
 * memory) */
int di_qgemm_outer_bf16(const float *x, int64_t ldx, int64_t M, const uint8_t *w, int64_t row_bytes, int fmt,
                        int64_t N, int64_t K, float *y, int64_t ldy) {
    const int be = di_q_block_elems(fmt);
    if (!be || K % be || K % 32 || di_q_cpu_level() < 3) return 1;
    return outer_bf16(x, ldx, M, w, row_bytes, fmt, N, K, y, ldy);
}
