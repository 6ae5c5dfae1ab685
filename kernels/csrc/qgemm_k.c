/* GGUF k-quants kept as stored: super-blocks of 256 weights with per-sub-block scales.
 *
 * Layouts (ggml):
 *  - Q4_K, 144 bytes: {fp16 d; fp16 dmin; u8 scales[12]; u8 qs[128]}. Eight sub-blocks of 32, each
 *    with a 6-bit scale sc_j and 6-bit min m_j packed in `scales` (j < 4: sc = s[j] & 63,
 *    m = s[j + 4] & 63; j >= 4: the low 4 bits in s[j + 4] (sc low nibble, m high nibble), the high
 *    2 bits in the top bits of s[j - 4] (sc) and s[j] (m)). qs byte 32c + l holds element l of
 *    sub-block 2c (low nibble) and of sub-block 2c + 1 (high nibble). w = d sc_j q - dmin m_j.
 *  - Q6_K, 210 bytes: {u8 ql[128]; u8 qh[64]; i8 scales[16]; fp16 d}. Sixteen sub-blocks of 16 with
 *    an 8-bit signed scale each; 6-bit quants, w = d sc_(e/16) (q - 32). In half h (elements
 *    128h ..), element 32t + l takes its low 4 bits from ql[64h + l + 32 (t & 1)] (low nibble for
 *    t < 2, high for t >= 2) and its top 2 bits from bits 2t..2t+1 of qh[32h + l].
 *
 * Both are decoded to 8 x 32 small integers (sub-block g = elements 32g .. 32g + 31, the unit of
 * the int8 mode's activation blocks) plus a scale per 16 elements and an offset per 32, then
 * multiplied like the 32-element formats in qgemm.c: fp32 dequantised in registers (exact) or
 * int8 dot products (int8). One fixed reduction order per output element, whatever M.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "qgemm.h"
#include "qgemm_avx2.h"

#define MR 4

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* weight e of the super-block = q[e] * scale[e / 16] + off[e / 32] */
typedef struct {
    float scale[16];
    float off[8];
} kq_scales;

static inline void q4k_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static inline void kq_scales_of(int fmt, const uint8_t *b, kq_scales *s) {
    if (fmt == FMT_Q4_K) {
        const float d = di_q_half(rd16(b)), dmin = di_q_half(rd16(b + 2));
        for (int j = 0; j < 8; ++j) {
            int sc, m;
            q4k_scale_min(b + 4, j, &sc, &m);
            s->scale[2 * j] = s->scale[2 * j + 1] = d * (float)sc;
            s->off[j] = -(dmin * (float)m);
        }
    } else {
        const float d = di_q_half(rd16(b + 208));
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int j = 0; j < 16; ++j) s->scale[j] = d * (float)sc[j];
        for (int j = 0; j < 8; ++j) s->off[j] = 0.f;
    }
}

/* the 256 quants as signed bytes in element order (Q6_K: q - 32) */
static inline void kq_quants_scalar(int fmt, const uint8_t *b, int8_t q[QK_K]) {
    if (fmt == FMT_Q4_K) {
        const uint8_t *qs = b + 16;
        for (int c = 0; c < 4; ++c)
            for (int l = 0; l < 32; ++l) {
                q[64 * c + l] = (int8_t)(qs[32 * c + l] & 0xf);
                q[64 * c + 32 + l] = (int8_t)(qs[32 * c + l] >> 4);
            }
        return;
    }
    const uint8_t *ql = b, *qh = b + 128;
    for (int h = 0; h < 2; ++h)
        for (int t = 0; t < 4; ++t)
            for (int l = 0; l < 32; ++l) {
                const uint8_t lo = ql[64 * h + l + 32 * (t & 1)];
                const int nib = t < 2 ? lo & 0xf : lo >> 4;
                const int hi = (qh[32 * h + l] >> (2 * t)) & 3;
                q[128 * h + 32 * t + l] = (int8_t)((nib | (hi << 4)) - 32);
            }
}

static int kq_bytes(int fmt) { return fmt == FMT_Q4_K ? 144 : 210; }

/* ---- scalar --------------------------------------------------------------------------------------- */
static void dequant_row_scalar(int fmt, const uint8_t *row, int64_t K, float *out) {
    const int bb = kq_bytes(fmt);
    int8_t q[QK_K];
    kq_scales s;
    for (int64_t sb = 0; sb < K / QK_K; ++sb) {
        const uint8_t *b = row + sb * bb;
        kq_scales_of(fmt, b, &s);
        kq_quants_scalar(fmt, b, q);
        for (int e = 0; e < QK_K; ++e) out[sb * QK_K + e] = (float)q[e] * s.scale[e / 16] + s.off[e / 32];
    }
}

static void tile_exact_scalar(int fmt, const uint8_t *wrow, int64_t K, const float *x, int64_t ldx, int mr,
                              float *y, int64_t ldy) {
    float acc[MR][8] = {{0}};
    float wd[QK_K];
    for (int64_t sb = 0; sb < K / QK_K; ++sb) {
        dequant_row_scalar(fmt, wrow + sb * kq_bytes(fmt), QK_K, wd);
        for (int r = 0; r < mr; ++r) {
            const float *xb = x + r * ldx + sb * QK_K;
            for (int e = 0; e < QK_K; ++e) acc[r][e & 7] += wd[e] * xb[e];
        }
    }
    for (int r = 0; r < mr; ++r) {
        float *a = acc[r];
        y[r * ldy] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    }
}

static void tile_int8_scalar(int fmt, const uint8_t *wrow, int64_t K, const int8_t *qx, const float *xs,
                             const float *xsum, int mr, float *y, int64_t ldy) {
    const int64_t nb = K / QK;
    int8_t q[QK_K];
    kq_scales s;
    float acc[MR] = {0}, macc[MR] = {0};
    for (int64_t sb = 0; sb < K / QK_K; ++sb) {
        const uint8_t *b = wrow + sb * kq_bytes(fmt);
        kq_scales_of(fmt, b, &s);
        kq_quants_scalar(fmt, b, q);
        for (int r = 0; r < mr; ++r)
            for (int g = 0; g < 8; ++g) {
                const int64_t blk = sb * 8 + g;
                const int8_t *a = qx + r * K + blk * QK;
                int d0 = 0, d1 = 0;
                for (int l = 0; l < 16; ++l) {
                    d0 += q[32 * g + l] * a[l];
                    d1 += q[32 * g + 16 + l] * a[16 + l];
                }
                acc[r] += ((float)d0 * s.scale[2 * g] + (float)d1 * s.scale[2 * g + 1]) * xs[r * nb + blk];
                macc[r] = fmaf(s.off[g], xsum[r * nb + blk], macc[r]);
            }
    }
    for (int r = 0; r < mr; ++r) y[r * ldy] = acc[r] + macc[r];
}

/* ---- AVX2 ----------------------------------------------------------------------------------------- */

/* sub-block g's 32 quants as signed bytes */
AVX2 static inline void kq_quants_avx2(int fmt, const uint8_t *b, __m256i q[8]) {
    const __m256i m4 = _mm256_set1_epi8(0xf);
    if (fmt == FMT_Q4_K) {
        for (int c = 0; c < 4; ++c) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * c));
            q[2 * c] = _mm256_and_si256(v, m4);
            q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        }
        return;
    }
    const __m256i m2 = _mm256_set1_epi8(3), k32 = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        const __m256i lo[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                               _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                               _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
        for (int t = 0; t < 4; ++t) {
            const __m256i top = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * t), m2);
            q[4 * h + t] = _mm256_sub_epi8(_mm256_or_si256(lo[t], _mm256_slli_epi16(top, 4)), k32);
        }
    }
}

/* 32 signed bytes as four 8-float vectors (elements 0-7, 8-15, 16-23, 24-31) */
AVX2 static inline void bytes_to_ps(__m256i q, __m256 f[4]) {
    const __m128i a = _mm256_castsi256_si128(q), b = _mm256_extracti128_si256(q, 1);
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
    f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}

AVX2 static inline void sub_block_ps(const __m256i q, const kq_scales *s, int g, __m256 w[4]) {
    bytes_to_ps(q, w);
    const __m256 s0 = _mm256_set1_ps(s->scale[2 * g]), s1 = _mm256_set1_ps(s->scale[2 * g + 1]);
    const __m256 o = _mm256_set1_ps(s->off[g]);
    w[0] = _mm256_fmadd_ps(w[0], s0, o);
    w[1] = _mm256_fmadd_ps(w[1], s0, o);
    w[2] = _mm256_fmadd_ps(w[2], s1, o);
    w[3] = _mm256_fmadd_ps(w[3], s1, o);
}

/* Every 32-weight sub-block of a k-quant row, in order, as w[4] (4 x 8 fp32 weights) whose first column
 * is k0: the one walk the dequantiser and the exact tile share (a macro, so the tile's hot loop is
 * the same code as written out). */
#define KQ_WALK_AVX2(fmt, row, K, k0, w, BODY)                                  \
    do {                                                                        \
        const int bb_ = kq_bytes(fmt);                                          \
        for (int64_t sb_ = 0; sb_ < (K) / QK_K; ++sb_) {                        \
            const uint8_t *b_ = (row) + sb_ * bb_;                              \
            kq_scales s_;                                                       \
            __m256i q_[8];                                                      \
            kq_scales_of(fmt, b_, &s_);                                         \
            kq_quants_avx2(fmt, b_, q_);                                        \
            for (int g_ = 0; g_ < 8; ++g_) {                                    \
                __m256 w[4];                                                    \
                const int64_t k0 = sb_ * QK_K + 32 * g_;                        \
                sub_block_ps(q_[g_], &s_, g_, w);                               \
                BODY;                                                           \
            }                                                                   \
        }                                                                       \
    } while (0)

AVX2 static void dequant_row_avx2(int fmt, const uint8_t *row, int64_t K, float *out) {
    KQ_WALK_AVX2(fmt, row, K, k0, w, for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + k0 + 8 * i, w[i]));
}

AVX2 static inline __attribute__((always_inline)) void tile_exact_avx2(int fmt, const uint8_t *wrow, int64_t K,
                                                                       const float *x, int64_t ldx, int mr,
                                                                       float *y, int64_t ldy) {
    __m256 a0[MR], a1[MR];
    for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
    KQ_WALK_AVX2(fmt, wrow, K, k0, w, fma32_rows(w, x + k0, ldx, mr, a0, a1));
    for (int r = 0; r < mr; ++r) y[r * ldy] = hsum8(_mm256_add_ps(a0[r], a1[r]));
}

AVX2 static inline __attribute__((always_inline)) void tile_int8_avx2(int fmt, const uint8_t *wrow, int64_t K,
                                                                      const int8_t *qx, const float *xs,
                                                                      const float *xsum, int mr, float *y,
                                                                      int64_t ldy,
                                                                      const int vnni) {
    const int bb = kq_bytes(fmt);
    const int64_t nb = K / QK;
    __m256 acc[MR];
    float macc[MR] = {0};
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < K / QK_K; ++sb) {
        const uint8_t *b = wrow + sb * bb;
        kq_scales s;
        __m256i q[8];
        kq_scales_of(fmt, b, &s);
        kq_quants_avx2(fmt, b, q);
        for (int g = 0; g < 8; ++g) {
            const int64_t blk = sb * 8 + g;
            const __m256 sc = _mm256_setr_ps(s.scale[2 * g], s.scale[2 * g], s.scale[2 * g], s.scale[2 * g],
                                             s.scale[2 * g + 1], s.scale[2 * g + 1], s.scale[2 * g + 1],
                                             s.scale[2 * g + 1]);
            for (int r = 0; r < mr; ++r) {
                const __m256i a = _mm256_loadu_si256((const __m256i *)(qx + r * K + blk * QK));
                const __m256 f = _mm256_mul_ps(sc, _mm256_set1_ps(xs[r * nb + blk]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_i8(q[g], a, vnni)), f, acc[r]);
                /* an explicit fma: left to -ffp-contract, the VNNI build gave the 2-row tile other bits */
                macc[r] = fmaf(s.off[g], xsum[r * nb + blk], macc[r]);
            }
        }
    }
    for (int r = 0; r < mr; ++r) y[r * ldy] = hsum8(acc[r]) + macc[r];
}

/* tile size and format as compile-time constants (accumulators in registers, as in qgemm.c) */
#define KQ_CASES(CALL)                                                                                    \
    switch (mr) { case 4: CALL(4); break; case 3: CALL(3); break; case 2: CALL(2); break; default: CALL(1); }

AVX2 static void tile_avx2(int mode, int vnni, int fmt, const uint8_t *wrow, int64_t K, const float *x, int64_t ldx,
                           const int8_t *qx, const float *xs, const float *xsum, int mr, float *y, int64_t ldy) {
#define EX(R) (fmt == FMT_Q4_K ? tile_exact_avx2(FMT_Q4_K, wrow, K, x, ldx, R, y, ldy) \
                               : tile_exact_avx2(FMT_Q6_K, wrow, K, x, ldx, R, y, ldy))
#define I8V(R, V) (fmt == FMT_Q4_K ? tile_int8_avx2(FMT_Q4_K, wrow, K, qx, xs, xsum, R, y, ldy, V) \
                                   : tile_int8_avx2(FMT_Q6_K, wrow, K, qx, xs, xsum, R, y, ldy, V))
#define I8(R) (vnni ? I8V(R, 1) : I8V(R, 0))
    if (mode == DI_Q_EXACT) {
        KQ_CASES(EX)
    } else {
        KQ_CASES(I8)
    }
#undef EX
#undef I8
#undef I8V
}

/* ---- entry points ---------------------------------------------------------------------------------- */
void di_qk_dequant_row(int fmt, int avx2, const uint8_t *row, int64_t K, float *out) {
    if (avx2) dequant_row_avx2(fmt, row, K, out);
    else dequant_row_scalar(fmt, row, K, out);
}

/* level: di_q_cpu_level() (capped), 0 for the scalar code; the int8 dot in VNNI where the build and
 * the level have it (di_cpu_vnni_at; the same bits, qgemm_avx2.h) */
void di_qk_tile(int mode, int level, int fmt, const uint8_t *wrow, int64_t K, const float *x, int64_t ldx,
                const int8_t *qx, const float *xs, const float *xsum, int mr, float *y, int64_t ldy) {
    const int vnni = di_cpu_vnni_at(level);
    if (level >= 1) tile_avx2(mode, vnni, fmt, wrow, K, x, ldx, qx, xs, xsum, mr, y, ldy);
    else if (mode == DI_Q_EXACT) tile_exact_scalar(fmt, wrow, K, x, ldx, mr, y, ldy);
    else tile_int8_scalar(fmt, wrow, K, qx, xs, xsum, mr, y, ldy);
}
