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
 *
 * Up to SWAP_M2 rows an AVX2 kernel in the AVX-512 kernel's design (SWAPPED_AVX2, below) runs instead. Where
 * di_q_cpu_level() is 2 (AVX-512) the kernel below (SWAPPED_512) runs at every M, with the same bits
 * (tests/kernels/test_quant_levels.py). On the 2-core AVX-512 Zen 5 host, 2 threads, medians
 * (benchmarks/quant_outer_m.py), it took 1.7-2.3x less time than this AVX2 tile on SmolLM2's shapes at
 * 32-640 rows and ran at 0.90-1.12x the fp32 engine's GEMM on the same weights (fp32 / outer at 32, 128,
 * 640 rows: qkv 960x576 1.00 / 1.00 / 0.91, gate_up 3072x576 1.12 / 0.98 / 0.99, down 576x1536 1.00 /
 * 0.92 / 0.90, Q8_0 LM head 49152x576 0.97 / 1.05 / 1.03). A first AVX-512 version kept this design
 * with a 48-wide panel and an 8 x 48 tile: 1.3-2.2x the AVX2 tile from 16 rows, but the dequantise-
 * and-transpose of the panel was about half the time at 16-32 rows (0.71-1.06x fp32 there).
 */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "qgemm.h"
#include "qgemm_avx2.h"

#define OR 6   /* rows of x per register tile */
#define ON 16  /* outputs (weight rows) per panel: two vectors of 8 */
#define KC 256 /* k per block: a [KC][16] panel block is 16 KB (L1) */

/* panel[k * 16 + j] = W[n0 + j, k] dequantised (0 for j >= nj); rows: scratch [16][K] */
AVX2 static void pack_panel(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n0, int nj, int64_t K,
                            float *rows, float *panel) {
    for (int j = 0; j < ON; ++j) {
        if (j < nj) di_q_dequant_row(fmt, 1, w + (n0 + j) * row_bytes, K, rows + j * K);
        else memset(rows + j * K, 0, sizeof(float) * (size_t)K);
    }
    for (int64_t k = 0; k < K; k += 8) /* K is a multiple of 32 */
        for (int j = 0; j < ON; j += 8) transpose8(rows + j * K + k, K, panel + k * ON + j, ON);
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
AVX2 static void sweep(const float *x, int64_t ldx, int64_t M, const float *panel, int64_t K, float *out,
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

/* ---- AVX-512: the roles swapped, no weight transpose -------------------------------------------------
 * The AVX2 path's per-call cost at 16-32 rows is mostly the panel: dequantise 16 rows, then transpose
 * them. Here x is transposed once per call instead (xT [K][Mp], Mp = M rounded up to 16, zero rows past
 * M; M x K is small next to N x K), the weights are dequantised 16 rows at a time into a row buffer
 * (AVX-512 dequantiser) and stay there while an 8 x 48 register tile (24 zmm: 8 weight rows by 48 rows
 * of x; 16 x 16 where one vector of x is left) sweeps xT: per k, three loads of xT and eight
 * broadcasts of one dequantised weight feed 24 FMAs. Each output is still one FMA chain over k = 0 .. K-1 in order from 0 (w * x + acc: the product
 * the AVX2 tile forms, x * w, is the same number), so the bits equal the AVX2 path's. */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))
#ifndef WR
#define WR 16 /* weight rows per group */
#endif
#define XV 3 /* 16-row vectors of x per register tile, at most */
#ifndef XB_BYTES
#define XB_BYTES (640 << 10) /* xT bytes per pass over the weights (L2: 1 MB per core here) */
#endif

/* acc[j][c] lane i = sum_k w[j * K + k] * xT[k * ldt + 16 c + i] for j < wr; y[r, j] for r < mr, j < nj */
AVX512 static inline __attribute__((always_inline)) void tile512(const int wr, const int xv, const float *w,
                                                                int64_t K, const float *xT, int64_t ldt, int mr,
                                                                int nj, float *y, int64_t ldy) {
    __m512 acc[WR][XV];
    for (int j = 0; j < wr; ++j)
        for (int c = 0; c < xv; ++c) acc[j][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        __m512 xk[XV];
        for (int c = 0; c < xv; ++c) xk[c] = _mm512_load_ps(xT + k * ldt + 16 * c);
        for (int j = 0; j < wr; ++j) {
            const __m512 wb = _mm512_set1_ps(w[j * K + k]);
            for (int c = 0; c < xv; ++c) acc[j][c] = _mm512_fmadd_ps(wb, xk[c], acc[j][c]);
        }
    }
    float t[WR][16 * XV] __attribute__((aligned(64)));
    for (int j = 0; j < wr; ++j)
        for (int c = 0; c < xv; ++c) _mm512_store_ps(t[j] + 16 * c, acc[j][c]);
    for (int r = 0; r < mr; ++r)
        for (int j = 0; j < nj; ++j) y[r * ldy + j] = t[j][r];
}

/* xT[k * ldt + r] = x[r, k] for r < M, 0 for M <= r < ldt; rows k0 <= k < k1 (k1 - k0 a multiple of 8):
 * 8 x 8 blocks in registers, the rows past the last whole 8 one by one (the scalar loop alone took
 * ~0.1 ms of the 576 x 1536 projection at 128 rows) */
AVX2 static void transpose_x(const float *x, int64_t ldx, int64_t M, int64_t k0, int64_t k1, float *xT,
                             int64_t ldt) {
    const int64_t m8 = M / 8 * 8;
    for (int64_t k = k0; k < k1; k += 8)
        for (int64_t r = 0; r < m8; r += 8) transpose8(x + r * ldx + k, ldx, xT + k * ldt + r, ldt);
    for (int64_t k = k0; k < k1; ++k) {
        float *d = xT + k * ldt;
        for (int64_t r = m8; r < M; ++r) d[r] = x[r * ldx + k];
        for (int64_t r = M; r < ldt; ++r) d[r] = 0.f;
    }
}

/* ---- AVX2 at few rows: the AVX-512 kernel's roles in ymm --------------------------------------------------------
 * Up to SWAP_M2 rows the panel's transpose is a cost the rows do not repay, so here, as in the AVX-512 kernel, x
 * is transposed once per call and 12 weight rows at a time are dequantised into a row buffer;
 * tile2(wr, xv) is wr weight rows by xv vectors of 8 x rows (12 ymm accumulators: 4 x 3, 6 x 2 or
 * 12 x 1): per k xv loads of xT and wr broadcasts of one dequantised weight feed wr * xv FMAs. One FMA
 * chain per output over k = 0 .. K-1 from 0, as in both kernels above: the same bits, so which of the
 * two runs (by M) does not change a row. Zen 4 under DEEPINFER_CPU=avx2, 2 threads, medians
 * (benchmarks/quant_outer_m.py's shapes): time of the panel kernel over this one at 16 / 32 / 48 / 64 /
 * 128 rows: qkv 1.24 / 1.07 / 1.00 / 1.01 / 0.95, gate_up 1.15 / 1.12 / 1.02 / 1.02 / 0.98, down 1.17 /
 * 1.02 / 0.98 / 0.95 / 0.92, Q8_0 LM head 1.14 / 1.09 / 1.02 / 1.01 / 0.93: past ~48 rows the panel
 * kernel's L1-resident [KC][16] block wins (this one reads its 24-row slice of xT from L2 per tile). */
#define SWAP_M2 48
#define WR2 12
#define XB2_BYTES (256 << 10) /* xT bytes per pass over the weights (Zen 3's L2 is 512 KB a core) */

AVX2 static inline __attribute__((always_inline)) void tile2(const int wr, const int xv, const float *w, int64_t K,
                                                              const float *xT, int64_t ldt, int mr, int nj, float *y,
                                                              int64_t ldy) {
    __m256 acc[WR2][3];
    for (int j = 0; j < wr; ++j)
        for (int c = 0; c < xv; ++c) acc[j][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        __m256 xk[3];
        for (int c = 0; c < xv; ++c) xk[c] = _mm256_load_ps(xT + k * ldt + 8 * c);
        for (int j = 0; j < wr; ++j) {
            const __m256 wb = _mm256_broadcast_ss(w + j * K + k);
            for (int c = 0; c < xv; ++c) acc[j][c] = _mm256_fmadd_ps(wb, xk[c], acc[j][c]);
        }
    }
    float t[WR2][24] __attribute__((aligned(32)));
    for (int j = 0; j < wr; ++j)
        for (int c = 0; c < xv; ++c) _mm256_store_ps(t[j] + 8 * c, acc[j][c]);
    for (int r = 0; r < mr; ++r)
        for (int j = 0; j < nj; ++j) y[r * ldy + j] = t[j][r];
}

/* one group's nj (<= WR2) dequantised rows (wb, K apart) against xT rows [m0, m1) */
AVX2 static void group2(const float *wb, int64_t K, const float *xT, int64_t ldt, int64_t m0, int64_t m1, int nj,
                        float *y, int64_t ldy) {
    for (int64_t r = m0; r < m1;) {
        /* vectors of 8 rows left: tiles of 3, but 4 as 2 + 2 and 2 as one of 2 (a lone 1-vector tile
         * needs a load per FMA) */
        const int64_t rv = (m1 - r + 7) / 8;
        const int xv = rv == 1 ? 1 : rv == 2 || rv == 4 ? 2 : 3;
        const int mr = m1 - r < 8 * xv ? (int)(m1 - r) : 8 * xv;
        float *yr = y + r * ldy;
        const float *xr = xT + r;
        r += mr;
        switch (xv) {
        case 3:
            for (int j = 0; j < nj; j += 4)
                tile2(4, 3, wb + j * K, K, xr, ldt, mr, nj - j < 4 ? nj - j : 4, yr + j, ldy);
            break;
        case 2:
            for (int j = 0; j < nj; j += 6)
                tile2(6, 2, wb + j * K, K, xr, ldt, mr, nj - j < 6 ? nj - j : 6, yr + j, ldy);
            break;
        default: tile2(WR2, 1, wb, K, xr, ldt, mr, nj, yr, ldy); break;
        }
    }
}

/* one group's nj (<= WR) dequantised rows (wb, K apart) against xT rows [m0, m1): the AVX-512 tiles (OUTER_GROUP_TILES) */
AVX512 static void group512(const float *wb, int64_t K, const float *xT, int64_t ldt, int64_t m0, int64_t m1, int nj,
                            float *y, int64_t ldy) {
    OUTER_GROUP_TILES(tile512, wb, K, xT, ldt, m0, m1, nj, y, ldy);
}

/* A roles-swapped kernel at one level: its weight rows per group, the multiple its rows of xT are padded
 * to, the rows per full register tile (a pass's rows are a multiple of it), xT bytes per pass, the
 * dequantiser's level and the group's tiles. */
typedef struct {
    int wr, pad, tile_rows;
    int64_t pass_bytes;
    int dequant_level;
    void (*group)(const float *wb, int64_t K, const float *xT, int64_t ldt, int64_t m0, int64_t m1, int nj, float *y,
                  int64_t ldy);
} swapped_kind;

static const swapped_kind SWAPPED_AVX2 = {WR2, 8, 24, XB2_BYTES, 1, group2};
static const swapped_kind SWAPPED_512 = {WR, 16, 16 * XV, XB_BYTES, 2, group512};

/* x transposed once (xT [K][ldt], zero rows past M), then per pass of rows (a pass's slice of xT,
 * mb x K, stays in L2 while every group of weight rows sweeps it; prefill: 2560 rows of K = 576 are
 * 5.9 MB), the weights dequantised kind->wr rows at a time into a row buffer and swept by the kind's
 * tiles: the weights are dequantised once per pass */
static int outer_swapped(const swapped_kind *kind, const float *x, int64_t ldx, int64_t M, const uint8_t *w,
                         int64_t row_bytes, int fmt, int64_t N, int64_t K, float *y, int64_t ldy) {
    const int wr = kind->wr;
    const int64_t ldt = (M + kind->pad - 1) / kind->pad * kind->pad, groups = (N + wr - 1) / wr;
    int64_t mb = kind->pass_bytes / (4 * K) / kind->tile_rows * kind->tile_rows;
    if (mb < kind->tile_rows) mb = kind->tile_rows;
    float *xT = aligned_alloc(64, ((size_t)(K * ldt) * sizeof(float) + 63) / 64 * 64);
    if (!xT) return 1;
    const int par = groups > 1 && M * N * K >= 32768;
    int failed = 0;
#pragma omp parallel if (par)
    {
        /* the transpose in blocks of k, shared by all threads */
#pragma omp for schedule(static)
        for (int64_t k0 = 0; k0 < K; k0 += 32) transpose_x(x, ldx, M, k0, k0 + 32 < K ? k0 + 32 : K, xT, ldt);
        float *wb = aligned_alloc(64, (size_t)(wr * K) * sizeof(float));
        if (!wb) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t m0 = 0; m0 < M; m0 += mb) {
            const int64_t m1 = M - m0 < mb ? M : m0 + mb;
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; ++g) {
                if (!wb) continue;
                const int64_t n0 = g * wr;
                const int nj = N - n0 < wr ? (int)(N - n0) : wr;
                for (int j = 0; j < wr; ++j) {
                    if (j < nj) di_q_dequant_row(fmt, kind->dequant_level, w + (n0 + j) * row_bytes, K, wb + j * K);
                    else memset(wb + j * K, 0, sizeof(float) * (size_t)K);
                }
                kind->group(wb, K, xT, ldt, m0, m1, nj, y + n0, ldy);
            }
        }
        free(wb);
    }
    free(xT);
    return failed;
}

/* y [M, N] (rows ldy apart) = x [M, K] (rows ldx apart) @ W.T, W as rows of blocks (row_bytes apart);
 * 1 when refused (no AVX2, unknown format, K not whole blocks, no memory). The AVX-512 tile where
 * di_q_cpu_level() says so (2), else the AVX2 one: the same bits either way. */
int di_qgemm_outer(const float *x, int64_t ldx, int64_t M, const uint8_t *w, int64_t row_bytes, int fmt, int64_t N,
                   int64_t K, float *y, int64_t ldy) {
    const int be = di_q_block_elems(fmt), level = di_q_cpu_level();
    if (!be || K % be || K % 32 || level < 1) return 1;
    if (level >= 2) return outer_swapped(&SWAPPED_512, x, ldx, M, w, row_bytes, fmt, N, K, y, ldy);
    if (M <= SWAP_M2) return outer_swapped(&SWAPPED_AVX2, x, ldx, M, w, row_bytes, fmt, N, K, y, ldy);
    const int64_t panels = (N + ON - 1) / ON;
    int failed = 0;
#pragma omp parallel if (panels > 1 && M * N * K >= 32768)
    {
        const size_t fl = (size_t)K * ON;
        /* rows scratch, the panel, and (last panel only) a [M][16] staging tile for a partial panel */
        float *buf = aligned_alloc(64, (2 * fl * sizeof(float) + 63) / 64 * 64);
        float *stage = N % ON ? aligned_alloc(64, ((size_t)M * ON * sizeof(float) + 63) / 64 * 64) : NULL;
        if (!buf || (N % ON && !stage)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < panels; ++g) {
            if (!buf || (N % ON && !stage)) continue;
            const int64_t n0 = g * ON;
            const int nj = N - n0 < ON ? (int)(N - n0) : ON;
            float *panel = buf + fl;
            pack_panel(fmt, w, row_bytes, n0, nj, K, buf, panel);
            if (nj == ON) {
                sweep(x, ldx, M, panel, K, y + n0, ldy);
            } else {
                sweep(x, ldx, M, panel, K, stage, ON);
                for (int64_t r = 0; r < M; ++r) memcpy(y + r * ldy + n0, stage + r * ON, sizeof(float) * (size_t)nj);
            }
        }
        free(buf);
        free(stage);
    }
    return failed;
}
