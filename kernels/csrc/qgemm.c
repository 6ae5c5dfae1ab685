/* y = x @ W.T in fp32 for W kept as GGUF stores it: blocks of 32 values along K (ggml's Q4_0,
 * Q4_1, Q8_0), each block dequantised in registers, never written out as fp32. This file: the
 * driver (di_qgemm, threads over chunks of weight rows), the exact mode's row kernels, the
 * dequantisers; the int8 mode's kernel and activation quantiser are in qgemm_i8.c.
 *
 * Block layouts (ggml): Q4_0 {fp16 d; u8 qs[16]} 18 bytes, w = (q - 8) d; Q4_1 {fp16 d, m;
 * u8 qs[16]} 20 bytes, w = q d + m; Q8_0 {fp16 d; i8 qs[32]} 34 bytes, w = q d. In the 4-bit
 * formats byte j holds element j (low nibble) and element j + 16 (high nibble).
 *
 * Two arithmetic modes, both with one fixed reduction order per output element (a row's result
 * never depends on M or on the other rows: batch-invariant for every M):
 *  - exact (DI_Q_EXACT): each block's 32 weights dequantised to fp32 in registers and multiplied
 *    into fp32 activations; equals dequantise-then-fp32 up to the summation order.
 *  - int8 (DI_Q_INT8): the activations quantised per 32-block to int8 (scale max|x| / 127, one per
 *    block, by di_q8_quantize_rows), exact integer dot products per block (AVX2 maddubs/madd, or VNNI),
 *    scaled and summed in fp32, as llama.cpp does (qgemm_i8.c).
 * Instruction set chosen at run time from the CPU level in force (cpu_level.h, set by
 * deepinfer_kernels.cpu): AVX2 + FMA + F16C from level 1, else portable scalar C; `level` 0 forces the
 * scalar code (tests). At level 2 (AVX-512) the exact 32-element row kernels run in zmm with the
 * AVX2 code's bits (below), and the int8 dot uses VNNI (qgemm_avx2.h); di_q_set_level_cap(1) forces
 * the AVX2 code (tests, side-by-side measurements).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qgemm.h"
#include "qgemm_avx2.h"

#define MR 4 /* rows of x per tile: each block is unpacked once for up to 4 rows */
#define WIDE_NC 16 /* weight rows per chunk of the driver (a thread's unit of work) */
/* software prefetch distance at one row of x (bytes ahead in each weight row's stream): the 30 MB Q8_0
 * lm_head (49152 x 576) took 1.17x less time with it, Q4_1 down (576 x 1536) 1.24x, gate|up 1.04x
 * (1 thread, A/B in one process, paired median of 12, loaded host); 1 KB ahead was no better */
#define PF 4096

static int block_bytes(int fmt) {
    switch (fmt) {
    case FMT_Q4_0: return 18;
    case FMT_Q4_1: return 20;
    case FMT_Q8_0: return 34;
    case FMT_Q4_K: return 144; /* per 256 elements (qgemm_k.c) */
    case FMT_Q6_K: return 210;
    default: return 0;
    }
}

static int is_kquant(int fmt) { return fmt == FMT_Q4_K || fmt == FMT_Q6_K; }

/* IEEE half -> float without F16C (the scalar path). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal half: normalise */
            int e = -1;
            do { ++e; man <<= 1; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* one block's 32 weights as fp32 (scalar; also the reference the other paths are tested against) */
static inline void dequant_block(int fmt, const uint8_t *b, float *out) {
    const float d = half_to_float(rd16(b));
    if (fmt == FMT_Q8_0) {
        const int8_t *q = (const int8_t *)(b + 2);
        for (int j = 0; j < QK; ++j) out[j] = (float)q[j] * d;
        return;
    }
    const float m = fmt == FMT_Q4_1 ? half_to_float(rd16(b + 2)) : 0.f;
    const uint8_t *qs = b + (fmt == FMT_Q4_1 ? 4 : 2);
    const int off = fmt == FMT_Q4_0 ? 8 : 0;
    for (int j = 0; j < 16; ++j) {
        const float lo = (float)((qs[j] & 0xf) - off) * d, hi = (float)((qs[j] >> 4) - off) * d;
        out[j] = lo + m;
        out[j + 16] = hi + m;
    }
}

int di_q_block_bytes(int fmt) { return block_bytes(fmt); }

int di_q_block_elems(int fmt) { return is_kquant(fmt) ? QK_K : block_bytes(fmt) ? QK : 0; }

float di_q_half(uint16_t h) { return half_to_float(h); }

/* the highest level the kernels may use (di_q_set_level_cap: tests and side-by-side measurements run
 * the AVX2 code on an AVX-512 host) */
static volatile int level_cap = 3;

/* 0: scalar; 1: AVX2 + FMA + F16C; 2: that and AVX-512 F/BW/DQ/VL (the outer-product kernel's wide
 * tile, qgemm_outer.c); 3: that and AVX512_BF16 (the bf16 mode's kernel, qgemm_bf16.c): the library's
 * level (cpu_level.h), capped by di_q_set_level_cap */
int di_q_cpu_level(void) {
    const int level = di_cpu_level();
    return level < level_cap ? level : level_cap;
}

void di_q_set_level_cap(int cap) { level_cap = cap < 0 ? 0 : cap; }

static void dequant_row_avx2(int fmt, const uint8_t *row, int64_t K, float *out);
static void dequant_row_512(int fmt, const uint8_t *row, int64_t K, float *out);

/* avx2: the level to use, 0 scalar, 1 AVX2, 2 AVX-512 (the 32-element formats; the same values) */
void di_q_dequant_row(int fmt, int avx2, const uint8_t *row, int64_t K, float *out) {
    if (is_kquant(fmt)) {
        di_qk_dequant_row(fmt, avx2, row, K, out);
    } else if (avx2 >= 2) {
        dequant_row_512(fmt, row, K, out);
    } else if (avx2) {
        dequant_row_avx2(fmt, row, K, out);
    } else {
        const int bb = block_bytes(fmt);
        for (int64_t b = 0; b < K / QK; ++b) dequant_block(fmt, row + b * bb, out + b * QK);
    }
}

/* rows ids[0..n) of W [*, K] dequantised into out [n, K] (embedding lookups) */
int di_q_dequant_rows(const uint8_t *w, int64_t row_bytes, int fmt, int64_t K, const int64_t *ids, int64_t n,
                      float *out) {
    const int be = di_q_block_elems(fmt);
    if (!be || K % be) return 1;
    const int avx2 = di_q_cpu_level() >= 1;
#pragma omp parallel for schedule(static) if (n * K >= 65536)
    for (int64_t i = 0; i < n; ++i) di_q_dequant_row(fmt, avx2, w + ids[i] * row_bytes, K, out + i * K);
    return 0;
}

/* ---- scalar kernels ------------------------------------------------------------------------------ */
static void rows_exact_scalar(int fmt, const uint8_t *wrow, int64_t nb, const float *x, int64_t ldx, int mr,
                              float *y, int64_t ldy) {
    const int bb = block_bytes(fmt);
    float acc[MR][8] = {{0}};
    float wd[QK];
    for (int64_t b = 0; b < nb; ++b) {
        dequant_block(fmt, wrow + b * bb, wd);
        for (int r = 0; r < mr; ++r) {
            const float *xb = x + r * ldx + b * QK;
            for (int j = 0; j < QK; ++j) acc[r][j & 7] += wd[j] * xb[j];
        }
    }
    for (int r = 0; r < mr; ++r) {
        float *a = acc[r];
        y[r * ldy] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    }
}

/* ---- AVX2 kernels -------------------------------------------------------------------------------- */

AVX2 static inline float f16(const uint8_t *p) { return _cvtsh_ss(rd16(p)); }

/* one block as four fp32 vectors (elements 0-7, 8-15, 16-23, 24-31) */
AVX2 static inline void dequant_block_avx2(int fmt, const uint8_t *b, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(f16(b));
    if (fmt == FMT_Q8_0) {
        for (int g = 0; g < 4; ++g)
            w[g] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * g)))), d);
        return;
    }
    const uint8_t *qs = b + (fmt == FMT_Q4_1 ? 4 : 2);
    /* bytes 0-7 and 8-15 widened to 32-bit lanes straight from memory; each lane's low nibble is
     * element j, its high nibble element j + 16: 2 widenings + 2 masks + 2 shifts instead of 4
     * widenings, 2 byte shifts and the 128-bit nibble split (at one row of x a cache-resident
     * projection is bound by these per-block instructions: Q4_1 576 x 1536 1.15-1.36x from this alone) */
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8)));
    const __m256i mask = _mm256_set1_epi32(0xf);
    const __m256 m = fmt == FMT_Q4_1 ? _mm256_set1_ps(f16(b + 2)) : _mm256_set1_ps(-8.f * f16(b));
    /* Q4_0: (q - 8) d = q d + (-8 d), exact in fp32 (d is a half, q and 8 small integers) */
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, mask)), d, m);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, mask)), d, m);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), d, m);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), d, m);
}

AVX2 static void dequant_row_avx2(int fmt, const uint8_t *row, int64_t K, float *out) {
    const int bb = block_bytes(fmt);
    for (int64_t b = 0; b < K / QK; ++b) {
        __m256 w[4];
        dequant_block_avx2(fmt, row + b * bb, w);
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + b * QK + 8 * i, w[i]);
    }
}

AVX2 static inline __attribute__((always_inline)) void rows_exact_avx2(int fmt, const uint8_t *wrow, int64_t nb, const float *x, int64_t ldx, int mr,
                                 float *y, int64_t ldy) {
    const int bb = block_bytes(fmt);
    __m256 a0[MR], a1[MR];
    for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m256 w[4];
        /* one row of x: the weights stream from memory once; PF bytes ahead, see below */
        if (mr == 1) _mm_prefetch((const char *)(wrow + b * bb + PF), _MM_HINT_T0);
        dequant_block_avx2(fmt, wrow + b * bb, w);
        fma32_rows(w, x + b * QK, ldx, mr, a0, a1);
    }
    for (int r = 0; r < mr; ++r) y[r * ldy] = hsum8(_mm256_add_ps(a0[r], a1[r]));
}

/* the row count as a compile-time constant, so the tile's accumulators live in registers (with a
 * run-time count GCC kept them on the stack: 3-4x slower at 32+ rows). Same arithmetic per row
 * whatever the tile size, so still batch-invariant. The format is made constant the same way. */
#define TILE_CASES(CALL) \
    switch (mr) { case 4: CALL(4); break; case 3: CALL(3); break; case 2: CALL(2); break; default: CALL(1); break; }

AVX2 static void exact_avx2_fmt(int fmt, const uint8_t *wrow, int64_t nb, const float *x, int64_t ldx, int mr,
                                float *y, int64_t ldy) {
#define EX(R) rows_exact_avx2(fmt, wrow, nb, x, ldx, R, y, ldy)
    TILE_CASES(EX)
#undef EX
}

AVX2 static void exact_avx2_tile(int fmt, const uint8_t *wrow, int64_t nb, const float *x, int64_t ldx, int mr,
                                 float *y, int64_t ldy) {
    exact_avx2_fmt(fmt, wrow, nb, x, ldx, mr, y, ldy);
}

/* ---- one row of x (batch-1 decode): NR weight rows side by side ---------------------------------
 * At one row of x the exact tile above has two accumulator chains, two dependent FMAs each per
 * block. NR weight rows side by side give NR times the independent chains; each output's arithmetic
 * is unchanged (the same dequantised values, the same chains in the same order, the same final sum):
 * bit-identical to the tile at mr = 1 (and so to the panel kernel). Q4_1 3072 x 576 at one row: 1.5x
 * with this and the cheaper nibble widening together (A/B, 1 thread). Q8_0 keeps one row at a time:
 * side by side (NR 2 or 4) took 2x longer on the 49152 x 576 lm_head. */
#define NR 4

AVX2 static inline __attribute__((always_inline)) void nrows_exact_avx2(const int fmt, const uint8_t *w,
                                                                        int64_t row_bytes, int64_t nb,
                                                                        const float *x, float *y) {
    const int bb = block_bytes(fmt);
    __m256 a0[NR], a1[NR];
    for (int i = 0; i < NR; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const float *xb = x + b * QK;
        for (int i = 0; i < NR; ++i) _mm_prefetch((const char *)(w + i * row_bytes + b * bb + PF), _MM_HINT_T0);
        for (int i = 0; i < NR; ++i) {
            __m256 v[4];
            dequant_block_avx2(fmt, w + i * row_bytes + b * bb, v);
            /* fma32_rows' order for one row */
            a0[i] = _mm256_fmadd_ps(v[0], _mm256_loadu_ps(xb), a0[i]);
            a1[i] = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xb + 8), a1[i]);
            a0[i] = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xb + 16), a0[i]);
            a1[i] = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), a1[i]);
        }
    }
    for (int i = 0; i < NR; ++i) y[i] = hsum8(_mm256_add_ps(a0[i], a1[i]));
}

/* NR outputs y[0..NR) of one row of x against weight rows w, w + row_bytes, ... (Q4_0 / Q4_1) */
AVX2 static void nrows_exact(int fmt, const uint8_t *w, int64_t row_bytes, int64_t nb, const float *x, float *y) {
    if (fmt == FMT_Q4_0) nrows_exact_avx2(FMT_Q4_0, w, row_bytes, nb, x, y);
    else nrows_exact_avx2(FMT_Q4_1, w, row_bytes, nb, x, y);
}

/* ---- AVX-512 (level 2): the same arithmetic in half the instructions --------------------------------
 * A zmm accumulator holds the AVX2 tile's two chains side by side (lanes 0-7 = a0, 8-15 = a1), and a
 * block's weights are two zmm vectors (elements 0-15, 16-31) dequantised by the same operations per
 * element. acc += w[0..16) * x[0..16) then w[16..32) * x[16..32) adds elements j then j + 16 into lane j
 * of a0 and j + 8, j + 24 into a1: the AVX2 order exactly, and the final sum is hsum8(a0 + a1). So the
 * bits are those of the AVX2 kernels (and of the panel kernel, the batch-invariant mode's many-row
 * path). */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))

AVX512 static inline void dequant_block_512(const int fmt, const uint8_t *b, __m512 w[2]) {
    const __m512 d = _mm512_set1_ps(f16(b));
    if (fmt == FMT_Q8_0) {
        w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)))), d);
        w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)))), d);
        return;
    }
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + (fmt == FMT_Q4_1 ? 4 : 2))));
    const __m512 m = fmt == FMT_Q4_1 ? _mm512_set1_ps(f16(b + 2)) : _mm512_set1_ps(-8.f * f16(b));
    w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0xf))), d, m);
    w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d, m);
}

AVX512 static void dequant_row_512(int fmt, const uint8_t *row, int64_t K, float *out) {
    const int bb = block_bytes(fmt);
    for (int64_t b = 0; b < K / QK; ++b) {
        __m512 w[2];
        dequant_block_512(fmt, row + b * bb, w);
        _mm512_storeu_ps(out + b * QK, w[0]);
        _mm512_storeu_ps(out + b * QK + 16, w[1]);
    }
}

AVX512 static inline float hsum_pair(__m512 a) {
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)));
}

/* rows_exact_avx2 for up to MR rows of x */
AVX512 static inline __attribute__((always_inline)) void rows_exact_512(const int fmt, const uint8_t *wrow,
                                                                       int64_t nb, const float *x, int64_t ldx,
                                                                       const int mr, float *y, int64_t ldy) {
    const int bb = block_bytes(fmt);
    __m512 a[MR];
    for (int r = 0; r < MR; ++r) a[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m512 w[2];
        if (mr == 1) _mm_prefetch((const char *)(wrow + b * bb + PF), _MM_HINT_T0);
        dequant_block_512(fmt, wrow + b * bb, w);
        for (int r = 0; r < mr; ++r) {
            const float *xb = x + r * ldx + b * QK;
            a[r] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xb), a[r]);
            a[r] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xb + 16), a[r]);
        }
    }
    for (int r = 0; r < mr; ++r) y[r * ldy] = hsum_pair(a[r]);
}

AVX512 static void exact_512_tile(int fmt, const uint8_t *wrow, int64_t nb, const float *x, int64_t ldx, int mr,
                                  float *y, int64_t ldy) {
#define EX(R) (fmt == FMT_Q4_0 ? rows_exact_512(FMT_Q4_0, wrow, nb, x, ldx, R, y, ldy) \
             : fmt == FMT_Q4_1 ? rows_exact_512(FMT_Q4_1, wrow, nb, x, ldx, R, y, ldy) \
                               : rows_exact_512(FMT_Q8_0, wrow, nb, x, ldx, R, y, ldy))
    TILE_CASES(EX)
#undef EX
}

/* nrows_exact_avx2 in zmm: NR weight rows against one row of x */
AVX512 static inline __attribute__((always_inline)) void nrows_exact_512(const int fmt, const uint8_t *w,
                                                                        int64_t row_bytes, int64_t nb,
                                                                        const float *x, float *y) {
    const int bb = block_bytes(fmt);
    __m512 a[NR];
    for (int i = 0; i < NR; ++i) a[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const float *xb = x + b * QK;
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        for (int i = 0; i < NR; ++i) _mm_prefetch((const char *)(w + i * row_bytes + b * bb + PF), _MM_HINT_T0);
        for (int i = 0; i < NR; ++i) {
            __m512 v[2];
            dequant_block_512(fmt, w + i * row_bytes + b * bb, v);
            a[i] = _mm512_fmadd_ps(v[0], x0, a[i]);
            a[i] = _mm512_fmadd_ps(v[1], x1, a[i]);
        }
    }
    for (int i = 0; i < NR; ++i) y[i] = hsum_pair(a[i]);
}

AVX512 static void nrows_exact512(int fmt, const uint8_t *w, int64_t row_bytes, int64_t nb, const float *x, float *y) {
    if (fmt == FMT_Q4_0) nrows_exact_512(FMT_Q4_0, w, row_bytes, nb, x, y);
    else nrows_exact_512(FMT_Q4_1, w, row_bytes, nb, x, y);
}

/* ---- AVX-512, two or more rows of x (a short prompt's prefill, a small batch's decode) -------------
 * The tile above unpacks a block for MR = 4 rows of x, the AVX2 register budget: at 12 rows each block
 * was dequantised three times and every FMA loaded its x, and the time equalled the outer-product
 * kernel's (whose 16-row vectors of x are a quarter empty there). Here the rows are split into even
 * tiles of at most WIDE_MR, and up to WIDE_ACC / mr weight rows (at most WIDE_NW) run side by side, so
 * each x load feeds two or three weight rows and each block is dequantised once per tile. Measured
 * on the 2-core Zen 5 host (2 threads, SmolLM2's Q4_1 qkv + o + gate_up + down, summed over 30 layers,
 * ms, against the MR = 4 tile): at 12 rows one weight row x 12 rows 9.6 vs 12.3; two x 6 (two tiles)
 * 9.9, three x 6 9.1; two x 12 (24 accumulators: GCC spilled) 19.7; at 8 rows one x 8 6.4, two x 8
 * 6.5, three x 8 7.9 (spilled) vs 8.6. Each output is still one accumulator in rows_exact_512's order
 * (block by block, elements 0-15 then 16-31 into the same lanes, hsum_pair at the end): the row
 * kernels' bits whatever the tile, so a row never depends on M (batch-invariant mode included). Where
 * a tile's rows of x outgrow L1 (12 rows of the 576 x 1536 down projection are 74 KB) K is walked in
 * slices of at most XSLICE bytes of x, the accumulators parked between slices (storing a register and
 * loading it back does not change the chain): down at 12 rows 0.081 vs 0.123 ms unsliced. */
#define WIDE_MR 8     /* rows of x per tile */
#define WIDE_NW 3     /* weight rows side by side, at most */
#define WIDE_ACC 18   /* accumulators per tile, at most */
#define XSLICE 32768  /* bytes of x per K slice */

/* acc[i * mr + r] (+)= blocks [b0, b1) of weight row i < nw against x row r < mr */
AVX512 static inline __attribute__((always_inline)) void wide_512(const int fmt, const int nw, const int mr,
                                                                 const uint8_t *w, int64_t row_bytes, int64_t b0,
                                                                 int64_t b1, const float *x, int64_t ldx,
                                                                 __m512 *acc) {
    const int bb = block_bytes(fmt);
    __m512 a[WIDE_NW][WIDE_MR];
    for (int i = 0; i < nw; ++i)
        for (int r = 0; r < mr; ++r) a[i][r] = acc[i * mr + r];
    for (int64_t b = b0; b < b1; ++b) {
        __m512 v[WIDE_NW][2];
        /* the weights stream from memory (a model's layers do not stay in cache): PF bytes ahead in
         * each row's stream, as at one row. A pass over 30 distinct layers' Q4_1 qkv + o + gate_up +
         * down, ms, median of 11, arms alternating, on a host loaded by a test run (so all slow): at
         * 12 rows 74-76 with it vs 124-130 without (MR = 4 tile: 134-148), at 8 rows 39 vs 75 (90);
         * 1 KB ahead no better */
        for (int i = 0; i < nw; ++i) _mm_prefetch((const char *)(w + i * row_bytes + b * bb + PF), _MM_HINT_T0);
        for (int i = 0; i < nw; ++i) dequant_block_512(fmt, w + i * row_bytes + b * bb, v[i]);
        const float *xb = x + b * QK;
        for (int r = 0; r < mr; ++r) {
            const __m512 x0 = _mm512_loadu_ps(xb + r * ldx), x1 = _mm512_loadu_ps(xb + r * ldx + 16);
            for (int i = 0; i < nw; ++i) {
                a[i][r] = _mm512_fmadd_ps(v[i][0], x0, a[i][r]);
                a[i][r] = _mm512_fmadd_ps(v[i][1], x1, a[i][r]);
            }
        }
    }
    for (int i = 0; i < nw; ++i)
        for (int r = 0; r < mr; ++r) acc[i * mr + r] = a[i][r];
}

/* weight rows [n0, n1) (at most WIDE_NC) against x rows 0 .. mr-1 into y[r * ldy + n]; the format and
 * mr are constants where this is inlined (the accumulators then live in registers) */
AVX512 static inline __attribute__((always_inline)) void wide_rows(const int fmt, const int mr, const uint8_t *w,
                                                                  int64_t row_bytes, int64_t n0, int64_t n1,
                                                                  int64_t nb, const float *x, int64_t ldx, float *y,
                                                                  int64_t ldy) {
    const int nw = WIDE_ACC / mr < WIDE_NW ? WIDE_ACC / mr : WIDE_NW;
    const int64_t per = XSLICE / ((int64_t)mr * QK * (int64_t)sizeof(float)); /* blocks per slice, at most */
    const int64_t slices = (nb + per - 1) / per, slice = (nb + slices - 1) / slices;
    __m512 park[WIDE_NC * WIDE_MR]; /* accumulator (n - n0) * mr + r */
    for (int64_t j = 0; j < (n1 - n0) * mr; ++j) park[j] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += slice) {
        const int64_t b1 = nb - b0 < slice ? nb : b0 + slice;
        int64_t n = n0;
        for (; n + nw <= n1; n += nw)
            wide_512(fmt, nw, mr, w + n * row_bytes, row_bytes, b0, b1, x, ldx, park + (n - n0) * mr);
        for (; n < n1; ++n) wide_512(fmt, 1, mr, w + n * row_bytes, row_bytes, b0, b1, x, ldx, park + (n - n0) * mr);
    }
    for (int64_t n = n0; n < n1; ++n)
        for (int r = 0; r < mr; ++r) y[r * ldy + n] = hsum_pair(park[(n - n0) * mr + r]);
}

/* wide_rows for 2 <= mr <= WIDE_MR and a 32-element format */
AVX512 static void wide_tile(int fmt, int mr, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t nb,
                             const float *x, int64_t ldx, float *y, int64_t ldy) {
#define WR_(F, R) wide_rows(F, R, w, row_bytes, n0, n1, nb, x, ldx, y, ldy)
#define WF_(R) (fmt == FMT_Q4_0 ? WR_(FMT_Q4_0, R) : fmt == FMT_Q4_1 ? WR_(FMT_Q4_1, R) : WR_(FMT_Q8_0, R))
    switch (mr) {
    case 8: WF_(8); break; case 7: WF_(7); break; case 6: WF_(6); break; case 5: WF_(5); break;
    case 4: WF_(4); break; case 3: WF_(3); break; default: WF_(2); break;
    }
#undef WF_
#undef WR_
}

/* y [M, N] (rows ldy apart) = x [M, K] @ W.T for W [N, K] in `fmt` blocks, rows row_bytes apart.
 * mode DI_Q_EXACT reads x (fp32, rows ldx apart); DI_Q_INT8 reads qx/xs/xsum from
 * di_q8_quantize_rows. level: 1 = AVX2 where the CPU has it, 0 = scalar. Threads split N in chunks. */
int di_qgemm(int mode, int level, const float *x, int64_t ldx, const int8_t *qx, const float *xs, const float *xsum,
             int64_t M, const uint8_t *w, int64_t row_bytes, int fmt, int64_t N, int64_t K, float *y, int64_t ldy) {
    const int be = di_q_block_elems(fmt);
    if (!be || K % be) return 1;
    const int cpu = di_q_cpu_level();
    const int avx2 = level >= 1 && cpu >= 1, avx512 = level >= 1 && cpu >= 2;
    const int64_t nb = K / QK;
    /* chunks of NC weight rows: a chunk's blocks and a tile's activations both stay in L1 while
     * every tile of x sweeps the chunk (n innermost was 2x slower at 128 rows: x re-read from L2) */
    enum { NC = WIDE_NC };
    const int64_t chunks = (N + NC - 1) / NC;
#pragma omp parallel for schedule(static) if (chunks > 1 && M * N * K >= 32768)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t n1 = (c + 1) * NC < N ? (c + 1) * NC : N;
        if (mode == DI_Q_INT8 && be == QK) { /* qgemm_i8.c */
            di_qi8_chunk(fmt, avx2 ? cpu : 0, w, row_bytes, c * NC, n1, qx, xs, xsum, M, K, y, ldy);
            continue;
        }
        int64_t r0 = 0;
        if (avx512 && be == QK && M >= 2) { /* even tiles of 2 .. WIDE_MR rows (wide_tile) */
            const int64_t tiles = (M + WIDE_MR - 1) / WIDE_MR, tm = (M + tiles - 1) / tiles;
            for (; r0 < M; r0 += tm) {
                const int mr = M - r0 < tm ? (int)(M - r0) : (int)tm;
                if (mr < 2) break; /* a last single row: the one-row code below */
                wide_tile(fmt, mr, w, row_bytes, c * NC, n1, nb, x + r0 * ldx, ldx, y + r0 * ldy, ldy);
            }
        }
        for (; r0 < M; r0 += MR) {
            const int mr = M - r0 < MR ? (int)(M - r0) : MR;
            int64_t n = c * NC;
            /* one row of x, 4-bit formats: NR weight rows at a time, then the rest one by one. Not Q8_0:
             * there NR = 4 took 2x longer on the 49152 x 576 lm_head (same time at 3072 x 576) */
            if (mr == 1 && avx2 && (fmt == FMT_Q4_0 || fmt == FMT_Q4_1))
                for (; n + NR <= n1; n += NR) {
                    if (avx512) nrows_exact512(fmt, w + n * row_bytes, row_bytes, nb, x + r0 * ldx, y + r0 * ldy + n);
                    else nrows_exact(fmt, w + n * row_bytes, row_bytes, nb, x + r0 * ldx, y + r0 * ldy + n);
                }
            for (; n < n1; ++n) {
                const uint8_t *wrow = w + n * row_bytes;
                float *yr = y + r0 * ldy + n;
                if (be == QK_K) {
                    di_qk_tile(mode, avx2 ? cpu : 0, fmt, wrow, K, x ? x + r0 * ldx : 0, ldx, qx ? qx + r0 * K : 0,
                               xs ? xs + r0 * nb : 0, xsum ? xsum + r0 * nb : 0, mr, yr, ldy);
                } else if (avx512) {
                    exact_512_tile(fmt, wrow, nb, x + r0 * ldx, ldx, mr, yr, ldy);
                } else if (avx2) {
                    exact_avx2_tile(fmt, wrow, nb, x + r0 * ldx, ldx, mr, yr, ldy);
                } else {
                    rows_exact_scalar(fmt, wrow, nb, x + r0 * ldx, ldx, mr, yr, ldy);
                }
            }
        }
    }
    return 0;
}

/* di_qgemm in the exact mode for a weight whose arguments were bound once, wargs = {W's address,
 * row_bytes, fmt, N, K}, x [M, K] and y [M, N] dense (quant.RowKernel, the decode path): 4 arguments
 * to convert per call instead of 15 (ctypes' conversion cost more than the kernel on the small
 * projections at one row) */
int di_qgemm_exact_bound(const int64_t *wargs, const float *x, int64_t M, float *y) {
    return di_qgemm(DI_Q_EXACT, 1, x, wargs[4], 0, 0, 0, M, (const uint8_t *)(intptr_t)wargs[0], wargs[1], (int)wargs[2],
                    wargs[3], wargs[4], y, wargs[3]);
}

/* the same for the int8 mode: x quantised here (di_q8_quantize_rows into a scratch buffer), then
 * di_qgemm; 1 when refused (format, K) or out of memory */
int di_qgemm_int8_bound(const int64_t *wargs, const float *x, int64_t M, float *y) {
    const int64_t K = wargs[4], nb = K / QK;
    if (K % QK) return 1;
    float *xs = malloc((size_t)(2 * M * nb) * sizeof(float) + (size_t)(M * K));
    if (!xs) return 1;
    float *xsum = xs + M * nb;
    int8_t *qx = (int8_t *)(xsum + M * nb);
    int rc = di_q8_quantize_rows(x, K, M, K, qx, xs, xsum);
    if (!rc)
        rc = di_qgemm(DI_Q_INT8, 1, 0, 0, qx, xs, xsum, M, (const uint8_t *)(intptr_t)wargs[0], wargs[1], (int)wargs[2],
                      wargs[3], K, y, wargs[3]);
    free(xs);
    return rc;
}
