/* Rows of 32-bit words copied transposed, for the grouped expert kernels' tall tiles (moe_gemm.c: fp32
 * rows; gemm_bf16dot.c: rows of bf16 pairs, one uint32 a pair). The words are moved, never computed
 * on, so a pair's bits come through unchanged whatever type the caller reads them as.
 *
 * dst[c * m + r] = src[r][c] for r < m, c < H: a tall tile's rows transposed, so its broadcasts are
 * constant offsets from one pointer. 16 columns at a time, so the stores run along dst (writing each
 * row straight down its column, m words apart, took 5% of the fp32 kernel's samples at batch 128,
 * Qwen3-MoE-shaped model). With AVX-512 a 16-column block of up to 16 rows is transposed in registers
 * (three rounds of shuffles) and each column stored as m contiguous words by one masked store. The
 * copy through an L1 tile before it (a memcpy call per row and block, then scalar moves) took ~0.2 ms
 * a layer at batch 128 (512 rows x 1024 columns, Qwen3-MoE-shaped, 2 threads), 4% of the expert
 * kernel; this ~0.11 ms (per-phase timers over 8 layers: 1.65 -> 0.92 ms). Engine tokens/s at batch
 * 128 moved within the noise (paired medians 0.98x and 1.01x in runs of 8 and 12 pairs). */
#ifndef DEEPINFER_TRANSPOSE32_H
#define DEEPINFER_TRANSPOSE32_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>

/* v[j] <- column j of the 16 x 16 block whose rows are v[0 .. 15] (shuffles only: the bits move as they are) */
static inline __attribute__((always_inline)) void transpose16x16(__m512 v[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) { /* per 128-bit lane: r_i[0] r_i+1[0] r_i[1] r_i+1[1] / [2], [3] */
        t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* u[i + q], 128-bit lane L: column 4L + q of rows i .. i+3 */
        u[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int q = 0; q < 4; ++q) { /* column 4L + q: lane L of u[q], u[4 + q], u[8 + q], u[12 + q] */
        const __m512 a = _mm512_shuffle_f32x4(u[q], u[4 + q], _MM_SHUFFLE(2, 0, 2, 0));
        const __m512 b = _mm512_shuffle_f32x4(u[8 + q], u[12 + q], _MM_SHUFFLE(2, 0, 2, 0));
        const __m512 c = _mm512_shuffle_f32x4(u[q], u[4 + q], _MM_SHUFFLE(3, 1, 3, 1));
        const __m512 d = _mm512_shuffle_f32x4(u[8 + q], u[12 + q], _MM_SHUFFLE(3, 1, 3, 1));
        v[q] = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0));
        v[8 + q] = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1));
        v[4 + q] = _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(2, 0, 2, 0));
        v[12 + q] = _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 1, 3, 1));
    }
}
#endif

/* src[r]: row r (H words); dst: H * m words */
static void transpose_rows32(const void *const *src, int m, int64_t H, void *dst) {
    uint32_t *d = (uint32_t *)dst;
    int64_t c0 = 0;
#if defined(__AVX512F__)
    for (; c0 + 16 <= H; c0 += 16)
        for (int b = 0; b < m; b += 16) {
            const int nb = m - b < 16 ? m - b : 16;
            const __mmask16 keep = (__mmask16)((1u << nb) - 1);
            __m512 v[16];
            for (int r = 0; r < 16; ++r) v[r] = _mm512_loadu_ps((const uint32_t *)src[b + (r < nb ? r : 0)] + c0);
            transpose16x16(v);
            for (int j = 0; j < 16; ++j) _mm512_mask_storeu_ps(d + (c0 + j) * m + b, keep, v[j]);
        }
#endif
    for (; c0 < H; ++c0)
        for (int r = 0; r < m; ++r) memcpy(d + c0 * m + r, (const uint32_t *)src[r] + c0, sizeof(uint32_t));
}
#endif
