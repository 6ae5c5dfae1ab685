/* AVX2 pieces the quantised-weight kernels share (qgemm.c, qgemm_k.c, qgemm_panel.c, qgemm_outer.c,
 * qgemm_bf16.c, qgemm_i8_outer.c): one copy, so every kernel sums in the same order (the panel kernel is bit-identical to
 * the row kernels). */
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

/* VNNI's vpdpbusd (u8 x s8, four products summed into each int32 lane) where the library's build
 * has it (cpu_level.h: AVX512_VNNI or AVX-VNNI, compiled in where the CPU has it).
 * It gives the lanes maddubs + madd give: the same four bytes per lane, and maddubs cannot saturate
 * for these operands (|activation| <= 127 (di_q8_quantize_rows), weights 0..15 for the 4-bit
 * formats, |w| <= 128 for Q8_0 and 32 for the k-quants: |pair sum| <= 2 * 128 * 127 = 32512 <
 * 32767), so the integer dots and the results are the same bits either way. */
#include "cpu_level.h"

/* 8 int32 lanes, lane i = sum of u_j * s_j over bytes j = 4i .. 4i + 3 (u unsigned, s signed);
 * vnni: use vpdpbusd (only where DI_HAVE_VNNI, else ignored) */
AVX2 static inline __attribute__((always_inline)) __m256i dot_u8s8(__m256i u, __m256i s, const int vnni) {
#ifdef DI_HAVE_VNNI
    if (vnni) return DI_DPBUSD(_mm256_setzero_si256(), u, s);
#else
    (void)vnni;
#endif
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* sum over 32 bytes of w_j * q_j as 8 int32 lanes: maddubs needs an unsigned left operand, so signed
 * weights go in as |w| with their sign moved onto the activations */
AVX2 static inline __attribute__((always_inline)) __m256i dot_i8(__m256i w_signed, __m256i q, const int vnni) {
    return dot_u8s8(_mm256_sign_epi8(w_signed, w_signed), _mm256_sign_epi8(q, w_signed), vnni);
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

/* the weight rows n0 + wr .. n0 + 2 wr (of N, row_bytes apart) into L2: the outer kernels (qgemm_bf16.c,
 * qgemm_i8_outer.c) fetch the next group's bytes while this group's tiles run, as the dequantiser
 * otherwise waits on DRAM for each row once 30 layers' weights stream (perf, qgemm_i8_outer.c's
 * unpack_group: most of its samples on the weight loads) */
static inline void prefetch_next_group(const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t N, int64_t wr) {
    const int64_t rows = N - n0 - wr < wr ? N - n0 - wr : wr;
    const char *p = (const char *)(w + (n0 + wr) * row_bytes);
    for (int64_t o = 0; o < rows * row_bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
}

/* 8 x 8 transpose of 32-bit elements: dst[c * lds + r] = src[r * ldr + c] (moves bits only: the outer
 * kernels transpose fp32 x (qgemm_outer.c), bf16 pairs of x (qgemm_bf16.c) and int8 quads of x (qgemm_i8_outer.c) with it) */
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
/* The AVX-512 outer-product kernels' register tiles over one group of nj (<= WR) prepared weight rows
 * (weight row j at W + j * LDW) and rows [m0, m1) of the transposed x (XT, rows ldt apart), written to
 * y (row r at y + r * ldy): up to 24 accumulators, 16 weight rows by one vector of 16 x rows, or 8 by
 * two or three. TILE(wr, xv, w, ldw, xT, ldt, mr, nj, y, ldy) is the kernel's tile (qgemm_outer.c's
 * tile512, qgemm_bf16.c's tile_bf16); the includer defines WR and XV. */
#define OUTER_GROUP_TILES(TILE, W, LDW, XT, ldt, m0, m1, nj, y, ldy)                                          \
    for (int64_t r_ = (m0); r_ < (m1); r_ += 16 * XV) {                                                        \
        const int64_t rest_ = (m1) - r_;                                                                       \
        const int mr_ = rest_ < 16 * XV ? (int)rest_ : 16 * XV;                                                \
        float *yr_ = (y) + r_ * (ldy);                                                                         \
        switch ((mr_ + 15) / 16) {                                                                             \
        case 3:                                                                                                \
            for (int j_ = 0; j_ < (nj); j_ += 8)                                                               \
                TILE(8, 3, (W) + j_ * (LDW), LDW, (XT) + r_, ldt, mr_, (nj) - j_ < 8 ? (nj) - j_ : 8, yr_ + j_, \
                     ldy);                                                                                     \
            break;                                                                                             \
        case 2:                                                                                                \
            for (int j_ = 0; j_ < (nj); j_ += 8)                                                               \
                TILE(8, 2, (W) + j_ * (LDW), LDW, (XT) + r_, ldt, mr_, (nj) - j_ < 8 ? (nj) - j_ : 8, yr_ + j_, \
                     ldy);                                                                                     \
            break;                                                                                             \
        default: TILE(WR, 1, W, LDW, (XT) + r_, ldt, mr_, nj, yr_, ldy); break;                                \
        }                                                                                                      \
    }

/* the int8 mode's outer-product kernel in AVX2 (qgemm_i8_outer_avx2.c; qgemm_i8_outer.c's
 * di_qgemm_outer_i8 calls it where the AVX512_VNNI one does not run): fmt Q4_0 / Q4_1 / Q8_0, K a
 * positive multiple of 32; vnni: AVX-VNNI's vpdpbusd (where the build has it). 1 when out of memory */
int di_qi8_outer_avx2(const float *x, int64_t ldx, int64_t M, const uint8_t *w, int64_t rb, int fmt, int64_t N,
                      int64_t K, float *y, int64_t ldy, int vnni);
#endif
