/* y = x @ W.T in the int8 mode (Engine(dtype="quantized")) at many rows of x: the int8 row kernel's
 * arithmetic (qgemm_i8.c) as an outer product, so that AVX512_VNNI's vpdpbusd (64 byte products per
 * instruction) does the work where the row kernel reads each weight block once per row of x.
 *
 * x is quantised per 32-block by the row kernel's own quantiser (di_q8_quantize_rows: the same qx,
 * scales s and s * sum q), then transposed once per call, in panels of 32 rows, into dwords of 4
 * consecutive k (and its per-block values into columns). 16 weight rows at a time are unpacked into
 * bytes in element order with their block scales. A register tile of TJ weight
 * rows by XV vectors of 16 rows of x sums each block's integer dot in int32 lanes (8 vpdpbusd, 4 k each),
 * then folds it into the fp32 accumulator.
 *
 * Operands: vpdpbusd multiplies unsigned by signed bytes. The 4-bit quants (0..15) go in unsigned
 * against the signed activations; Q4_0's -8 offset is the block's -8 * sum q, put in the int32 lanes
 * before the first product (as the row kernel subtracts it). Q8_0's quants are signed, so the
 * activations go in unsigned as q + 128 (0x80 flipped once in xT) and the lanes start at
 * -128 * sum w of the weight block. Every integer is exact (|lane| < 2^21).
 *
 * Order: per output, exactly the row kernel's: per block b in order, the exact dot_b, then
 *     acc = fma((float)dot_b, d_b * s_b, acc),     macc = fma(m_b, xsum_b, macc)   (Q4_1)
 * and y = acc + macc; so the result is the row kernel's bit for bit, whatever M or the tile a row
 * falls in (tests/kernels/test_quant_i8_outer.py), and it may run in the batch-invariant mode.
 *
 * Needs di_q_cpu_level() 2 and the avx512 build on a CPU with AVX512_VNNI (cpu_level.h). Elsewhere from
 * level 1 di_qgemm_outer_i8 runs the AVX2 kernel (qgemm_i8_outer_avx2.c: vpmaddubsw / vpmaddwd, or
 * AVX-VNNI's ymm vpdpbusd where the build has it; the same bits), and at level 0 or for the k-quants it
 * returns 1 (quant.py then runs the int8 row kernel, the same bits).
 */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "qgemm.h"
#include "qgemm_avx2.h"

#define WR 16 /* weight rows unpacked per group */
/* the register tile: TJ weight rows by XV vectors of 16 rows of x, an int32 and an fp32 accumulator
 * each (4 x 2: 16 zmm, plus 2 x vectors and a broadcast). 4 x 3 (24 + 4 zmm) left gcc too few registers
 * for the per-block float step: it spilled 7 of the 12 fp32 accumulators to the stack every block and
 * copied int32 ones between registers (objdump); 4 x 2 keeps all in registers. One thread, SmolLM2
 * shapes at 128 rows, ms: gate_up 0.92-1.17 vs 1.10-1.36, the Q8_0 LM head 15.0-15.5 vs 19.1-21.0;
 * 8 x 1 was no better */
#define TJ 4
#define XV 2
/* xT bytes per pass over the weights, as qgemm_outer.c's (L2: 1 MB per core on the Zen 5 host) */
#define XB_BYTES (640 << 10)

#if defined(DI_HAVE_VNNI) && DI_VNNI_LEVEL == 2 /* AVX512_VNNI: zmm vpdpbusd */
static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* rows of x per panel: a tile's rows, whose xT is one contiguous stream. One [K / 4][Mp] array (rows
 * 2 KB apart at 512 rows) mapped a tile's reads onto a few L1 sets: gate_up 3072 x 576, 512 rows, 1
 * thread, 6.1 ms, in panels 4.1 (the bf16 kernel 4.6-5.3) */
#define PR (16 * XV)

/* x's side, transposed in panels of PR rows (lanes are rows of x; panel P holds rows P * PR ..) */
typedef struct {
    const uint32_t *q;    /* [Mp / PR][K / 4][PR]: 4 activations of a row (Q8_0: each + 128 as unsigned) */
    const float *s;       /* [Mp / PR][nb][PR]: block scales */
    const float *sum;     /* [Mp / PR][nb][PR]: s * sum q (Q4_1's min term) */
    const int32_t *init;  /* [Mp / PR][nb][PR]: -8 * sum q (Q4_0's offset) */
} xcols;

/* WR weight rows unpacked: quants as bytes in element order, per-block d, m (Q4_1), -128 * sum w (Q8_0) */
typedef struct {
    uint8_t *q;   /* [WR][K] */
    float *d, *m; /* [WR][nb] */
    int32_t *c;   /* [WR][nb] */
} wgroup;

static int fmt_bytes(int fmt) { return fmt == FMT_Q4_0 ? 18 : fmt == FMT_Q4_1 ? 20 : 34; }

/* rows n0 .. n0 + nj of W into g (rows nj .. WR zero: their outputs are not stored). In SSE / AVX2
 * ops: plain C here compiled to byte inserts and took half the call at 16 rows (perf, gate_up 3072 x 576) */
AVX2 static void unpack_group(int fmt, const uint8_t *w, int64_t rb, int64_t n0, int nj, int64_t K,
                              const wgroup *g) {
    const int64_t nb = K / QK;
    const int bb = fmt_bytes(fmt);
    for (int j = 0; j < WR; ++j) {
        uint8_t *q = g->q + j * K;
        if (j >= nj) {
            memset(q, 0, (size_t)K);
            for (int64_t b = 0; b < nb; ++b) g->d[j * nb + b] = g->m[j * nb + b] = 0.f, g->c[j * nb + b] = 0;
            continue;
        }
        const uint8_t *row = w + (n0 + j) * rb;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = row + b * bb;
            uint8_t *qb = q + b * QK;
            g->d[j * nb + b] = _cvtsh_ss(rd16(blk));
            g->m[j * nb + b] = fmt == FMT_Q4_1 ? _cvtsh_ss(rd16(blk + 2)) : 0.f;
            if (fmt == FMT_Q8_0) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 2));
                _mm256_storeu_si256((__m256i *)qb, v);
                /* sum of the 32 signed quants: pairs widened by maddubs against ones, then madd */
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v), _mm256_set1_epi16(1));
                __m128i t = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
                t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
                t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
                g->c[j * nb + b] = -128 * _mm_cvtsi128_si32(t);
            } else {
                const __m128i v = _mm_loadu_si128((const __m128i *)(blk + (fmt == FMT_Q4_1 ? 4 : 2)));
                const __m128i lo = _mm_set1_epi8(0xf);
                _mm_storeu_si128((__m128i *)qb, _mm_and_si128(v, lo));
                _mm_storeu_si128((__m128i *)(qb + 16), _mm_and_si128(_mm_srli_epi16(v, 4), lo));
                g->c[j * nb + b] = 0;
            }
        }
    }
}

#define I8 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")))

/* ot[j][r] (rows PR apart) for j0 <= j < j0 + tj, r < 16 xv: x rows r0 .. (lanes of xv vectors) against weight
 * rows j0 .. j0 + tj of g */
I8 static inline __attribute__((always_inline)) void tile_i8(const int fmt, const int tj, const int xv,
                                                             const wgroup *g, int j0, int64_t K, const xcols *X,
                                                             int64_t r0, float *ot) {
    const int64_t nb = K / QK, P = r0 / PR;
    const uint32_t *xq = X->q + P * (K / 4) * PR;
    const float *xs = X->s + P * nb * PR, *xsum = X->sum + P * nb * PR;
    const int32_t *xinit = X->init + P * nb * PR;
    __m512 acc[TJ][XV];
    for (int j = 0; j < tj; ++j)
        for (int c = 0; c < xv; ++c) acc[j][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m512i dot[TJ][XV];
        for (int j = 0; j < tj; ++j)
            for (int c = 0; c < xv; ++c)
                dot[j][c] = fmt == FMT_Q4_0   ? _mm512_load_si512(xinit + b * PR + 16 * c)
                            : fmt == FMT_Q8_0 ? _mm512_set1_epi32(g->c[(j0 + j) * nb + b])
                                              : _mm512_setzero_si512();
        /* unrolled: without it gcc copied the 12 accumulators between registers every step (perf) */
#pragma GCC unroll 8
        for (int64_t p = 8 * b; p < 8 * b + 8; ++p) {
            __m512i xv_[XV];
            for (int c = 0; c < xv; ++c) xv_[c] = _mm512_load_si512(xq + p * PR + 16 * c);
            for (int j = 0; j < tj; ++j) {
                int32_t wd;
                memcpy(&wd, g->q + (j0 + j) * K + 4 * p, 4);
                const __m512i wb = _mm512_set1_epi32(wd);
                for (int c = 0; c < xv; ++c)
                    dot[j][c] = fmt == FMT_Q8_0 ? _mm512_dpbusd_epi32(dot[j][c], xv_[c], wb)
                                                : _mm512_dpbusd_epi32(dot[j][c], wb, xv_[c]);
            }
        }
        /* one x scale live at a time, d_j broadcast from memory per use: with all of them hoisted gcc
         * spilled fp32 accumulators to the stack every block (perf) */
        for (int c = 0; c < xv; ++c) {
            const __m512 s = _mm512_load_ps(xs + b * PR + 16 * c);
            for (int j = 0; j < tj; ++j)
                acc[j][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[j][c]),
                                            _mm512_mul_ps(_mm512_set1_ps(g->d[(j0 + j) * nb + b]), s), acc[j][c]);
        }
    }
    /* y = acc + macc, macc the min term's own chain (zero but for Q4_1), as the row kernel adds them */
    __m512 macc[TJ][XV];
    for (int j = 0; j < tj; ++j)
        for (int c = 0; c < xv; ++c) macc[j][c] = _mm512_setzero_ps();
    if (fmt == FMT_Q4_1)
        for (int64_t b = 0; b < nb; ++b) {
            __m512 xm[XV];
            for (int c = 0; c < xv; ++c) xm[c] = _mm512_load_ps(xsum + b * PR + 16 * c);
            for (int j = 0; j < tj; ++j) {
                const __m512 m = _mm512_set1_ps(g->m[(j0 + j) * nb + b]);
                for (int c = 0; c < xv; ++c) macc[j][c] = _mm512_fmadd_ps(m, xm[c], macc[j][c]);
            }
        }
    for (int j = 0; j < tj; ++j)
        for (int c = 0; c < xv; ++c) _mm512_store_ps(ot + (j0 + j) * PR + 16 * c, _mm512_add_ps(acc[j][c], macc[j][c]));
}

/* y[r, j] = ot[j * PR + r] for 16 r, 16 j: one 16 x 16 transpose in zmm registers (4 shuffle stages of
 * 16), each row of y written as one 64-byte store */
I8 static inline void transpose16(const float *ot, float *y, int64_t ldy) {
    __m512 a[16], b[16];
    for (int i = 0; i < 16; ++i) a[i] = _mm512_load_ps(ot + i * PR);
    for (int i = 0; i < 16; i += 2) { /* pairs of elements: (j, j+1) interleaved per r */
        b[i] = _mm512_unpacklo_ps(a[i], a[i + 1]);
        b[i + 1] = _mm512_unpackhi_ps(a[i], a[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* 4 j's per 128-bit lane */
        a[i] = _mm512_shuffle_ps(b[i], b[i + 2], 0x44);
        a[i + 1] = _mm512_shuffle_ps(b[i], b[i + 2], 0xee);
        a[i + 2] = _mm512_shuffle_ps(b[i + 1], b[i + 3], 0x44);
        a[i + 3] = _mm512_shuffle_ps(b[i + 1], b[i + 3], 0xee);
    }
    for (int i = 0; i < 4; ++i) { /* 128-bit lanes: j groups 0-3 with 4-7, 8-11 with 12-15 */
        b[i] = _mm512_shuffle_f32x4(a[i], a[i + 4], 0x88);
        b[i + 4] = _mm512_shuffle_f32x4(a[i], a[i + 4], 0xdd);
        b[i + 8] = _mm512_shuffle_f32x4(a[i + 8], a[i + 12], 0x88);
        b[i + 12] = _mm512_shuffle_f32x4(a[i + 8], a[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; ++i) { /* halves: j 0-7 with 8-15 */
        a[i] = _mm512_shuffle_f32x4(b[i], b[i + 8], 0x88);
        a[i + 8] = _mm512_shuffle_f32x4(b[i], b[i + 8], 0xdd);
    }
    for (int r = 0; r < 16; ++r) _mm512_storeu_ps(y + r * ldy, a[r]); /* a[r]: y's row r, j = 0 .. 15 */
}

/* y[r, j] = ot[j * PR + r] for r < mr, j < nj: 16 x 16 transposes where whole (every group of 16 weight
 * rows at 16 or 32 rows of x), else 8 x 8 ones, else one by one. The tiles' 16-row x 4-column pieces
 * stored one float at a time (with a branch per column) took ~12% of the tiles' time (perf, SmolLM2 at
 * 128 rows). The 16 x 16 transposes against the 8 x 8 ones (AVX2, 32-byte stores) they replaced, int8
 * mode at batch 128: 4.0% of the run's samples vs 6.2%; one thread, SmolLM2's GEMMs at 128 rows, 3
 * alternating runs: 124.5-128.0 vs 127.6-143.4 ms a step (the Q8_0 LM head 25.3-26.1 vs 26.4-27.5) */
I8 static void store_group(const float *ot, int mr, int nj, float *y, int64_t ldy) {
    if (nj == 16 && mr % 16 == 0) {
        for (int r = 0; r < mr; r += 16) transpose16(ot + r, y + r * ldy, ldy);
        return;
    }
    const int m8 = mr / 8 * 8, n8 = nj / 8 * 8;
    for (int r = 0; r < m8; r += 8)
        for (int j = 0; j < n8; j += 8) transpose8(ot + j * PR + r, PR, y + r * ldy + j, ldy);
    for (int r = 0; r < mr; ++r)
        for (int j = r < m8 ? n8 : 0; j < nj; ++j) y[r * ldy + j] = ot[j * PR + r];
}

/* one group's tiles for x rows r0 .. r0 + mr, the format a compile-time constant */
I8 static inline __attribute__((always_inline)) void group_i8(const int fmt, const wgroup *g, int nj, int64_t K,
                                                              const xcols *X, int64_t r0, int mr, float *y,
                                                              int64_t ldy) {
    const int xv = (mr + 15) / 16;
    float ot[WR * PR] __attribute__((aligned(64)));
    for (int j = 0; j < nj; j += TJ) {
        if (xv == 2) tile_i8(fmt, TJ, 2, g, j, K, X, r0, ot);
        else tile_i8(fmt, TJ, 1, g, j, K, X, r0, ot);
    }
    store_group(ot, mr, nj, y, ldy);
}

I8 static void group_fmt(int fmt, const wgroup *g, int nj, int64_t K, const xcols *X, int64_t r0, int mr, float *y,
                         int64_t ldy) {
    if (fmt == FMT_Q4_0) group_i8(FMT_Q4_0, g, nj, K, X, r0, mr, y, ldy);
    else if (fmt == FMT_Q4_1) group_i8(FMT_Q4_1, g, nj, K, X, r0, mr, y, ldy);
    else group_i8(FMT_Q8_0, g, nj, K, X, r0, mr, y, ldy);
}

I8 static int outer_i8(const float *x, int64_t ldx, int64_t M, const uint8_t *w, int64_t rb, int fmt, int64_t N,
                       int64_t K, float *y, int64_t ldy) {
    const int64_t nb = K / QK, K4 = K / 4, Mp = (M + PR - 1) / PR * PR, groups = (N + WR - 1) / WR;
    /* rows of x per pass over the weights, so that a pass's slice of xT stays in L2 */
    int64_t mb = XB_BYTES / K / PR * PR;
    if (mb < PR) mb = PR;
    int8_t *qx = aligned_alloc(64, (size_t)(M * K));
    float *xs = malloc(sizeof(float) * (size_t)(M * nb)), *xsum = malloc(sizeof(float) * (size_t)(M * nb));
    uint32_t *xT = aligned_alloc(64, sizeof(uint32_t) * (size_t)(K4 * Mp));
    float *sT = aligned_alloc(64, sizeof(float) * (size_t)(nb * Mp));
    float *sumT = aligned_alloc(64, sizeof(float) * (size_t)(nb * Mp));
    int32_t *initT = aligned_alloc(64, sizeof(int32_t) * (size_t)(nb * Mp));
    int failed = !qx || !xs || !xsum || !xT || !sT || !sumT || !initT;
    const xcols X = {xT, sT, sumT, initT};
    const int par = !failed && groups > 1 && M * N * K >= 32768;
#pragma omp parallel if (par)
    {
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; ++r)
                di_q8_quantize_rows(x + r * ldx, ldx, 1, K, qx + r * K, xs + r * nb, xsum + r * nb);
            /* qx as [M][K4] dwords into the panels, in 8 x 8 blocks where 8 rows of x exist (K4 is a
             * multiple of 8), else one by one, zero rows up to Mp */
            const uint32_t *xw = (const uint32_t *)qx;
            const uint32_t flip = fmt == FMT_Q8_0 ? 0x80808080u : 0;
#pragma omp for schedule(static)
            for (int64_t p = 0; p < K4; p += 8)
                for (int64_t r = 0; r < Mp; r += 8) {
                    uint32_t *d = xT + r / PR * K4 * PR + p * PR + r % PR;
                    if (r + 8 <= M) {
                        transpose8((const float *)(xw + r * K4 + p), K4, (float *)d, PR);
                    } else {
                        for (int64_t i = 0; i < 8; ++i)
                            for (int64_t u = 0; u < 8; ++u) d[i * PR + u] = r + u < M ? xw[(r + u) * K4 + p + i] : 0;
                    }
                    if (flip)
                        for (int64_t i = 0; i < 8; ++i)
                            for (int64_t u = 0; u < 8; ++u) d[i * PR + u] ^= flip;
                }
#pragma omp for schedule(static)
            for (int64_t r = 0; r < Mp; ++r)
                for (int64_t b = 0; b < nb; ++b) {
                    const int in = r < M;
                    int s = 0;
                    if (in && fmt == FMT_Q4_0) /* only Q4_0's tiles read initT */
                        for (int i = 0; i < QK; ++i) s += qx[r * K + b * QK + i];
                    const int64_t o = r / PR * nb * PR + b * PR + r % PR;
                    sT[o] = in ? xs[r * nb + b] : 0.f;
                    sumT[o] = in ? xsum[r * nb + b] : 0.f;
                    initT[o] = -8 * s;
                }
        }
        wgroup g = {aligned_alloc(64, (size_t)(WR * K)), malloc(sizeof(float) * (size_t)(WR * nb)),
                    malloc(sizeof(float) * (size_t)(WR * nb)), malloc(sizeof(int32_t) * (size_t)(WR * nb))};
        const int ok = !failed && g.q && g.d && g.m && g.c;
        if (!ok && !failed) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t m0 = 0; m0 < M; m0 += mb) {
            const int64_t m1 = M - m0 < mb ? M : m0 + mb;
#pragma omp for schedule(static)
            for (int64_t gi = 0; gi < groups; ++gi) {
                if (!ok) continue;
                const int64_t n0 = gi * WR;
                const int nj = N - n0 < WR ? (int)(N - n0) : WR;
                unpack_group(fmt, w, rb, n0, nj, K, &g);
                prefetch_next_group(w, rb, n0, N, WR);
                for (int64_t r = m0; r < m1; r += PR) {
                    const int mr = m1 - r < PR ? (int)(m1 - r) : PR;
                    group_fmt(fmt, &g, nj, K, &X, r, mr, y + r * ldy + n0, ldy);
                }
            }
        }
        free(g.q);
        free(g.d);
        free(g.m);
        free(g.c);
    }
    free(qx);
    free(xs);
    free(xsum);
    free(xT);
    free(sT);
    free(sumT);
    free(initT);
    return failed;
}
#endif

/* which kernel di_qgemm_outer_i8 runs for format fmt on this CPU (the level cap included): 0 none (it
 * refuses: level 0, or a k-quant), 1 the AVX2 one (qgemm_i8_outer_avx2.c, vpmaddubsw), 2 that with
 * AVX-VNNI's vpdpbusd, 3 the AVX512_VNNI one above */
int di_qgemm_outer_i8_ready(int fmt) {
    if (fmt != FMT_Q4_0 && fmt != FMT_Q4_1 && fmt != FMT_Q8_0) return 0;
    const int level = di_q_cpu_level();
#if defined(DI_HAVE_VNNI) && DI_VNNI_LEVEL == 2
    if (level >= 2 && di_cpu_vnni_at(2)) return 3;
#endif
    if (level < 1) return 0;
#if defined(DI_HAVE_VNNI) && DI_VNNI_LEVEL == 1
    if (di_cpu_vnni_at(level)) return 2;
#endif
    return 1;
}

/* y [M, N] (rows ldy apart) = x [M, K] (rows ldx apart) @ W.T in the int8 mode, W as rows of blocks
 * (row_bytes apart): the int8 row kernel's bits; 1 when refused (not di_qgemm_outer_i8_ready, K not
 * whole blocks, no memory) */
int di_qgemm_outer_i8(const float *x, int64_t ldx, int64_t M, const uint8_t *w, int64_t row_bytes, int fmt,
                      int64_t N, int64_t K, float *y, int64_t ldy) {
    const int kind = di_qgemm_outer_i8_ready(fmt);
    if (K % QK || K <= 0 || !kind) return 1;
#if defined(DI_HAVE_VNNI) && DI_VNNI_LEVEL == 2
    if (kind == 3) return outer_i8(x, ldx, M, w, row_bytes, fmt, N, K, y, ldy);
#endif
    return di_qi8_outer_avx2(x, ldx, M, w, row_bytes, fmt, N, K, y, ldy, kind == 2);
}
