/* The int8 mode's outer-product kernel in AVX2 (vpmaddubsw / vpmaddwd; AVX-VNNI's ymm vpdpbusd where
 * the build has it): what qgemm_i8_outer.c does with AVX512_VNNI, for the CPUs without it (Zen 3, an
 * AVX-512 CPU without VNNI, or the avx512 build capped to level 1). Same arithmetic as the int8 row
 * kernel (qgemm_i8.c), bit for bit. AVX2 instructions only (it runs in the avx2 build).
 *
 * Layout. x is quantised by the row kernel's own quantiser (di_q8_quantize_rows: the same qx, scales s
 * and s * sum q) and laid out once per call in panels of TR rows: per row, dwords of 4 consecutive k
 * (Q8_0 without VNNI: 2 k as i16), the TR rows' dwords side by side ([dwords][TR]), so a tile's
 * broadcasts of x are one sequential stream. WR weight rows at a time are unpacked and transposed in
 * registers into the same dwords, 8 weight rows to a vector ([dwords][WR]), with their block scales
 * [nb][WR]. The register tile is TR rows of x (one broadcast dword each) by WV vectors of 8 weight
 * rows: lanes are weight rows, so its outputs are 8 consecutive columns of a row of y, stored as they
 * are (the AVX-512 kernel's lanes are rows of x, and it transposes its outputs).
 *
 * Integers. Nothing saturates or overflows:
 *   Q4_0 / Q4_1: vpmaddubsw of the quants 0..15 (unsigned) by x (|q| <= 127, di_q8_quantize_rows):
 *     |i16 pair| <= 2 * 15 * 127 = 3810, so the pairs of a whole block (8 steps of 4 k) are summed in
 *     i16 (|sum| <= 8 * 3810 = 30480 < 32767) and widened once per block (vpmaddwd against ones): one
 *     vpmaddubsw + one vpaddw per 32 products. Q4_0's -8 is the block's -8 * sum q, added to the int32
 *     dot (as the row kernel subtracts 8 sum q).
 *   Q8_0: both operands signed. vpmaddwd of the quants and x as i16 (|pair| <= 2 * 128 * 127), int32
 *     adds: two vpmaddwd + two vpaddd per 32 products. The row kernel's vpsignb trick (|w| by x with
 *     w's sign, qgemm_avx2.h) needs a sign, a vpmaddubsw and a vpmaddwd per 32 (its i16 pairs reach
 *     32512: no two add in i16), all three on the two pipes that multiply on Zen 4 (FMAs too): one
 *     block of the 4 x 2 tile took 105 cycles that way, 85 in i16 (Zen 4, the tile alone on L1-resident
 *     panels, avx2 build; per block, 2048 products).
 *   AVX-VNNI: vpdpbusd sums into int32 directly; for Q8_0 x goes in unsigned as q + 128 (0x80 flipped
 *     once in the panel) against the signed quants, the lanes starting at -128 * sum w of the block,
 *     as qgemm_i8_outer.c does.
 * Every dot is the exact integer sum_j w_j q_j of the block (|dot| <= 32 * 128 * 127 < 2^24: exact
 * in fp32 too), whatever the order of the integer adds.
 *
 * Order: per output, exactly the row kernel's: per block b in order
 *     acc = fma((float)dot_b, d_b * s_b, acc),     macc = fma(m_b, xsum_b, macc)   (Q4_1)
 * and y = acc + macc (macc 0 but for Q4_1), so the result is the row kernel's bit for bit whatever M
 * or the tile a row falls in (tests/kernels/test_quant_i8_outer.py), and it may run in the
 * batch-invariant mode.
 *
 * Tile. 4 x 2 (4 rows of x by 16 weight rows): 8 integer accumulators, 2 weight vectors, a broadcast
 * and a product in the 16 ymm registers; the fp32 accumulators wait in L1 between blocks. On Zen 4
 * vpmaddubsw, vpmaddwd and the FMAs share two pipes: a Q4_1 block takes 64 vpmaddubsw + 8 vpmaddwd +
 * 8 multiplies (d * s) + 16 FMAs on them, measured 53 cycles (38 products a cycle, against 16 for the
 * fp32 FMA kernel at its peak).
 */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "qgemm.h"
#include "qgemm_avx2.h"

#define WV 2        /* vectors of 8 weight rows per register tile */
#define WR (8 * WV) /* weight rows per group (unpacked once per pass, swept by every panel of x) */
#define TR 4        /* rows of x per register tile and panel */
/* x panel bytes per pass over the weights, so that a pass's panels stay in L2 while every group sweeps
 * them (an AVX2 Zen 3 has 512 KB of L2 per core) */
#define XB_BYTES (256 << 10)

static inline int32_t rd32(const uint8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }

static int fmt_bytes(int fmt) { return fmt == FMT_Q4_0 ? 18 : fmt == FMT_Q4_1 ? 20 : 34; }

/* x's side, one thread's: panel P holds rows P * TR .. P * TR + TR - 1 of a pass (rows past its end
 * zero); dw: dwords of a row, K / 4 (K / 2 for Q8_0 without VNNI) */
typedef struct {
    uint32_t *q;   /* [rows / TR][dw][TR]: 4 activations of a row (Q8_0: 2 as i16, or with AVX-VNNI each + 128) */
    float *s;      /* [rows / TR][nb][TR]: block scales */
    float *sum;    /* [rows / TR][nb][TR]: s * sum q (Q4_1's min term) */
    int32_t *init; /* [rows / TR][nb][TR]: -8 * sum q (Q4_0's offset) */
} xpanels;

/* WR weight rows: quants in element order, dwords of 4 k as bytes (Q8_0 without VNNI: 2 k as i16) of
 * the rows side by side; per-block d, m (Q4_1) and -128 * sum w (Q8_0 with AVX-VNNI) */
typedef struct {
    uint32_t *q;  /* [dw][WR] */
    float *d, *m; /* [nb][WR] */
    int32_t *c;   /* [nb][WR] */
} wpanel;

/* 8 x 8 transpose of dwords in registers: r[i] lane j -> r[j] lane i */
AVX2 static inline void transpose8_regs(__m256i r[8]) {
    __m256 a[8], t[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_castsi256_ps(r[i]);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(a[i], a[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(a[i], a[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        a[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        a[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        a[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        a[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm256_castps_si256(_mm256_permute2f128_ps(a[i], a[i + 4], 0x20));
        r[i + 4] = _mm256_castps_si256(_mm256_permute2f128_ps(a[i], a[i + 4], 0x31));
    }
}

/* dwords per block of a row in the panels: 4 k as bytes, or for Q8_0 without VNNI 2 k as i16 */
static inline int block_steps(int fmt, int vnni) { return fmt == FMT_Q8_0 && !vnni ? 16 : 8; }

/* rows n0 .. n0 + nj of W into g (rows nj .. WR zero: their outputs are not stored), 8 rows and one
 * block at a time, the rows' bytes transposed in registers into one vector of 8 dwords per step */
AVX2 static void unpack_group(int fmt, const uint8_t *w, int64_t rb, int64_t n0, int nj, int64_t K, int vnni,
                              const wpanel *g) {
    const int64_t nb = K / QK;
    const int bb = fmt_bytes(fmt), steps = block_steps(fmt, vnni);
    static const uint8_t zero[64]; /* the block of a row past nj */
    for (int v = 0; v < WV; ++v) {
        const uint8_t *row[8];
        int64_t bs[8]; /* a row's block stride: 0 for the zero block */
        for (int i = 0; i < 8; ++i) {
            const int in = 8 * v + i < nj;
            row[i] = in ? w + (n0 + 8 * v + i) * rb : zero;
            bs[i] = in ? bb : 0;
        }
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk[8];
            for (int i = 0; i < 8; ++i) blk[i] = row[i] + b * bs[i];
            uint32_t *q = g->q + steps * b * WR + 8 * v;
            /* the first 4 bytes of each block, (d, m) for Q4_1, as the row kernel reads them: the f16
             * values gathered through an array took a fifth of the LM head's call at 32 rows (perf: a
             * failed store forwarding per conversion) */
            const __m256 f0 = _mm256_cvtph_ps(_mm_setr_epi32(rd32(blk[0]), rd32(blk[1]), rd32(blk[2]), rd32(blk[3])));
            const __m256 f1 = _mm256_cvtph_ps(_mm_setr_epi32(rd32(blk[4]), rd32(blk[5]), rd32(blk[6]), rd32(blk[7])));
            const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7); /* (0 1 4 5 | 2 3 6 7) -> 0 .. 7 */
            _mm256_storeu_ps(g->d + b * WR + 8 * v, _mm256_permutevar8x32_ps(_mm256_shuffle_ps(f0, f1, 0x88), order));
            const __m256 m = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(f0, f1, 0xdd), order);
            _mm256_storeu_ps(g->m + b * WR + 8 * v, fmt == FMT_Q4_1 ? m : _mm256_setzero_ps());
            __m256i c = _mm256_setzero_si256();
            if (fmt == FMT_Q8_0 && !vnni) { /* the 32 quants as i16: two vectors of 8 dwords a row */
                __m256i lo[8], hi[8];
                for (int i = 0; i < 8; ++i) {
                    const __m256i r = _mm256_loadu_si256((const __m256i *)(blk[i] + 2));
                    lo[i] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(r));
                    hi[i] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(r, 1));
                }
                transpose8_regs(lo); /* lo[s]: k 2s, 2s + 1 of the 8 rows */
                transpose8_regs(hi); /* hi[s]: k 16 + 2s, 17 + 2s */
                for (int s = 0; s < 8; ++s) {
                    _mm256_storeu_si256((__m256i *)(q + s * WR), lo[s]);
                    _mm256_storeu_si256((__m256i *)(q + (s + 8) * WR), hi[s]);
                }
            } else if (fmt == FMT_Q8_0) { /* AVX-VNNI: the signed bytes, and -128 * sum w */
                __m256i r[8];
                for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_si256((const __m256i *)(blk[i] + 2));
                transpose8_regs(r); /* r[s]: k 4s .. 4s + 3 of the 8 rows */
                for (int s = 0; s < 8; ++s) {
                    _mm256_storeu_si256((__m256i *)(q + s * WR), r[s]);
                    c = _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), r[s]),
                                                              _mm256_set1_epi16(1)));
                }
                c = _mm256_mullo_epi32(c, _mm256_set1_epi32(-128));
            } else {
                /* the 16 quant bytes of rows i and i + 4 in one vector, then a 4 x 4 dword transpose per
                 * 128-bit half: u[s] holds bytes 4s .. 4s + 3 of the 8 rows (rows 0-3 | 4-7), whose low
                 * nibbles are k 4s .. 4s + 3 and high nibbles k 16 + 4s .. */
                const int off = fmt == FMT_Q4_1 ? 4 : 2;
                __m128i h[8];
                for (int i = 0; i < 8; ++i) h[i] = _mm_loadu_si128((const __m128i *)(blk[i] + off));
                __m256i a[4];
                for (int i = 0; i < 4; ++i) a[i] = _mm256_set_m128i(h[i + 4], h[i]);
                const __m256i t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpackhi_epi32(a[0], a[1]);
                const __m256i t2 = _mm256_unpacklo_epi32(a[2], a[3]), t3 = _mm256_unpackhi_epi32(a[2], a[3]);
                const __m256i u[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                                      _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
                const __m256i lo = _mm256_set1_epi8(0xf);
                for (int s = 0; s < 4; ++s) {
                    _mm256_storeu_si256((__m256i *)(q + s * WR), _mm256_and_si256(u[s], lo));
                    _mm256_storeu_si256((__m256i *)(q + (s + 4) * WR),
                                        _mm256_and_si256(_mm256_srli_epi16(u[s], 4), lo));
                }
            }
            _mm256_storeu_si256((__m256i *)(g->c + b * WR + 8 * v), c);
        }
    }
}

/* columns [0, n) of one row of y from 8 lanes */
AVX2 static inline void store_cols(float *y, __m256 v, int n) {
    if (n >= 8) {
        _mm256_storeu_ps(y, v);
    } else if (n > 0) {
        float t[8];
        _mm256_storeu_ps(t, v);
        memcpy(y, t, sizeof(float) * (size_t)n);
    }
}

/* y[t, j] (rows ldy apart) for t < tr, j < nj: rows t of one panel of x (its q, s, sum, init) against the
 * WR weight rows of g */
AVX2 static inline __attribute__((always_inline)) void tile_avx2(const int fmt, const int tr, const int vnni,
                                                                const wpanel *g, int64_t K, const uint32_t *xq,
                                                                const float *xs, const float *xsum,
                                                                const int32_t *xinit, float *y, int64_t ldy,
                                                                int nj) {
    const int64_t nb = K / QK;
    const int steps = block_steps(fmt, vnni);
    const __m256i ones16 = _mm256_set1_epi16(1);
    /* the fp32 accumulators live in L1 between blocks: in registers with the 8 integer ones they
     * would leave none for the operands */
    float fa[TR][WR] __attribute__((aligned(32)));
    for (int t = 0; t < tr; ++t)
        for (int v = 0; v < WV; ++v) _mm256_store_ps(fa[t] + 8 * v, _mm256_setzero_ps());
    for (int64_t b = 0; b < nb; ++b) {
        /* the block's dots: i16 pairs (4-bit formats), else int32 (from their offsets with AVX-VNNI) */
        __m256i s[TR][WV];
        for (int t = 0; t < tr; ++t)
            for (int v = 0; v < WV; ++v)
                s[t][v] = vnni && fmt == FMT_Q4_0   ? _mm256_set1_epi32(xinit[b * TR + t])
                          : vnni && fmt == FMT_Q8_0 ? _mm256_loadu_si256((const __m256i *)(g->c + b * WR + 8 * v))
                                                    : _mm256_setzero_si256();
        for (int st = 0; st < steps; ++st) {
            const int64_t p = steps * b + st;
            __m256i wq[WV];
            for (int v = 0; v < WV; ++v) wq[v] = _mm256_loadu_si256((const __m256i *)(g->q + p * WR + 8 * v));
            for (int t = 0; t < tr; ++t) {
                const __m256i xb = _mm256_set1_epi32((int)xq[p * TR + t]);
                for (int v = 0; v < WV; ++v) {
#if defined(DI_HAVE_VNNI) && DI_VNNI_LEVEL == 1
                    if (vnni) {
                        s[t][v] = fmt == FMT_Q8_0 ? DI_DPBUSD(s[t][v], xb, wq[v]) : DI_DPBUSD(s[t][v], wq[v], xb);
                        continue;
                    }
#endif
                    if (fmt == FMT_Q8_0) /* i16 pairs of w and x: int32 lanes */
                        s[t][v] = _mm256_add_epi32(s[t][v], _mm256_madd_epi16(wq[v], xb));
                    else /* 0..15 by q: i16 pairs, summed over the block */
                        s[t][v] = _mm256_add_epi16(s[t][v], _mm256_maddubs_epi16(wq[v], xb));
                }
            }
            /* each accumulator one chain, as written: gcc otherwise reassociated the integer adds of the
             * unrolled steps into trees whose products spilled, or (rolled) copied every accumulator
             * between registers each step (objdump); one Q4_1 block of the 4 x 2 tile took 72 cycles
             * without this, 53 with it (Zen 4, L1-resident tile alone, avx2 build). Saturating adds
             * (vpaddsw, which gcc keeps in order) cost 7.5 cycles a step against vpaddw's 5 there */
            for (int t = 0; t < tr; ++t)
                for (int v = 0; v < WV; ++v) __asm__("" : "+x"(s[t][v]));
        }
        for (int t = 0; t < tr; ++t) {
            const __m256 sc = _mm256_set1_ps(xs[b * TR + t]);
            for (int v = 0; v < WV; ++v) {
                __m256i dot = s[t][v];
                if (!vnni && fmt != FMT_Q8_0) {
                    dot = _mm256_madd_epi16(dot, ones16);
                    if (fmt == FMT_Q4_0) dot = _mm256_add_epi32(dot, _mm256_set1_epi32(xinit[b * TR + t]));
                }
                const __m256 ds = _mm256_mul_ps(_mm256_loadu_ps(g->d + b * WR + 8 * v), sc);
                const __m256 acc = _mm256_load_ps(fa[t] + 8 * v);
                _mm256_store_ps(fa[t] + 8 * v, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), ds, acc));
            }
        }
    }
    /* y = acc + macc, macc the min term's own chain (zero but for Q4_1), as the row kernel adds them */
    __m256 macc[TR][WV];
    for (int t = 0; t < tr; ++t)
        for (int v = 0; v < WV; ++v) macc[t][v] = _mm256_setzero_ps();
    if (fmt == FMT_Q4_1)
        for (int64_t b = 0; b < nb; ++b)
            for (int t = 0; t < tr; ++t) {
                const __m256 xm = _mm256_set1_ps(xsum[b * TR + t]);
                for (int v = 0; v < WV; ++v)
                    macc[t][v] = _mm256_fmadd_ps(_mm256_loadu_ps(g->m + b * WR + 8 * v), xm, macc[t][v]);
            }
    for (int t = 0; t < tr; ++t)
        for (int v = 0; v < WV; ++v)
            store_cols(y + t * ldy + 8 * v, _mm256_add_ps(_mm256_load_ps(fa[t] + 8 * v), macc[t][v]), nj - 8 * v);
}

/* one group's tiles for the panels of rows [r0, r1) (r0 a multiple of TR), the format and VNNI
 * compile-time constants; meanwhile the bytes [pf, pf + pf_bytes) (the next group's weights) are
 * fetched into L2, a slice after each tile. All at once before the tiles (qgemm_avx2.h's
 * prefetch_next_group) the prefetches stalled on the full miss queue and the unpack still waited on
 * DRAM: the Q8_0 LM head 49152 x 576 at 32 rows, 1 thread, best of 11, 15.7 ms vs 14.0 spread; into
 * L1 (T0) it took 7.8 ms at 8 rows vs 5.4 into L2 (Zen 4, avx2 build) */
AVX2 static inline __attribute__((always_inline)) void group_avx2(const int fmt, const int vnni, const wpanel *g,
                                                                 int nj, int64_t K, const xpanels *X, int64_t r0,
                                                                 int64_t r1, float *y, int64_t ldy, const char *pf,
                                                                 int64_t pf_bytes) {
    const int64_t nb = K / QK, dw = nb * block_steps(fmt, vnni); /* dwords of a row */
    const int64_t tiles = (r1 - r0 + TR - 1) / TR, slice = (pf_bytes / tiles + 63) / 64 * 64;
    for (int64_t r = r0; r < r1; r += TR) {
        const int64_t P = r / TR;
        const uint32_t *xq = X->q + P * dw * TR;
        const float *xs = X->s + P * nb * TR, *xsum = X->sum + P * nb * TR;
        const int32_t *xinit = X->init + P * nb * TR;
        float *yr = y + r * ldy;
        switch (r1 - r < TR ? (int)(r1 - r) : TR) {
        case 4: tile_avx2(fmt, 4, vnni, g, K, xq, xs, xsum, xinit, yr, ldy, nj); break;
        case 3: tile_avx2(fmt, 3, vnni, g, K, xq, xs, xsum, xinit, yr, ldy, nj); break;
        case 2: tile_avx2(fmt, 2, vnni, g, K, xq, xs, xsum, xinit, yr, ldy, nj); break;
        default: tile_avx2(fmt, 1, vnni, g, K, xq, xs, xsum, xinit, yr, ldy, nj); break;
        }
        const int64_t o = (r - r0) / TR * slice;
        for (int64_t i = o; i < o + slice && i < pf_bytes; i += 64) _mm_prefetch(pf + i, _MM_HINT_T1);
    }
}

AVX2 static void group_fmt(int fmt, int vnni, const wpanel *g, int nj, int64_t K, const xpanels *X, int64_t r0,
                           int64_t r1, float *y, int64_t ldy, const char *pf, int64_t pf_bytes) {
#define GROUP_FORMATS(V)                                                                              \
    do {                                                                                              \
        if (fmt == FMT_Q4_0) group_avx2(FMT_Q4_0, V, g, nj, K, X, r0, r1, y, ldy, pf, pf_bytes);      \
        else if (fmt == FMT_Q4_1) group_avx2(FMT_Q4_1, V, g, nj, K, X, r0, r1, y, ldy, pf, pf_bytes); \
        else group_avx2(FMT_Q8_0, V, g, nj, K, X, r0, r1, y, ldy, pf, pf_bytes);                      \
    } while (0)
#if defined(DI_HAVE_VNNI) && DI_VNNI_LEVEL == 1
    if (vnni) {
        GROUP_FORMATS(1);
        return;
    }
#endif
    (void)vnni;
    GROUP_FORMATS(0);
#undef GROUP_FORMATS
}

/* rows [m0, m1) of x into one thread's panels X (panel 0 from row m0; rows past m1 up to the next
 * multiple of TR zero), quantised by the row kernel's quantiser: 4 activations a dword (Q8_0 with VNNI:
 * each + 128), or for Q8_0 without VNNI 2 as i16; q, qs: scratch for one row (K bytes, 2 nb floats) */
static void pack_x(int fmt, int vnni, const float *x, int64_t ldx, int64_t m0, int64_t m1, int64_t K,
                   const xpanels *X, int8_t *q, float *qs) {
    const int64_t nb = K / QK, dw = nb * block_steps(fmt, vnni), rows = (m1 - m0 + TR - 1) / TR * TR;
    const int wide = fmt == FMT_Q8_0 && !vnni;
    const uint32_t flip = vnni && fmt == FMT_Q8_0 ? 0x80808080u : 0;
    uint32_t *xq = X->q;
    float *sP = X->s, *sumP = X->sum;
    int32_t *initP = X->init;
    for (int64_t r = 0; r < rows; ++r) {
        const int in = m0 + r < m1;
        if (in) di_q8_quantize_rows(x + (m0 + r) * ldx, ldx, 1, K, q, qs, qs + nb);
        const int64_t P = r / TR, t = r % TR;
        uint32_t *d = xq + P * dw * TR + t;
        for (int64_t p = 0; p < dw; ++p) {
            uint32_t u = 0;
            if (in && wide) {
                u = (uint16_t)q[2 * p] | (uint32_t)(uint16_t)q[2 * p + 1] << 16;
            } else if (in) {
                memcpy(&u, q + 4 * p, 4);
                u ^= flip;
            }
            d[p * TR] = u;
        }
        for (int64_t b = 0; b < nb; ++b) {
            int sq = 0;
            if (in && fmt == FMT_Q4_0) /* only Q4_0's tiles read init */
                for (int i = 0; i < QK; ++i) sq += q[b * QK + i];
            const int64_t o = P * nb * TR + b * TR + t;
            sP[o] = in ? qs[b] : 0.f;
            sumP[o] = in ? qs[nb + b] : 0.f;
            initP[o] = -8 * sq;
        }
    }
}

/* y [M, N] (rows ldy apart) = x [M, K] (rows ldx apart) @ W.T in the int8 mode, fmt Q4_0 / Q4_1 / Q8_0,
 * K a positive multiple of 32 (the caller checks both); vnni: AVX-VNNI's vpdpbusd (only where the build
 * has it: cpu_level.h's DI_VNNI_LEVEL 1; ignored elsewhere). 1 when out of memory.
 *
 * Threads split the weight groups; each lays out the pass's rows of x in its own panels (the
 * quantisation done once per thread: 128 rows of K = 576 are ~1% of a SmolLM2 projection's time), so
 * no thread waits for another until the end: with shared panels (one barrier after them) each call
 * took a scheduler slice longer (8 ms) whenever the other core was busy, at every shape (2 threads, a
 * loaded 2-core Zen 4). */
int di_qi8_outer_avx2(const float *x, int64_t ldx, int64_t M, const uint8_t *w, int64_t rb, int fmt, int64_t N,
                      int64_t K, float *y, int64_t ldy, int vnni) {
#if !(defined(DI_HAVE_VNNI) && DI_VNNI_LEVEL == 1)
    vnni = 0;
#endif
    const int64_t nb = K / QK, groups = (N + WR - 1) / WR;
    const int64_t dw = nb * block_steps(fmt, vnni); /* dwords of a row of x or W in the panels */
    int64_t mb = XB_BYTES / (4 * dw) / TR * TR;     /* rows of x per pass over the weights */
    if (mb < TR) mb = TR;
    const int64_t Mp = (M < mb ? M : mb) + TR; /* a pass's rows in the panels, rounded up */
    int failed = 0;
    const int par = groups > 1 && M * N * K >= 32768;
#pragma omp parallel if (par)
    {
        wpanel g = {aligned_alloc(64, (size_t)(4 * WR * dw)), malloc(sizeof(float) * (size_t)(WR * nb)),
                    malloc(sizeof(float) * (size_t)(WR * nb)), malloc(sizeof(int32_t) * (size_t)(WR * nb))};
        const xpanels X = {aligned_alloc(64, (sizeof(uint32_t) * (size_t)(dw * Mp) + 63) / 64 * 64),
                           malloc(sizeof(float) * (size_t)(nb * Mp)), malloc(sizeof(float) * (size_t)(nb * Mp)),
                           malloc(sizeof(int32_t) * (size_t)(nb * Mp))};
        int8_t *q = malloc((size_t)K); /* one row of x quantised, its scales and s * sum q */
        float *qs = malloc(sizeof(float) * (size_t)(2 * nb));
        const int ok = g.q && g.d && g.m && g.c && X.q && X.s && X.sum && X.init && q && qs;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t m0 = 0; m0 < M; m0 += mb) {
            const int64_t m1 = M - m0 < mb ? M : m0 + mb;
            if (ok) pack_x(fmt, vnni, x, ldx, m0, m1, K, &X, q, qs);
#pragma omp for schedule(static) nowait
            for (int64_t gi = 0; gi < groups; ++gi) {
                if (!ok) continue;
                const int64_t n0 = gi * WR;
                const int nj = N - n0 < WR ? (int)(N - n0) : WR;
                unpack_group(fmt, w, rb, n0, nj, K, vnni, &g);
                /* the next group's rows (the same thread's next, static schedule), fetched while this one's
                 * tiles run */
                const int64_t next = N - n0 - WR < WR ? N - n0 - WR : WR;
                group_fmt(fmt, vnni, &g, nj, K, &X, 0, m1 - m0, y + m0 * ldy + n0, ldy,
                          (const char *)(next > 0 ? w + (n0 + WR) * rb : w), next > 0 ? next * rb : 0);
            }
        }
        free(g.q);
        free(g.d);
        free(g.m);
        free(g.c);
        free(X.q);
        free(X.s);
        free(X.sum);
        free(X.init);
        free(q);
        free(qs);
    }
    return failed;
}
