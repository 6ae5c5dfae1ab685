/* y = x @ W.T for block-quantised W at many rows of x (prefill, large decode batches).
 *
 * The row-at-a-time kernels of qgemm.c / qgemm_k.c dequantise a weight row in registers for each
 * tile of 4 rows of x: fine while the weights' bytes are the cost (decode), but at 32+ rows each
 * weight is dequantised M / 4 times and every tile does 4 loads of x per 4 FMAs. Here three weight
 * rows at a time are dequantised once into a small fp32 buffer (L1) by the same AVX2 code, and a
 * register tile of 2 rows of x by those 3 weight rows sweeps all M rows: 5 loads per 6 FMAs, the
 * dequantisation paid once per call.
 *
 * The arithmetic is the exact mode's, operation for operation: the same dequantised fp32 values
 * (the same intrinsics), the same two accumulators per output (elements 0-7 and 16-23 of each
 * 32-block into one, 8-15 and 24-31 into the other, in k order), the same final sum. So a row's
 * result is bit-identical to qgemm.c's exact kernel whatever M or the path: the batch-invariant
 * mode may use this path too. AVX2 only (callers use the row kernels elsewhere).
 */
#include <immintrin.h>
#include <stdlib.h>

#include "qgemm.h"
#include "qgemm_avx2.h"

#define PR 2 /* rows of x per register tile */
#define PJ 3 /* weight rows per register tile (and per dequantised buffer) */

/* y[r, j] for r < mr, j < nj: x rows ldx apart, w = nj dequantised rows K apart */
AVX2 static inline __attribute__((always_inline)) void tile(const int mr, const int nj, const float *x, int64_t ldx,
                                                            const float *w, int64_t K, float *y, int64_t ldy) {
    __m256 a0[PR][PJ], a1[PR][PJ];
    for (int r = 0; r < PR; ++r)
        for (int j = 0; j < PJ; ++j) a0[r][j] = a1[r][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) { /* 16 = one half of a 32-block: 0-7 -> a0, 8-15 -> a1 */
        __m256 wv[PJ];
        for (int j = 0; j < nj; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
        for (int r = 0; r < mr; ++r) {
            const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
            for (int j = 0; j < nj; ++j) a0[r][j] = _mm256_fmadd_ps(wv[j], xv, a0[r][j]);
        }
        for (int j = 0; j < nj; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k + 8);
        for (int r = 0; r < mr; ++r) {
            const __m256 xv = _mm256_loadu_ps(x + r * ldx + k + 8);
            for (int j = 0; j < nj; ++j) a1[r][j] = _mm256_fmadd_ps(wv[j], xv, a1[r][j]);
        }
    }
    for (int r = 0; r < mr; ++r)
        for (int j = 0; j < nj; ++j) y[r * ldy + j] = hsum8(_mm256_add_ps(a0[r][j], a1[r][j]));
}

AVX2 static void sweep(int nj, const float *x, int64_t ldx, int64_t M, const float *w, int64_t K, float *y,
                       int64_t ldy) {
    int64_t r = 0;
    for (; r + PR <= M; r += PR) {
        if (nj == 3) tile(2, 3, x + r * ldx, ldx, w, K, y + r * ldy, ldy);
        else if (nj == 2) tile(2, 2, x + r * ldx, ldx, w, K, y + r * ldy, ldy);
        else tile(2, 1, x + r * ldx, ldx, w, K, y + r * ldy, ldy);
    }
    if (r < M) {
        if (nj == 3) tile(1, 3, x + r * ldx, ldx, w, K, y + r * ldy, ldy);
        else if (nj == 2) tile(1, 2, x + r * ldx, ldx, w, K, y + r * ldy, ldy);
        else tile(1, 1, x + r * ldx, ldx, w, K, y + r * ldy, ldy);
    }
}

/* exact-mode y [M, N] (rows ldy apart) = x [M, K] (rows ldx apart) @ W.T; 1 when refused (no
 * AVX2, unknown format, K not whole blocks, no memory). (A one-accumulator 4 x 3 tile was tried here
 * too: 2-4% faster, not bit-identical; qgemm_outer.c's outer-product tile replaced it for the default
 * mode: 1.5-1.9x this kernel at 128 rows.) */
int di_qgemm_panel(const float *x, int64_t ldx, int64_t M, const uint8_t *w, int64_t row_bytes, int fmt, int64_t N,
                   int64_t K, float *y, int64_t ldy) {
    const int be = di_q_block_elems(fmt);
    if (!be || K % be || di_q_cpu_level() < 1) return 1;
    const int64_t groups = (N + PJ - 1) / PJ;
    int failed = 0;
#pragma omp parallel if (groups > 1 && M * N * K >= 32768)
    {
        float *buf = aligned_alloc(64, (size_t)(PJ * K * sizeof(float) + 63) / 64 * 64);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; ++g) {
            if (!buf) continue;
            const int64_t n0 = g * PJ;
            const int nj = N - n0 < PJ ? (int)(N - n0) : PJ;
            for (int j = 0; j < nj; ++j) di_q_dequant_row(fmt, 1, w + (n0 + j) * row_bytes, K, buf + j * K);
            sweep(nj, x, ldx, M, buf, K, y + n0, ldy);
        }
        free(buf);
    }
    return failed;
}
