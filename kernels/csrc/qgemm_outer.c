/* y = x @ W.T for block-quantised W at many rows of x, for the default (not batch-invariant) mode.
 *
 * qgemm_panel.c keeps the row kernels' dot-product order (bit-identical to small M) and so sweeps x
 * for every three dequantised weight rows: at 128 rows of SmolLM2's K = 576, x is 295 KB, read from
 * L2 once per three outputs with five loads per six FMAs; the exact mode ran at 0.71x of the fp32
 * path's oneDNN GEMM there. Here the weights are dequantised 16 rows at a time (the same AVX2
 * dequantiser) and transposed into a [K][16] panel, and a 6 x 16 register tile does the outer
 * product: per k, two panel loads and six broadcasts of x feed twelve FMAs, and x is read once per
 * 16 outputs. K is walked in blocks of KC so the panel's block stays in L1 while the row tiles pass.
 *
 * Order: each output is one multiply-add chain over k = 0 .. K-1 (the running sum kept in y between
 * K blocks, which does not change it), whatever M or the tile a row falls in: still one fixed order
 * per output, so a row's result does not depend on the batch here, but it is not the row kernels'
 * order, so the bits differ from those of small M. The batch-invariant mode does not use it.
 */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "qgemm.h"
#include "qgemm_avx2.h"

#define OR 6   /* rows of x per register tile */
#define ON 16  /* outputs (weight rows) per panel: two vectors of 8 */
#define KC 256 /* k per block: a [KC][16] panel block is 16 KB (L1) */

/* 8 x 8 transpose: dst[c * lds + r] = src[r * ldr + c] */
AVX2 static inline void transpose8(const float *src, int64_t ldr, float *dst, int64_t lds) {
    __m256 r0 = _mm256_loadu_ps(src + 0 * ldr), r1 = _mm256_loadu_ps(src + 1 * ldr);
    __m256 r2 = _mm256_loadu_ps(src + 2 * ldr), r3 = _mm256_loadu_ps(src + 3 * ldr);
    __m256 r4 = _mm256_loadu_ps(src + 4 * ldr), r5 = _mm256_loadu_ps(src + 5 * ldr);
    __m256 r6 = _mm256_loadu_ps(src + 6 * ldr), r7 = _mm256_loadu_ps(src + 7 * ldr);
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(dst + 0 * lds, _mm256_permute2f128_ps(s0, s4, 0x20));
    _mm256_storeu_ps(dst + 1 * lds, _mm256_permute2f128_ps(s1, s5, 0x20));
    _mm256_storeu_ps(dst + 2 * lds, _mm256_permute2f128_ps(s2, s6, 0x20));
    _mm256_storeu_ps(dst + 3 * lds, _mm256_permute2f128_ps(s3, s7, 0x20));
    _mm256_storeu_ps(dst + 4 * lds, _mm256_permute2f128_ps(s0, s4, 0x31));
    _mm256_storeu_ps(dst + 5 * lds, _mm256_permute2f128_ps(s1, s5, 0x31));
    _mm256_storeu_ps(dst + 6 * lds, _mm256_permute2f128_ps(s2, s6, 0x31));
    _mm256_storeu_ps(dst + 7 * lds, _mm256_permute2f128_ps(s3, s7, 0x31));
}

/* panel[k * on + j] = W[n0 + j, k] dequantised (0 for j >= nj), on a multiple of 8; rows: scratch [on][K] */
AVX2 static void pack_panel(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n0, int nj, int on, int64_t K,
                            float *rows, float *panel) {
    for (int j = 0; j < on; ++j) {
        if (j < nj) di_q_dequant_row(fmt, 1, w + (n0 + j) * row_bytes, K, rows + j * K);
        else memset(rows + j * K, 0, sizeof(float) * (size_t)K);
    }
    for (int64_t k = 0; k < K; k += 8) /* K is a multiple of 32 */
        for (int j = 0; j < on; j += 8) transpose8(rows + j * K + k, K, panel + k * on + j, on);
}

/* rows r < mr of y[:, 0..16) (+)= x[r, k0 .. k0 + kc) @ panel block; first: start from 0 */
AVX2 static inline __attribute__((always_inline)) void tile(const int mr, const float *x, int64_t ldx,
                                                            const float *p, int64_t kc, float *y, int64_t ldy,
                                                            int first) {
    __m256 a0[OR], a1[OR];
    for (int r = 0; r < mr; ++r) {
        a0[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * ldy);
        a1[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * ldy + 8);
    }
    for (int64_t k = 0; k < kc; ++k) {
        const __m256 w0 = _mm256_load_ps(p + k * ON), w1 = _mm256_load_ps(p + k * ON + 8);
        for (int r = 0; r < mr; ++r) {
            const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
            a0[r] = _mm256_fmadd_ps(xb, w0, a0[r]);
            a1[r] = _mm256_fmadd_ps(xb, w1, a1[r]);
        }
    }
    for (int r = 0; r < mr; ++r) {
        _mm256_storeu_ps(y + r * ldy, a0[r]);
        _mm256_storeu_ps(y + r * ldy + 8, a1[r]);
    }
}

/* all M rows against one packed panel; out: [M][16] (ldo apart) */
AVX2 static void sweep_avx2(const float *x, int64_t ldx, int64_t M, const float *panel, int64_t K, float *out,
                       int64_t ldo) {
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = K - k0 < KC ? K - k0 : KC;
        const float *p = panel + k0 * ON;
        for (int64_t r = 0; r < M; r += OR) {
            const float *xr = x + r * ldx + k0;
            float *yr = out + r * ldo;
            switch (M - r < OR ? (int)(M - r) : OR) {
            case 6: tile(6, xr, ldx, p, kc, yr, ldo, k0 == 0); break;
            case 5: tile(5, xr, ldx, p, kc, yr, ldo, k0 == 0); break;
            case 4: tile(4, xr, ldx, p, kc, yr, ldo, k0 == 0); break;
            case 3: tile(3, xr, ldx, p, kc, yr, ldo, k0 == 0); break;
            case 2: tile(2, xr, ldx, p, kc, yr, ldo, k0 == 0); break;
            default: tile(1, xr, ldx, p, kc, yr, ldo, k0 == 0); break;
            }
        }
    }
}

/* ---- AVX-512: a 48-wide panel and an 8 x 48 register tile (24 accumulators of 32 zmm) ------------
 * Per k: three panel loads and eight broadcasts of x feed 24 FMAs, x read once per 48 outputs. Each
 * output is the same single FMA chain over k in order as in the AVX2 tile (fma(x, w, acc), from 0, the
 * running sum kept in y between K blocks): the same bits, only more outputs per step. */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))
#define OR5 8
#define ON5 48
#ifndef KC5
#define KC5 256 /* a [KC5][48] panel block is 48 KB */
#endif

AVX512 static inline __attribute__((always_inline)) void tile512(const int mr, const float *x, int64_t ldx,
                                                                const float *p, int64_t kc, float *y, int64_t ldy,
                                                                int first) {
    __m512 a0[OR5], a1[OR5], a2[OR5];
    for (int r = 0; r < mr; ++r) {
        a0[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * ldy);
        a1[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * ldy + 16);
        a2[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * ldy + 32);
    }
    for (int64_t k = 0; k < kc; ++k) {
        const float *pk = p + k * ON5;
        const __m512 w0 = _mm512_load_ps(pk), w1 = _mm512_load_ps(pk + 16), w2 = _mm512_load_ps(pk + 32);
        for (int r = 0; r < mr; ++r) {
            const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
            a0[r] = _mm512_fmadd_ps(xb, w0, a0[r]);
            a1[r] = _mm512_fmadd_ps(xb, w1, a1[r]);
            a2[r] = _mm512_fmadd_ps(xb, w2, a2[r]);
        }
    }
    for (int r = 0; r < mr; ++r) {
        _mm512_storeu_ps(y + r * ldy, a0[r]);
        _mm512_storeu_ps(y + r * ldy + 16, a1[r]);
        _mm512_storeu_ps(y + r * ldy + 32, a2[r]);
    }
}

/* all M rows against one packed 48-wide panel; out: [M][48] (ldo apart) */
AVX512 static void sweep_avx512(const float *x, int64_t ldx, int64_t M, const float *panel, int64_t K, float *out,
                                int64_t ldo) {
    for (int64_t k0 = 0; k0 < K; k0 += KC5) {
        const int64_t kc = K - k0 < KC5 ? K - k0 : KC5;
        const float *p = panel + k0 * ON5;
        for (int64_t r = 0; r < M; r += OR5) {
            const float *xr = x + r * ldx + k0;
            float *yr = out + r * ldo;
            switch (M - r < OR5 ? (int)(M - r) : OR5) {
            case 8: tile512(8, xr, ldx, p, kc, yr, ldo, k0 == 0); break;
            case 7: tile512(7, xr, ldx, p, kc, yr, ldo, k0 == 0); break;
            case 6: tile512(6, xr, ldx, p, kc, yr, ldo, k0 == 0); break;
            case 5: tile512(5, xr, ldx, p, kc, yr, ldo, k0 == 0); break;
            case 4: tile512(4, xr, ldx, p, kc, yr, ldo, k0 == 0); break;
            case 3: tile512(3, xr, ldx, p, kc, yr, ldo, k0 == 0); break;
            case 2: tile512(2, xr, ldx, p, kc, yr, ldo, k0 == 0); break;
            default: tile512(1, xr, ldx, p, kc, yr, ldo, k0 == 0); break;
            }
        }
    }
}

/* y [M, N] (rows ldy apart) = x [M, K] (rows ldx apart) @ W.T, W as rows of blocks (row_bytes apart);
 * 1 when refused (no AVX2, unknown format, K not whole blocks, no memory). The AVX-512 tile where
 * di_q_cpu_level() says so (2), else the AVX2 one: the same bits either way. */
int di_qgemm_outer(const float *x, int64_t ldx, int64_t M, const uint8_t *w, int64_t row_bytes, int fmt, int64_t N,
                   int64_t K, float *y, int64_t ldy) {
    const int be = di_q_block_elems(fmt), level = di_q_cpu_level();
    if (!be || K % be || K % 32 || level < 1) return 1;
    const int on = level >= 2 ? ON5 : ON;
    const int64_t panels = (N + on - 1) / on;
    int failed = 0;
#pragma omp parallel if (panels > 1 && M * N * K >= 32768)
    {
        const size_t fl = (size_t)K * on;
        /* rows scratch, the panel, and (last panel only) a [M][on] staging tile for a partial panel */
        float *buf = aligned_alloc(64, (2 * fl * sizeof(float) + 63) / 64 * 64);
        float *stage = N % on ? aligned_alloc(64, ((size_t)M * on * sizeof(float) + 63) / 64 * 64) : NULL;
        if (!buf || (N % on && !stage)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < panels; ++g) {
            if (!buf || (N % on && !stage)) continue;
            const int64_t n0 = g * on;
            const int nj = N - n0 < on ? (int)(N - n0) : on;
            float *panel = buf + fl;
            pack_panel(fmt, w, row_bytes, n0, nj, on, K, buf, panel);
            float *out = nj == on ? y + n0 : stage;
            const int64_t ldo = nj == on ? ldy : on;
            if (on == ON5) sweep_avx512(x, ldx, M, panel, K, out, ldo);
            else sweep_avx2(x, ldx, M, panel, K, out, ldo);
            if (nj < on)
                for (int64_t r = 0; r < M; ++r) memcpy(y + r * ldy + n0, stage + r * on, sizeof(float) * (size_t)nj);
        }
        free(buf);
        free(stage);
    }
    return failed;
}
