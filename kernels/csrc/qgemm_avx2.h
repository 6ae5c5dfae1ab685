/* AVX2 pieces the quantised-weight kernels share (qgemm.c, qgemm_k.c, qgemm_panel.c): one copy, so
 * every kernel sums in the same order (the panel kernel is bit-identical to the row kernels). */
#ifndef DEEPINFER_QGEMM_AVX2_H
#define DEEPINFER_QGEMM_AVX2_H
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* sum over 32 bytes of w_j * q_j as 8 int32 lanes: maddubs needs an unsigned left operand, so signed
 * weights go in as |w| with their sign moved onto the activations */
AVX2 static inline __m256i dot_i8(__m256i w_signed, __m256i q) {
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w_signed, w_signed), _mm256_sign_epi8(q, w_signed));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

/* 32 dequantised weights w[4] against x rows r < mr (ldx apart, from xb): two accumulator chains per
 * row, in the order every exact kernel uses */
AVX2 static inline __attribute__((always_inline)) void fma32_rows(const __m256 *w, const float *xb, int64_t ldx,
                                                                   int mr, __m256 *a0, __m256 *a1) {
    for (int r = 0; r < mr; ++r) {
        const float *x = xb + r * ldx;
        a0[r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(x), a0[r]);
        a1[r] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), a1[r]);
        a0[r] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), a0[r]);
        a1[r] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), a1[r]);
    }
}
#endif
