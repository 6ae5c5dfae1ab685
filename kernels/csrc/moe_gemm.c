/* The routed experts of a mixture-of-experts layer as one grouped GEMM pair, fp32 on CPU:
 *
 *   for every (token t, slot j) with expert e = idx[t, j]:
 *       y[t * k + j, :] = down_e @ (silu(gate_e @ x[t]) * (up_e @ x[t]))
 *
 * in one call: a stable counting sort of the (token, slot) pairs by expert, then for every active
 * expert its gate/up GEMM (silu * mul applied in registers) into a scratch [T*k, I], a barrier,
 * and its down GEMM written straight to the pair's output row. No gathered copy of x, no scatter
 * copy of y, no per-expert call from Python: the torch version (argsort, index_select, 2 GEMMs per
 * active expert, index_copy) spent most of a decode step's MoE time in per-call overhead.
 *
 * Weights are packed once at load into panels of VW output columns (one vector: 16 with AVX-512,
 * 8 otherwise; [K][VW], zero-padded past N), all experts stacked: gate/up as 2 * ceil(I / VW)
 * interleaved panels per expert (gate panel p, then the up panel p) over K = H, down as
 * ceil(H / VW) panels over K = I.
 *
 * Two register tiles over the same panels, chosen per expert by its row count n:
 *
 * - n <= TALL_MAX (routed experts at decode and up to a few hundred tokens): the tall tile, up to MT
 *   rows x one vector (AVX-512: 30 x 16, one accumulator a row; AVX2: 12 x 8). Each panel streams
 *   once, from memory, through one pass of FMAs; the rows are copied transposed first, so a tile's
 *   broadcasts are constant offsets from one pointer (folded into the FMAs with AVX-512). An item is
 *   a run of consecutive panels (about RUN_BYTES of weights), so each thread streams long
 *   sequential reads. Why: at 16 rows an expert (V3-shaped model, 128 tokens) the 8 x 48 tile read
 *   a k block from memory for its first row tile and from L1 for its second, so the stream idled
 *   while the second computed: 29-31 GB/s of the ~40 a plain read reaches, 0.57-0.66 of the dense
 *   GEMM's GFLOP/s (the same kernel on one expert, all rows). The tall tile reaches 230 GFLOP/s a
 *   core from L1 (the 8 x 48 tile: ~200).
 * - larger n (a dense layer's or a shared expert's rows at prefill): the wide tile, MR rows x up to 3
 *   vectors from 3 adjacent panels (AVX-512: 8 x 48 in 24 of 32 zmm registers; AVX2: 4 x 24, 12
 *   accumulators + 3 weight vectors + 1 broadcast, which the shared 8 x 48 panel GEMM (gemm.c)
 *   spills on such CPUs), gate/up k-blocked (KC k steps of the chunk = 24 KiB stay in L1d while
 *   every row tile uses them), each weight load pinned to a register (IN_REGISTERS). The tall tile
 *   re-reads all of an expert's rows per 16 columns, from L3 once they outgrow L2: at 512 rows it
 *   ran 0.4x of this one.
 *
 * Side by side with the previous kernel (8 x 48 tile only, 48-column panels) in one run (V3 layer
 * shapes 32 x [2 x 256 x 1024] + [1024 x 256], top-4, fp32, 2 threads, quiet window, median of 9
 * alternating; the bits are unchanged): 128 tokens 295 vs 218 GFLOP/s (0.79 of the previous
 * kernel's dense GEMM, 371, was 0.59); 512 tokens 328 vs 326 and 8 tokens 42 vs 31. The roofline at
 * 16 rows an expert: 8 FLOP a weight byte x 40-49 GB/s read = 320-390 GFLOP/s, 0.84-1.0 of dense.
 * The wide tile over 3 separate panels costs the dense GEMM (one expert, all rows) a little: 0.97x
 * at 1024 x 256 with 512 rows, 0.90x at 1024 x 2048 (2 threads; 0.93x at 1).
 *
 * Every output element is one multiply-add chain over k = 0 .. K-1 in order whatever the tile a
 * row lands in and whichever tokens share its expert, and silu * mul is elementwise, so a pair's
 * result depends only on its token and expert (batch-invariant for every batch size).
 */
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif
#include <string.h>

#include "expert_sort.h"
#include "keep_rounded.h"
#include "transpose32.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* The weights' storage type: fp32, or (moe_gemm_bf16.c includes this file with MOE_BF16 defined)
 * bf16, widened to fp32 in registers as loaded (exact: a bf16 is the top half of an fp32), so a bf16
 * stack computes bit for bit what the fp32 kernel computes on the same weights rounded to bf16, and
 * reads half the bytes: decode steps stream every active expert's panels, which is what bounds them. */
#ifdef MOE_BF16
typedef uint16_t wt_t;
#define FN(name) name##_bf16
#else
typedef float wt_t;
#define FN(name) name##_f32
#endif
/* a run-time switch (on by default): defined, with its setter, by the fp32 build; shared by the bf16 one */
#ifdef MOE_BF16
#define MOE_SWITCH(var, setter) extern int var;
#else
#define MOE_SWITCH(var, setter) int var = 1; void setter(int on) { var = on != 0; }
#endif

#if defined(__AVX512F__)
#define VW 16
#define MR 8
/* 30 of the 32 zmm registers hold a tall tile's sums (the weight vector takes one; the broadcasts are
 * memory operands): at 24, an expert of 25-30 rows (~6% of them at batch 128 in benchmarks/moe.py's
 * models) took two passes over each panel. 30 vs 24, builds alternating in the engine, batch 128,
 * paired median of 6: Qwen3-MoE-shaped 1.04x, V3-shaped 1.03x tokens/s. */
#define MT 30
#else
#define VW 8
#define MR 4
#define MT 12
#endif
#define NR (3 * VW)
/* the most rows an expert may have for the tall tile (benchmarks/moe_kernels.py, 512 tokens = ~64
 * rows an expert, 2 threads: the tall tile up to 64 rows 321 GFLOP/s, up to 32 (the wide tile at 64)
 * 340: its rows come from L2 at 64, twice as many bytes a FMA as the wide tile's) */
#ifndef TALL_MAX
#define TALL_MAX 32
#endif
/* k block of the wide tile's gate/up GEMM: 2 x KC x NR floats = 24 KiB (L1d is 32 KiB or more) */
#define KC (3072 / NR)

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

/* Keep a tile's weight vectors in registers: without this gcc 12 folds each weight load into every
 * row's FMA (a memory operand), 16 loads per 12 FMAs at MR = 4 instead of 7 (3 weights + 4
 * broadcasts), and the loads, not the FMAs, bound the loop. */
#if defined(__AVX__)
#define IN_REGISTERS(a, b, c) __asm__("" : "+x"(a), "+x"(b), "+x"(c))
#else
#define IN_REGISTERS(a, b, c) ((void)0)
#endif

/* Software prefetch PF_BYTES ahead in a panel. 8 KiB: the tall tile consumes a panel at 64 B per
 * 8-12 cycles, and 4 KiB ahead was too close to hide the memory latency (128 tokens, V3 shapes:
 * 8 KiB 1.11x of 4 KiB at 1 thread, 1.05x at 2; 16 KiB the same as 8) */
#ifndef PF_BYTES
#define PF_BYTES 8192
#endif
/* The tall tile's prefetch hint: 1 (prefetcht2) rather than the default 3 (prefetcht0). In the engine
 * (Qwen3-MoE-shaped model, batch 128, 64 new tokens, 2 threads, builds alternating in one process, 8
 * pairs): 1.06x the tokens/s of prefetcht0 (paired median), prefetcht1 1.04x, the wide tile's hint
 * as well or 16 KiB ahead no further change. */
#ifndef PF_LOC
#define PF_LOC 1
#endif

/* Where a row tile's prefetches point: PF_BYTES ahead in its panel, except in the last row tile of a
 * group that has several (the panel block is in L1 by then and no later tile needs it): there they
 * point one block (or, in the down GEMM, one panel) ahead, so that pass streams in what the next
 * block's first tile will read, overlapping the fetch with the pass's FMAs at no extra instructions.
 * Without it the first tile of every block waits on memory while the others never touch it.
 * Switchable for side-by-side runs (di_moe_set_prefetch_next); the bits never depend on it.
 * benchmarks/moe_kernels.py, V3 layer shapes, 1 thread, machine shared with other jobs (noise +-20%:
 * the schedule switch, a no-op at 1 thread, read 0.82-1.22x): 1.41x at 512 tokens, 0.84-0.98x at
 * 32-128 (within the noise). Huge pages in the same run: 1.11x at 512, 0.79-1.04x at 32-128. */
MOE_SWITCH(di_moe_prefetch_next_on, di_moe_set_prefetch_next)
#define moe_prefetch_next di_moe_prefetch_next_on
static inline int64_t pf_offset(int64_t n, int64_t r0, int64_t next_bytes) {
    return moe_prefetch_next && n > MR && r0 + MR >= n ? next_bytes : PF_BYTES;
}

/* How threads share the expert kernel's items and a linear's panels: dynamically (default; each
 * thread takes the next run of items when done) or in equal static blocks. The items' work is uneven
 * (an expert's row count) and on a shared machine a thread may be descheduled, so a static split
 * leaves the other thread waiting at the barrier; benchmarks/moe_kernels.py measures both side by
 * side (di_moe_set_dynamic). Which thread runs an item never changes its bits. */
MOE_SWITCH(di_moe_dynamic_on, di_moe_set_dynamic)
#define moe_dynamic di_moe_dynamic_on
#ifdef _OPENMP
#define SCHEDULE_BEGIN                                                                      \
    omp_sched_t old_kind_;                                                                  \
    int old_chunk_;                                                                         \
    omp_get_schedule(&old_kind_, &old_chunk_);                                              \
    omp_set_schedule(moe_dynamic ? omp_sched_dynamic : omp_sched_static, moe_dynamic ? 1 : 0);
#define SCHEDULE_END omp_set_schedule(old_kind_, old_chunk_);
#else
#define SCHEDULE_BEGIN
#define SCHEDULE_END
#endif

/* Which item a thread runs next (-1: none left) of n, in `order` (largest group first). Dynamically
 * (the default), even threads take items from the front and odd ones from the back: at 16 rows an
 * expert (batch 128) the tall tile needs ~14 GB/s of weights a core to keep its FMAs busy, about half
 * of what the two cores can read together, and below that an expert is bound by memory, above it by
 * the FMAs; taken in one order, both threads ran the large experts together (memory idle) and then the
 * small ones (FMAs idle). From both ends, one runs a large expert while the other runs a small one.
 * Measured (benchmarks/moe.py's models, 2 threads, builds alternating in one engine, the bits
 * unchanged): Qwen3-MoE-shaped at batch 128, the layers' experts 1.018x (median of 30 replays of the
 * engine's decode inputs), tokens/s 1.013-1.035x (paired medians of 6, three runs); DeepSeek-V3-shaped
 * at batch 32 1.008x; Qwen3 at 32 0.997x. Statically (di_moe_set_dynamic(0)): equal blocks of the items. */
#ifndef BOTH_ENDS_ROWS
#define BOTH_ENDS_ROWS 16
#endif
typedef struct {
    int64_t claimed, front, back;
} claims;

static inline int64_t take(claims *c, int64_t n, int tid, int nth, int both_ends, int64_t *cursor) {
    if (!moe_dynamic) {
        if (*cursor < 0) *cursor = tid * n / nth;
        return *cursor < (tid + 1) * n / nth ? (*cursor)++ : -1;
    }
    if (__atomic_fetch_add(&c->claimed, 1, __ATOMIC_RELAXED) >= n) return -1; /* (n claims in all) */
    return both_ends && (tid & 1) ? n - 1 - __atomic_fetch_add(&c->back, 1, __ATOMIC_RELAXED)
                                  : __atomic_fetch_add(&c->front, 1, __ATOMIC_RELAXED);
}

/* A tall group's items are runs of consecutive panels (about RUN_BYTES of weights, at least
 * RUNS_PER_THREAD runs a thread over all tall groups), so each thread reads a sequential stream.
 * With one panel an item (a down item is 16 KiB at I = 256) the two threads' items interleaved in
 * memory: at 128 tokens, V3 shapes, 2 threads, one at a time ran at 0.85x of 1 MiB runs (256 vs 300
 * GFLOP/s); 256 KiB 0.90x, 4 MiB 1.02x. (A wide group's items stay one 3-panel chunk each: they are
 * compute-bound, and runs of them left one thread with up to a run more work at the barrier; OpenMP
 * chunks of ~1 MiB over all items instead: 282 vs 295 GFLOP/s at 128 tokens, dense 0.95x vs 0.97x.) */
#ifndef RUNS_PER_THREAD
#define RUNS_PER_THREAD 4
#endif
#ifndef RUN_BYTES
#define RUN_BYTES (1 << 20)
#endif
static inline int64_t run_panels(int64_t panels, int64_t panel_bytes, int nthreads) {
    int64_t c = RUN_BYTES / panel_bytes;
    if (c > panels / (RUNS_PER_THREAD * nthreads)) c = panels / (RUNS_PER_THREAD * nthreads);
    return c > 1 ? c : 1;
}

static inline vf ldv(const float *p) { return *(const vfu *)p; }
static inline void stv(float *p, vf x) { *(vfu *)p = x; }
#ifdef MOE_BF16
/* VW bf16 weights widened to fp32 (shifted into the top half of each lane) */
static inline vf ldw(const uint16_t *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif defined(__AVX2__)
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    vi v;
    for (int i = 0; i < VW; ++i) v[i] = (int32_t)((uint32_t)p[i] << 16);
    return (vf)v;
#endif
}
#else
static inline vf ldw(const float *p) { return ldv(p); }
#endif
/* (not (vf){0} + x where the intrinsic exists: that adds 0.0 to every broadcast scalar first) */
#if defined(__AVX512F__)
static inline vf splat(float x) { return (vf)_mm512_set1_ps(x); }
#elif defined(__AVX__)
static inline vf splat(float x) { return (vf)_mm256_set1_ps(x); }
#else
static inline vf splat(float x) { return (vf){0} + x; }
#endif

/* exp(x), x clamped to [-87, 88]: 2^n * p(f), n = round(x / ln 2), f in [-0.35, 0.35], p the
 * degree-7 Taylor polynomial (the same scheme as vec16.h's exp16_nonpos, at this file's vector width). */
static inline vf expv(vf x) {
    const vf lo = splat(-87.0f), hi = splat(88.0f);
    vi m = x < lo;
    x = (vf)(((vi)lo & m) | ((vi)x & ~m));
    m = x > hi;
    x = (vf)(((vi)hi & m) | ((vi)x & ~m));
    const vf magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    vf t = x * 1.44269504088896341f + magic;
    vf n = t - magic;
    vf f = x - n * 0.693145751953125f;
    f = f - n * 1.4286068202862268e-06f;
    vf p = splat(1.f / 5040.f);
    p = p * f + 1.f / 720.f;
    p = p * f + 1.f / 120.f;
    p = p * f + 1.f / 24.f;
    p = p * f + 1.f / 6.f;
    p = p * f + 0.5f;
    p = p * f + 1.f;
    p = p * f + 1.f;
    vi e = __builtin_convertvector(n, vi) << 23;
    return (vf)((vi)p + e);
}

static inline vf silu(vf g) { return g / (1.f + expv(-g)); }

/* Wide tile, one k block: mr <= MR rows x nv <= 3 vectors, vector c from its own panel (ps weights
 * after vector c - 1's; w: the first panel's row k0). buf[r] (NR floats a row) += rows[r][k0 + k] *
 * w[k] for k = 0 .. kc-1 in order, starting from 0 when first. A partial sum leaves and re-enters
 * registers exactly, so an element's chain over k (and its bits) is the one a whole-K pass computes,
 * and the one the tall tile computes. */
static inline __attribute__((always_inline)) void wide_block(const int mr, const int nv, const float *const *rows,
                                                             int64_t k0, const wt_t *w, int64_t ps, int64_t kc,
                                                             float *buf, int first, int64_t pf) {
    vf acc[MR][3];
    for (int r = 0; r < mr; ++r)
        for (int c = 0; c < nv; ++c) acc[r][c] = first ? splat(0.f) : ldv(buf + r * NR + c * VW);
    for (int64_t k = 0; k < kc; ++k) {
        const wt_t *wk = w + k * VW;
        for (int c = 0; c < nv; ++c) __builtin_prefetch((const char *)(wk + c * ps) + pf);
        vf w0 = ldw(wk), w1 = nv > 1 ? ldw(wk + ps) : w0, w2 = nv > 2 ? ldw(wk + 2 * ps) : w0;
        IN_REGISTERS(w0, w1, w2);
        for (int r = 0; r < mr; ++r) {
            const vf xb = splat(rows[r][k0 + k]);
            acc[r][0] += xb * w0;
            if (nv > 1) acc[r][1] += xb * w1;
            if (nv > 2) acc[r][2] += xb * w2;
        }
    }
    for (int r = 0; r < mr; ++r)
        for (int c = 0; c < nv; ++c) stv(buf + r * NR + c * VW, acc[r][c]);
}

/* wide_block for an mr (1 .. MR) and nv (1 .. 3) known only at run time: each pair its own unrolled copy */
static void wide_block_any(int mr, int nv, const float *const *rows, int64_t k0, const wt_t *w, int64_t ps,
                           int64_t kc, float *buf, int first, int64_t pf) {
#define WB(m, v) wide_block(m, v, rows, k0, w, ps, kc, buf, first, pf)
#define WB_NV(m) if (nv == 3) WB(m, 3); else if (nv == 2) WB(m, 2); else WB(m, 1); break;
    switch (mr) {
#if MR == 8
    case 8: WB_NV(8) case 7: WB_NV(7) case 6: WB_NV(6) case 5: WB_NV(5)
#endif
    case 4: WB_NV(4) case 3: WB_NV(3) case 2: WB_NV(2)
    default: WB_NV(1)
    }
#undef WB_NV
#undef WB
}

/* Gate/up chunk (nv <= 3 panel pairs: gate panel j at wg + j * ps, its up panel H * VW after it) of one
 * group of n rows (rows[i]: row i's x) on the wide tile, k-blocked: every row tile takes a KC block of
 * the chunk (2 * KC * NR weights, 24 KiB in fp32, inside L1d) before the next block, so a block comes
 * from memory once and from L1 for the group's other tiles. Partial sums wait in bg / bu (n x NR
 * each); then h = silu(gate) * up, rows ldh apart. */
static void gated_wide(const float *const *rows, int64_t n, int nv, const wt_t *wg, int64_t ps, int64_t K,
                       float *bg, float *bu, float *h, int64_t ldh, int64_t ncols) {
    const wt_t *wu = wg + K * VW;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = K - k0 < KC ? K - k0 : KC;
        for (int64_t r0 = 0; r0 < n; r0 += MR) {
            const int mr = n - r0 < MR ? (int)(n - r0) : MR;
            const int64_t pf = pf_offset(n, r0, (int64_t)sizeof(wt_t) * KC * VW);
            wide_block_any(mr, nv, rows + r0, k0, wg + k0 * VW, ps, kc, bg + r0 * NR, k0 == 0, pf);
            wide_block_any(mr, nv, rows + r0, k0, wu + k0 * VW, ps, kc, bu + r0 * NR, k0 == 0, pf);
        }
    }
    for (int64_t r = 0; r < n; ++r) {
        float a[NR];
        for (int c = 0; c < nv; ++c) stv(a + c * VW, silu(ldv(bg + r * NR + c * VW)) * ldv(bu + r * NR + c * VW));
        memcpy(h + r * ldh, a, sizeof(float) * (size_t)ncols);
    }
}

/* Tall tile: m <= MT rows x one vector of VW columns. xt: the rows transposed, x[r][k] at
 * xt[k * ldt + r] (one pointer, constant offsets: the broadcasts fold into the FMAs); w: a panel
 * [K][VW]. acc[r] = row r . panel columns, one multiply-add chain over k in order. */
static inline __attribute__((always_inline)) void tall_tile(const int m, const float *xt, int64_t ldt, const wt_t *w,
                                                            int64_t K, vf acc[MT]) {
#pragma GCC unroll 32
    for (int r = 0; r < m; ++r) acc[r] = splat(0.f);
    for (int64_t k = 0; k < K; ++k) {
        __builtin_prefetch((const char *)(w + k * VW) + PF_BYTES, 0, PF_LOC);
        const vf wk = ldw(w + k * VW);
        const float *xk = xt + k * ldt;
#pragma GCC unroll 32
        for (int r = 0; r < m; ++r) acc[r] += splat(xk[r]) * wk;
    }
}

/* Gate/up panel pair of one row tile: h (transposed, h[r][c] at ht[c * ldt + r]) = silu(gate) * up */
static inline __attribute__((always_inline)) void gated_tile(const int m, const float *xt, int64_t ldt, const wt_t *wg,
                                                             const wt_t *wu, int64_t K, float *ht, int64_t ncols) {
    vf acc[MT];
    float g[MT][VW];
    tall_tile(m, xt, ldt, wg, K, acc);
    for (int r = 0; r < m; ++r) stv(g[r], acc[r]);
    tall_tile(m, xt, ldt, wu, K, acc);
    for (int r = 0; r < m; ++r) {
        float a[VW];
        stv(a, silu(ldv(g[r])) * acc[r]);
        for (int64_t c = 0; c < ncols; ++c) ht[c * ldt + r] = a[c];
    }
}

static inline __attribute__((always_inline)) void down_tile(const int m, const float *ht, int64_t ldt, const wt_t *w,
                                                            int64_t K, float *const *out, int64_t ncols) {
    vf acc[MT];
    tall_tile(m, ht, ldt, w, K, acc);
    for (int r = 0; r < m; ++r) {
        if (ncols == VW) {
            stv(out[r], acc[r]);
        } else {
            float a[VW];
            stv(a, acc[r]);
            memcpy(out[r], a, sizeof(float) * (size_t)ncols);
        }
    }
}

#if MT == 30
#define TILE_CASES(X) X(30) X(29) X(28) X(27) X(26) X(25) X(24) X(23) X(22) X(21) X(20) X(19) X(18) X(17) X(16) \
                      X(15) X(14) X(13) X(12) X(11) X(10) X(9) X(8) X(7) X(6) X(5) X(4) X(3) X(2)
#else
#define TILE_CASES(X) X(12) X(11) X(10) X(9) X(8) X(7) X(6) X(5) X(4) X(3) X(2)
#endif

#ifndef MOE_BF16
int di_moe_nr(void) { return VW; }
#endif

/* out[t, :] = sum over slots j = 0 .. k-1, in that order, of wts[t, j] * (pair t * k + j's row of y), then
 * + add[t, :] when add is given: each product rounded, then added (no fused multiply-add: the same
 * operations, in the same order, as torch's `(y * w).sum-by-slot` loop it replaces, so the same bits).
 * A pair's row is y's row t * k + j, or row pos[t * k + j] where pos is given (y in another order). */
static void combine_rows(const float *y, int64_t ldy, const int64_t *pos, int64_t t, int64_t k, const float *wts,
                         const float *add, int64_t ldadd, float *out, int64_t H) {
    const float *w = wts + t * k;
#define ROW(j) (y + (pos ? pos[t * k + (j)] : t * k + (j)) * ldy)
    int64_t c = 0;
    for (; c + VW <= H; c += VW) {
        vf acc = splat(w[0]) * ldv(ROW(0) + c);
        KEEP_ROUNDED(acc);
        for (int64_t j = 1; j < k; ++j) {
            vf p = splat(w[j]) * ldv(ROW(j) + c);
            KEEP_ROUNDED(p);
            acc = acc + p;
        }
        if (add) acc = acc + ldv(add + t * ldadd + c);
        stv(out + c, acc);
    }
    for (; c < H; ++c) {
        volatile float acc = w[0] * ROW(0)[c];
        for (int64_t j = 1; j < k; ++j) {
            volatile float p = w[j] * ROW(j)[c];
            acc = acc + p;
        }
        out[c] = add ? acc + add[t * ldadd + c] : acc;
    }
#undef ROW
}

#ifndef MOE_BF16
/* combine_rows for tokens t0 .. t1-1, for the other grouped kernel (gemm_bf16dot.c's, whose y is in
 * expert order: pos maps a pair to its row) */
void di_moe_combine_rows(const float *y, int64_t ldy, const int64_t *pos, int64_t t0, int64_t t1, int64_t k,
                         const float *wts, const float *add, int64_t ldadd, float *out, int64_t ldo, int64_t H) {
    for (int64_t t = t0; t < t1; ++t) combine_rows(y, ldy, pos, t, k, wts, add, ldadd, out + t * ldo, H);
}
#endif

/* x: [T, H] rows ldx apart; idx: [T, k] expert ids in [0, E + xE): ids below E are the stack gu / down
 * (gu: [E][2 * ceil(I/NR)][H][NR], down: [E][ceil(H/NR)][I][NR]), the others the extra stack xgu /
 * xdown (xE experts, same layout: a shared expert's chunks); h: scratch [T * k, I]; y: [T * k, H] rows
 * ldy apart. With wts ([T, k] fp32) the slots are also combined: out [T, H] rows ldo apart gets
 * combine_rows (plus add [T, H], rows ldadd apart, when not NULL), in the same call.
 * Returns 0, or -1 for an expert id out of range (nothing written), -2 when out of memory. */
int FN(di_moe_experts)(const float *x, int64_t ldx, int64_t T, int64_t k, const int64_t *idx, int64_t E,
                       const wt_t *gu, const wt_t *down, int64_t xE, const wt_t *xgu, const wt_t *xdown,
                       int64_t H, int64_t I, float *h, float *y, int64_t ldy,
                       const float *wts, const float *add, int64_t ldadd, float *out, int64_t ldo) {
    const int64_t R = T * k;
    if (R == 0) return 0;
    const int64_t Eall = E + (xgu && xdown ? xE : 0);
    for (int64_t i = 0; i < R; ++i)
        if (idx[i] < 0 || idx[i] >= Eall) return -1;
    int64_t *count = calloc((size_t)Eall + 1, sizeof(int64_t));
    int64_t *pair = malloc(sizeof(int64_t) * (size_t)R);       /* sorted position -> (t * k + j) */
    int64_t *group_start = malloc(sizeof(int64_t) * (size_t)(Eall + 1));
    int64_t *group_expert = malloc(sizeof(int64_t) * (size_t)Eall);
    if (!count || !pair || !group_start || !group_expert) {
        free(count); free(pair); free(group_start); free(group_expert);
        return -2;
    }
    const int64_t G = sort_by_expert(idx, R, Eall, count, pair, NULL, group_start, group_expert);

    /* A group of up to TALL_MAX rows runs on the tall tile, one panel (VW columns) an item: each weight
     * is read once, from memory, by one pass of FMAs (with the 8 x 48 tile, k-blocked, a panel block
     * came from memory for the first row tile and from L1 for the second, so the stream stalled while
     * the second computed). Its rows are copied transposed first ([H][m] a tile, at xt + (start of the
     * tile) * H), and its h rows stay that way ([I][m] a tile) for the down GEMM. A larger group (a
     * dense layer's or a shared expert's rows at prefill) runs on the wide tile, 3 panels an item: the
     * tall tile re-reads all its rows per 16 columns, from L3 once they outgrow L2. */
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(G ? G : 1));
    int64_t *chunk0 = malloc(sizeof(int64_t) * (size_t)(G + 1));
    if (!order || !chunk0) {
        free(count); free(pair); free(group_start); free(group_expert); free(order); free(chunk0);
        return -2;
    }
    /* threads take the groups' items largest group first (a stable insertion sort by row count): a
     * shared expert's group holds every token, and taken last it left one thread finishing it alone */
    for (int64_t g = 0; g < G; ++g) {
        const int64_t n = group_start[g + 1] - group_start[g];
        int64_t i = g;
        for (; i > 0 && group_start[order[i - 1] + 1] - group_start[order[i - 1]] < n; --i) order[i] = order[i - 1];
        order[i] = g;
    }
    const int64_t Pi = (I + VW - 1) / VW, Ph = (H + VW - 1) / VW;
    const int64_t gu_stride = 2 * Pi * H * VW, down_stride = Ph * I * VW;
    int64_t max_wide = 0;
    for (int64_t g = 0; g < G; ++g) {
        const int64_t n = group_start[g + 1] - group_start[g];
        if (n > TALL_MAX && n > max_wide) max_wide = n;
    }
#ifdef _OPENMP
    const int nthreads = omp_get_max_threads();
#else
    const int nthreads = 1;
#endif
    /* per thread, for the wide groups: a group's row pointers and its gate / up partial sums */
    const size_t ptr_bytes = (sizeof(float *) * (size_t)max_wide + 63) / 64 * 64;
    const size_t per_thread = ptr_bytes + sizeof(float) * 2 * NR * (size_t)max_wide;
    float *xt = aligned_alloc(64, (sizeof(float) * (size_t)(R * H) + 63) / 64 * 64);
    char *scratch = per_thread ? aligned_alloc(64, per_thread * (size_t)nthreads) : NULL;
    int64_t *down0 = malloc(sizeof(int64_t) * (size_t)(G + 1));
    if (!xt || (per_thread && !scratch) || !down0) {
        free(count); free(pair); free(group_start); free(group_expert); free(order); free(chunk0);
        free(xt); free(scratch); free(down0);
        return -2;
    }
    /* items, in `order`: a tall group's runs of run_gu gate/up panel pairs (run_dn down panels), a wide
     * group's 3-panel chunks; chunk0[i] / down0[i] = the first gate/up / down item of the i-th group */
    int64_t tall = 0;
    for (int64_t g = 0; g < G; ++g) tall += group_start[g + 1] - group_start[g] <= TALL_MAX;
    const int64_t run_gu = run_panels(tall * Pi, (int64_t)sizeof(wt_t) * 2 * H * VW, nthreads);
    const int64_t run_dn = run_panels(tall * Ph, (int64_t)sizeof(wt_t) * I * VW, nthreads);
    chunk0[0] = down0[0] = 0;
    for (int64_t i = 0; i < G; ++i) {
        const int wide = group_start[order[i] + 1] - group_start[order[i]] > TALL_MAX;
        chunk0[i + 1] = chunk0[i] + (wide ? (Pi + 2) / 3 : (Pi + run_gu - 1) / run_gu);
        down0[i + 1] = down0[i] + (wide ? (Ph + 2) / 3 : (Ph + run_dn - 1) / run_dn);
    }
    claims gu_claims = {0, 0, 0}, down_claims = {0, 0, 0};
    /* from both ends only where some group is large enough to be bound by its FMAs and others are
     * much smaller (see take); at one row an expert (every group bound by memory) it only broke the
     * streams' order: DeepSeek-V3-shaped model, batch 1, 0.90x tokens/s */
    const int64_t n_first = G ? group_start[order[0] + 1] - group_start[order[0]] : 0;
    const int64_t n_last = G ? group_start[order[G - 1] + 1] - group_start[order[G - 1]] : 0;
    const int both_ends = n_first >= BOTH_ENDS_ROWS && 2 * n_last <= n_first;
    SCHEDULE_BEGIN
#pragma omp parallel if (R * H * I >= 65536)
    {
#ifdef _OPENMP
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
#else
        const int tid = 0, nth = 1;
#endif
        const float **rows = (const float **)(scratch + (size_t)tid * per_thread);
        float *bg = (float *)(scratch + (size_t)tid * per_thread + ptr_bytes);
#pragma omp for schedule(runtime)
        for (int64_t g = 0; g < G; ++g) {
            const int64_t r0 = group_start[g], n = group_start[g + 1] - r0;
            for (int64_t i = 0; n <= TALL_MAX && i * MT < n; ++i) {
                int64_t t0;
                const int m = split_even(n, MT, i, &t0);
                float *xg = xt + (r0 + t0) * H;
                const float *src[MT];
                for (int r = 0; r < m; ++r) src[r] = x + (pair[r0 + t0 + r] / k) * ldx;
                transpose_rows32((const void *const *)src, m, H, xg);
            }
        }
        for (int64_t cur = -1, item; (item = take(&gu_claims, chunk0[G], tid, nth, both_ends, &cur)) >= 0;) {
            int64_t i = 0;
            while (chunk0[i + 1] <= item) ++i;  /* (G is at most the expert count) */
            const int64_t g = order[i], q = item - chunk0[i];
            const int64_t ex = group_expert[g];
            const wt_t *wgu = ex < E ? gu + ex * gu_stride : xgu + (ex - E) * gu_stride;
            const int64_t r0 = group_start[g], n = group_start[g + 1] - r0;
            if (n > TALL_MAX) {
                int64_t p;
                const int nv = split_even(Pi, 3, q, &p);
                const int64_t ncols = I - p * VW < nv * VW ? I - p * VW : nv * VW;
                for (int64_t r = 0; r < n; ++r) rows[r] = x + (pair[r0 + r] / k) * ldx;
                gated_wide(rows, n, nv, wgu + 2 * p * H * VW, 2 * H * VW, H, bg, bg + n * NR,
                           h + r0 * I + p * VW, I, ncols);
                continue;
            }
            for (int64_t p = q * run_gu; p < Pi && p < (q + 1) * run_gu; ++p) {
                const wt_t *wg = wgu + 2 * p * H * VW, *wu = wg + H * VW;
                const int64_t ncols = I - p * VW < VW ? I - p * VW : VW;
                for (int64_t j = 0; j * MT < n; ++j) {
                    int64_t t0;
                    const int m = split_even(n, MT, j, &t0);
                    const float *xg = xt + (r0 + t0) * H;
                    float *hg = h + (r0 + t0) * I + p * VW * m;
                    switch (m) {
#define GATED(mm) case mm: gated_tile(mm, xg, mm, wg, wu, H, hg, ncols); break;
                    TILE_CASES(GATED)
#undef GATED
                    default: gated_tile(1, xg, 1, wg, wu, H, hg, ncols); break;
                    }
                }
            }
        }
#pragma omp barrier
        /* (every h row is complete here) */
        for (int64_t cur = -1, item; (item = take(&down_claims, down0[G], tid, nth, both_ends, &cur)) >= 0;) {
            int64_t i = 0;
            while (down0[i + 1] <= item) ++i;
            const int64_t g = order[i], q = item - down0[i];
            const int64_t ex = group_expert[g];
            const wt_t *wd = ex < E ? down + ex * down_stride : xdown + (ex - E) * down_stride;
            const int64_t r0 = group_start[g], n = group_start[g + 1] - r0;
            if (n > TALL_MAX) {
                int64_t p;
                const int nv = split_even(Ph, 3, q, &p);
                const int64_t ncols = H - p * VW < nv * VW ? H - p * VW : nv * VW;
                for (int64_t t = 0; t < n; t += MR) {
                    const int mr = n - t < MR ? (int)(n - t) : MR;
                    const float *hrows[MR];
                    float *orows[MR];
                    for (int r = 0; r < mr; ++r) {
                        hrows[r] = h + (r0 + t + r) * I;
                        orows[r] = y + pair[r0 + t + r] * ldy + p * VW;
                    }
                    float buf[MR * NR];
                    wide_block_any(mr, nv, hrows, 0, wd + p * I * VW, I * VW, I, buf, 1,
                                   pf_offset(n, t, (int64_t)sizeof(wt_t) * I * VW * nv));  /* the next chunk */
                    for (int r = 0; r < mr; ++r) memcpy(orows[r], buf + r * NR, sizeof(float) * (size_t)ncols);
                }
                continue;
            }
            for (int64_t p = q * run_dn; p < Ph && p < (q + 1) * run_dn; ++p) {
                const wt_t *w = wd + p * I * VW;
                const int64_t ncols = H - p * VW < VW ? H - p * VW : VW;
                for (int64_t j = 0; j * MT < n; ++j) {
                    int64_t t0;
                    const int m = split_even(n, MT, j, &t0);
                    float *orows[MT];
                    for (int r = 0; r < m; ++r) orows[r] = y + pair[r0 + t0 + r] * ldy + p * VW;
                    const float *hg = h + (r0 + t0) * I;
                    switch (m) {
#define DOWN(mm) case mm: down_tile(mm, hg, mm, w, I, orows, ncols); break;
                    TILE_CASES(DOWN)
#undef DOWN
                    default: down_tile(1, hg, 1, w, I, orows, ncols); break;
                    }
                }
            }
        }
#pragma omp barrier
        if (wts) {
            /* (every y row is complete here) */
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; ++t) combine_rows(y, ldy, NULL, t, k, wts, add, ldadd, out + t * ldo, H);
        }
    }
    SCHEDULE_END
    free(count); free(pair); free(group_start); free(group_expert); free(order); free(chunk0); free(down0);
    free(xt); free(scratch);
    return 0;
}
