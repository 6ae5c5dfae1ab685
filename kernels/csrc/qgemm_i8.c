/* The int8 mode of the 32-element formats (Q4_0, Q4_1, Q8_0): activations quantised per 32-block to
 * int8, integer dot products against the weight blocks as stored, fp32 accumulation (llama.cpp's
 * scheme). qgemm.c's driver calls di_qi8_chunk per chunk of weight rows; the k-quants' int8 mode
 * is in qgemm_k.c.
 *
 * One arithmetic per output element, whatever M, the path (AVX2 group of G rows, AVX2 single row,
 * scalar) or the rows grouped with it: per block b, the exact integer dot_b = sum_j w_j q_j (at most
 * 32 * 127 * 128 in magnitude: exact in int32 and in fp32), then
 *     acc = fma((float)dot_b, d_b * s_b, acc)          (d_b the weight block's scale, s_b x's)
 *     macc = fma(m_b, xsum_b, macc)                     (Q4_1's min term; xsum_b = s_b * sum_j q_j)
 * in b order, y = acc + macc. Bit-identical across paths and batch sizes (batch-invariant), and the
 * scalar code is the reference the AVX2 code is tested against bit for bit.
 *
 * VNNI (vpdpbusd) replaces maddubs + madd where the build has it, the same bits (qgemm_avx2.h).
 *
 * AVX2: G = 8 weight rows side by side against one row of x. Each row's integer dot is 8 partial
 * int32 lanes (maddubs/madd); the 8 rows' lanes are summed into one vector of 8 totals (a
 * transpose-add of unpacks), and the rows' scales, gathered into one vector, multiply all 8 at
 * once: one fp32 FMA per block for 8 outputs where the old tile did one per output, plus a
 * broadcast scale and a scalar f16 conversion each. Measured against the old tile (4 rows of x by
 * one weight row, 8 fp32 lanes per output), one row of x, a simulated SmolLM2-135M decode step (30
 * layers' Q4_1 projections + the Q8_0 lm_head, weights from DRAM), both kernels in one process,
 * alternating, best of 9, quiet host: 1 thread qkv 960x576 1.72x, o 576x576 1.67x, gate_up
 * 3072x576 1.84x, down 576x1536 1.60x, lm_head 49152x576 1.31x, the step's projections 11.1 -> 6.7
 * ms; 2 threads 1.58x, 1.52x, 1.67x, 1.58x, 1.23x, 6.3 -> 4.1 ms (the lm_head then at 29 GB/s, about
 * the host's read bandwidth). The prefetch distance (1-4 groups, 4 or 8 KB) changed little except
 * for down (K = 1536, a group is 7.7 KB): 4 KB ahead was 1.2-1.5x slower than 8 KB or 2 groups (1
 * thread, loaded host).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qgemm.h"
#include "qgemm_avx2.h"

#define G 8 /* weight rows side by side (one vector of outputs) */

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline int32_t rd32(const uint8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }

/* ---- activations: qx = round(x / s), s = max|x| / 127 per 32-block ------------------------------- */
static void quantize_block_scalar(const float *xb, int8_t *q, float *scale, float *bsum) {
    float amax = 0.f;
    for (int j = 0; j < QK; ++j) amax = fmaxf(amax, fabsf(xb[j]));
    const float s = amax / 127.f, inv = s > 0.f ? 1.f / s : 0.f;
    int sum = 0;
    for (int j = 0; j < QK; ++j) {
        q[j] = (int8_t)lrintf(xb[j] * inv); /* round half to even, as cvtps2dq below */
        sum += q[j];
    }
    *scale = s;
    *bsum = s * (float)sum; /* Q4_1's m term: m * sum_j x_j ~ m * s * sum_j q_j */
}

/* the same operations as quantize_block_scalar, 8 lanes at a time: the same bits */
AVX2 static void quantize_block_avx2(const float *xb, int8_t *q, float *scale, float *bsum) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float s = _mm_cvtss_f32(h) / 127.f, inv = s > 0.f ? 1.f / s : 0.f;
    const __m256 vi = _mm256_set1_ps(inv);
    __m256i i32[4];
    for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vi));
    /* int32 -> int8 (|q| <= 127: no saturation); packs interleave 128-bit lanes, the permute undoes it */
    const __m256i a = _mm256_packs_epi32(i32[0], i32[1]), b = _mm256_packs_epi32(i32[2], i32[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p8);
    const __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    *scale = s;
    *bsum = s * (float)_mm_cvtsi128_si32(t);
}

int di_q8_quantize_rows(const float *x, int64_t ldx, int64_t M, int64_t K, int8_t *qx, float *scale, float *bsum) {
    if (K % QK) return 1;
    const int64_t nb = K / QK;
    const int avx2 = di_q_cpu_level() >= 1;
    for (int64_t r = 0; r < M; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            const float *xb = x + r * ldx + b * QK;
            int8_t *q = qx + r * K + b * QK;
            if (avx2) quantize_block_avx2(xb, q, scale + r * nb + b, bsum + r * nb + b);
            else quantize_block_scalar(xb, q, scale + r * nb + b, bsum + r * nb + b);
        }
    return 0;
}

/* ---- one weight row against one row of x (scalar: the reference order) --------------------------- */
static int fmt_bytes(int fmt) { return fmt == FMT_Q4_0 ? 18 : fmt == FMT_Q4_1 ? 20 : 34; }

static float row_scalar(int fmt, const uint8_t *wrow, int64_t nb, const int8_t *q, const float *xs,
                        const float *xsum) {
    const int bb = fmt_bytes(fmt);
    float acc = 0.f, macc = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = wrow + b * bb;
        const int8_t *a = q + b * QK;
        int dot = 0;
        if (fmt == FMT_Q8_0) {
            const int8_t *wq = (const int8_t *)(blk + 2);
            for (int j = 0; j < QK; ++j) dot += wq[j] * a[j];
        } else {
            const uint8_t *qs = blk + (fmt == FMT_Q4_1 ? 4 : 2);
            const int off = fmt == FMT_Q4_0 ? 8 : 0;
            for (int j = 0; j < 16; ++j) dot += ((qs[j] & 0xf) - off) * a[j] + ((qs[j] >> 4) - off) * a[j + 16];
        }
        acc = fmaf((float)dot, di_q_half(rd16(blk)) * xs[b], acc);
        if (fmt == FMT_Q4_1) macc = fmaf(di_q_half(rd16(blk + 2)), xsum[b], macc);
    }
    return acc + macc;
}

/* ---- AVX2 ------------------------------------------------------------------------------------------ */

/* the 32 quants of a 4-bit block as unsigned bytes in element order: the 16 bytes in both 128-bit
 * halves, the upper half shifted right by 4 (per 32-bit lane: the and drops what the shift brought
 * in from the next byte) */
AVX2 static inline __m256i nibbles(const uint8_t *qs) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0xf));
}

/* 8 int32 lanes whose sum is the block's dot product; Q4_0 without its -8 (the caller subtracts 8 sum q) */
AVX2 static inline __attribute__((always_inline)) __m256i block_dot(const int fmt, const uint8_t *blk, __m256i a,
                                                                     const int vnni) {
    if (fmt == FMT_Q8_0) return dot_i8(_mm256_loadu_si256((const __m256i *)(blk + 2)), a, vnni);
    /* 4-bit quants are 0..15: unsigned already, maddubs takes them as they are */
    return dot_u8s8(nibbles(blk + (fmt == FMT_Q4_1 ? 4 : 2)), a, vnni);
}

/* 8 * sum_j q_j of an activation block in every lane (Q4_0: sum (w - 8) q = sum w q - 8 sum q, exact) */
AVX2 static inline __m256i sum8_q(__m256i a) {
    __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), a), _mm256_set1_epi16(1));
    s = _mm256_add_epi32(s, _mm256_shuffle_epi32(s, 0x4e));
    s = _mm256_add_epi32(s, _mm256_shuffle_epi32(s, 0xb1));
    s = _mm256_add_epi32(s, _mm256_permute2x128_si256(s, s, 1));
    return _mm256_slli_epi32(s, 3);
}

AVX2 static inline int hsum_i32(__m256i v) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    return _mm_cvtsi128_si32(t);
}

/* one weight row (the rows a group of G does not fill): row_scalar's operations, the dot in AVX2 */
AVX2 static inline __attribute__((always_inline)) float row_avx2(const int fmt, const uint8_t *wrow, int64_t nb,
                                                                const int8_t *q, const float *xs, const float *xsum,
                                                                const int vnni) {
    const int bb = fmt_bytes(fmt);
    float acc = 0.f, macc = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = wrow + b * bb;
        const __m256i a = _mm256_loadu_si256((const __m256i *)(q + b * QK));
        int dot = hsum_i32(block_dot(fmt, blk, a, vnni));
        if (fmt == FMT_Q4_0) dot -= _mm256_cvtsi256_si32(sum8_q(a));
        acc = fmaf((float)dot, _cvtsh_ss(rd16(blk)) * xs[b], acc);
        if (fmt == FMT_Q4_1) macc = fmaf(_cvtsh_ss(rd16(blk + 2)), xsum[b], macc);
    }
    return acc + macc;
}

/* lanes (a0 + a2, b0 + b2, a1 + a3, b1 + b3) per 128-bit half: two rows' partial sums, interleaved */
AVX2 static inline __m256i pair_sum(__m256i a, __m256i b) {
    return _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
}

/* two pair_sums (rows a, b and c, d) -> (a, b, c, d) partial sums per 128-bit half */
AVX2 static inline __m256i quad_sum(__m256i ab, __m256i cd) {
    return _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
}

/* prefetch distance in weight bytes ahead of the group being read (the stream is linear: a group's
 * rows are contiguous, and a thread's chunks are too) */
#ifndef QI8_PFG
#define QI8_PFG 2
#endif

/* y[0..G) = one row of x (q, xs, xsum) against the G weight rows w, w + rb, ... Lanes hold the rows
 * in the order (0, 1, 4, 5, 2, 3, 6, 7): the order the transpose-add leaves them in, and the order the
 * (d, m) pairs of rows 0-3 and 4-7 land in after one conversion and shuffle each; put back on store. */
AVX2 static inline __attribute__((always_inline)) void group_avx2(const int fmt, const uint8_t *w, int64_t rb,
                                                                  int64_t nb, const int8_t *q, const float *xs,
                                                                  const float *xsum, float *y, int pf,
                                                                  const int vnni) {
    const int bb = fmt_bytes(fmt);
    __m256 acc = _mm256_setzero_ps(), macc = _mm256_setzero_ps();
    const char *pfp = (const char *)w + QI8_PFG * G * rb;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *p = w + b * bb;
        if (pf) /* the G rows' bytes of block b, QI8_PFG groups ahead in the linear stream */
            for (int o = 0; o < G * bb; o += 64) _mm_prefetch(pfp + b * (G * bb) + o, _MM_HINT_T0);
        const __m256i a = _mm256_loadu_si256((const __m256i *)(q + b * QK));
        const __m256i t01 = pair_sum(block_dot(fmt, p, a, vnni), block_dot(fmt, p + rb, a, vnni));
        const __m256i t45 = pair_sum(block_dot(fmt, p + 4 * rb, a, vnni), block_dot(fmt, p + 5 * rb, a, vnni));
        const __m256i t23 = pair_sum(block_dot(fmt, p + 2 * rb, a, vnni), block_dot(fmt, p + 3 * rb, a, vnni));
        const __m256i t67 = pair_sum(block_dot(fmt, p + 6 * rb, a, vnni), block_dot(fmt, p + 7 * rb, a, vnni));
        const __m256i u = quad_sum(t01, t45), v = quad_sum(t23, t67); /* rows (0 1 4 5), (2 3 6 7) */
        __m256i dot = _mm256_add_epi32(_mm256_blend_epi32(u, v, 0xf0), _mm256_permute2x128_si256(u, v, 0x21));
        if (fmt == FMT_Q4_0) dot = _mm256_sub_epi32(dot, sum8_q(a));
        /* the first 4 bytes of each block: (d, m) for Q4_1, d and a quant byte otherwise */
        const __m128i h0 = _mm_setr_epi32(rd32(p), rd32(p + rb), rd32(p + 2 * rb), rd32(p + 3 * rb));
        const __m128i h1 = _mm_setr_epi32(rd32(p + 4 * rb), rd32(p + 5 * rb), rd32(p + 6 * rb), rd32(p + 7 * rb));
        const __m256 f0 = _mm256_cvtph_ps(h0), f1 = _mm256_cvtph_ps(h1); /* d0 m0 d1 m1 | d2 m2 d3 m3 */
        const __m256 d = _mm256_shuffle_ps(f0, f1, 0x88);                 /* d0 d1 d4 d5 | d2 d3 d6 d7 */
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(xs[b])), acc);
        if (fmt == FMT_Q4_1) macc = _mm256_fmadd_ps(_mm256_shuffle_ps(f0, f1, 0xdd), _mm256_set1_ps(xsum[b]), macc);
    }
    const __m256 r = _mm256_add_ps(acc, macc);
    _mm256_storeu_ps(y, _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7)));
}

AVX2 static inline __attribute__((always_inline)) void chunk_avx2(const int fmt, const uint8_t *w, int64_t rb,
                                                                  int64_t n0, int64_t n1, int64_t nb,
                                                                  const int8_t *qx, const float *xs,
                                                                  const float *xsum, int64_t M, int64_t K, float *y,
                                                                  int64_t ldy, const int vnni) {
    for (int64_t r = 0; r < M; ++r) {
        const int8_t *q = qx + r * K;
        const float *s = xs + r * nb, *sm = xsum + r * nb;
        float *yr = y + r * ldy;
        int64_t n = n0;
        /* prefetch only for the first row of x: the chunk's weights are in L1 for the others */
        for (; n + G <= n1; n += G) group_avx2(fmt, w + n * rb, rb, nb, q, s, sm, yr + n, r == 0, vnni);
        for (; n < n1; ++n) yr[n] = row_avx2(fmt, w + n * rb, nb, q, s, sm, vnni);
    }
}

/* the format and VNNI as compile-time constants in each copy of the loop */
AVX2 static void chunk_fmt(const int fmt, const uint8_t *w, int64_t rb, int64_t n0, int64_t n1, int64_t nb,
                           const int8_t *qx, const float *xs, const float *xsum, int64_t M, int64_t K, float *y,
                           int64_t ldy, int vnni) {
#define CHUNK_FORMATS(V)                                                                                    \
    do {                                                                                                    \
        if (fmt == FMT_Q4_0) chunk_avx2(FMT_Q4_0, w, rb, n0, n1, nb, qx, xs, xsum, M, K, y, ldy, V);        \
        else if (fmt == FMT_Q4_1) chunk_avx2(FMT_Q4_1, w, rb, n0, n1, nb, qx, xs, xsum, M, K, y, ldy, V);   \
        else chunk_avx2(FMT_Q8_0, w, rb, n0, n1, nb, qx, xs, xsum, M, K, y, ldy, V);                        \
    } while (0)
#ifdef DI_HAVE_VNNI
    if (vnni) {
        CHUNK_FORMATS(1);
        return;
    }
#endif
    (void)vnni;
    CHUNK_FORMATS(0);
#undef CHUNK_FORMATS
}

/* y[r, n] for r < M, n0 <= n < n1 (y rows ldy apart) in the int8 mode; qx [M, K] / xs, xsum [M, K / 32]
 * from di_q8_quantize_rows. level: di_q_cpu_level() (capped), 0 for the scalar code; VNNI from 2 where
 * the build has it (bit-identical to the maddubs code, qgemm_avx2.h). */
void di_qi8_chunk(int fmt, int level, const uint8_t *w, int64_t rb, int64_t n0, int64_t n1, const int8_t *qx,
                  const float *xs, const float *xsum, int64_t M, int64_t K, float *y, int64_t ldy) {
    const int64_t nb = K / QK;
    if (level >= 1) { /* VNNI where the build and the level have it */
        chunk_fmt(fmt, w, rb, n0, n1, nb, qx, xs, xsum, M, K, y, ldy, di_cpu_vnni_at(level));
        return;
    }
    for (int64_t r = 0; r < M; ++r)
        for (int64_t n = n0; n < n1; ++n)
            y[r * ldy + n] = row_scalar(fmt, w + n * rb, nb, qx + r * K, xs + r * nb, xsum + r * nb);
}
