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
 * Weights are packed once at load into panels of NR output columns ([K][NR], zero-padded past N),
 * all experts stacked: gate/up as 2 * ceil(I / NR) interleaved panels per expert (gate panel p,
 * then the up panel p) over K = H, down as ceil(H / NR) panels over K = I.
 *
 * Register tile: MR rows x NR = 3 vectors. AVX-512: 8 x 48 (24 of 32 zmm registers); otherwise
 * (AVX2: 16 ymm registers) 4 x 24, 12 accumulators + 3 weight vectors + 1 broadcast, which the
 * shared 8 x 48 panel GEMM (gemm.c) spills on such CPUs. Threads split (expert, panel) items.
 *
 * Gate/up is k-blocked (KC k steps of a panel pair = 24 KiB stay in L1d while every row tile of the
 * expert uses them) and each weight load is pinned to a register (IN_REGISTERS); panels are
 * prefetched PF_BYTES ahead. Side by side against the unblocked kernel (1 and 2 threads, V3-layer
 * shapes 32 x [2 x 256 x 1024] + [1024 x 256], top-4, best of 9 alternating, machine under load):
 * 1.23-1.29x at 512 tokens (compute-bound), 1.03-1.10x at 128, 1.10-1.17x at 32 (weight streaming);
 * the bits are unchanged. (A prefetch of the next k block spread over the row tiles measured 0.8x:
 * its per-step bookkeeping in the inner loop cost more than the overlap won.)
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
#else
#define VW 8
#define MR 4
#endif
#define NR (3 * VW)
/* k block of the gate/up GEMM: 2 panels x KC x NR floats = 24 KiB (L1d is 32 KiB or more) */
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
/* an opaque use of a product: the compiler (-ffp-contract=fast) cannot fuse it into the next add */
#if defined(__AVX__)
#define KEEP_ROUNDED(v) __asm__("" : "+x"(v))
#else
#define KEEP_ROUNDED(v) do { volatile vf keep_ = (v); (v) = keep_; } while (0)
#endif

/* Software prefetch PF_BYTES ahead in a panel (two lines: a k step is NR floats, 96 B on AVX2) */
#ifndef PF_BYTES
#define PF_BYTES 4096
#endif
#define PREFETCH_AT(p, off) (__builtin_prefetch((const char *)(p) + (off)), __builtin_prefetch((const char *)(p) + (off) + 64))

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

/* How threads share the (expert, panel) items and a linear's panels: dynamically (default; each
 * thread takes the next item when done) or in equal static blocks. The items' work is uneven (an
 * expert's row count) and on a shared machine a thread may be descheduled, so a static split leaves
 * the other thread waiting at the barrier; benchmarks/moe_kernels.py measures both side by side
 * (di_moe_set_dynamic). Which thread runs an item never changes its bits. */
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

/* acc[r][c] = rows[r] . panel columns (all k, in order) */
static inline __attribute__((always_inline)) void panel_tile(const int mr, const float *const *rows,
                                                             const wt_t *w, int64_t K, vf acc[MR][3], int64_t pf) {
    for (int r = 0; r < mr; ++r)
        for (int c = 0; c < 3; ++c) acc[r][c] = splat(0.f);
    for (int64_t k = 0; k < K; ++k) {
        const wt_t *wk = w + k * NR;
        PREFETCH_AT(wk, pf);
        vf w0 = ldw(wk), w1 = ldw(wk + VW), w2 = ldw(wk + 2 * VW);
        IN_REGISTERS(w0, w1, w2);
        for (int r = 0; r < mr; ++r) {
            const vf xb = splat(rows[r][k]);
            acc[r][0] += xb * w0;
            acc[r][1] += xb * w1;
            acc[r][2] += xb * w2;
        }
    }
}

/* One k block of panel_tile: buf[r] (NR floats a row) += rows[r][k0 + k] * w[k] for k = 0 .. kc-1 in
 * order, starting from 0 when first. A partial sum leaves and re-enters registers exactly, so an
 * element's chain over k (and its bits) is the one panel_tile computes over the whole K. */
static inline __attribute__((always_inline)) void panel_block(const int mr, const float *const *rows, int64_t k0,
                                                              const wt_t *w, int64_t kc, float *buf, int first,
                                                              int64_t pf) {
    vf acc[MR][3];
    for (int r = 0; r < mr; ++r)
        for (int c = 0; c < 3; ++c) acc[r][c] = first ? splat(0.f) : ldv(buf + r * NR + c * VW);
    for (int64_t k = 0; k < kc; ++k) {
        const wt_t *wk = w + k * NR;
        PREFETCH_AT(wk, pf);
        vf w0 = ldw(wk), w1 = ldw(wk + VW), w2 = ldw(wk + 2 * VW);
        IN_REGISTERS(w0, w1, w2);
        for (int r = 0; r < mr; ++r) {
            const vf xb = splat(rows[r][k0 + k]);
            acc[r][0] += xb * w0;
            acc[r][1] += xb * w1;
            acc[r][2] += xb * w2;
        }
    }
    for (int r = 0; r < mr; ++r)
        for (int c = 0; c < 3; ++c) stv(buf + r * NR + c * VW, acc[r][c]);
}

static inline __attribute__((always_inline)) void store_row(float *y, vf a[3], int64_t ncols) {
    if (ncols == NR) {
        for (int c = 0; c < 3; ++c) stv(y + VW * c, a[c]);
    } else {
        float tmp[NR];
        for (int c = 0; c < 3; ++c) stv(tmp + VW * c, a[c]);
        memcpy(y, tmp, sizeof(float) * (size_t)ncols);
    }
}

/* both panels' k block for one tile of mr rows (a constant in each case, so the tile is unrolled) */
static inline void pair_block(const int mr, const float *const *rows, int64_t k0, const wt_t *wg, const wt_t *wu,
                              int64_t kc, float *g, float *u, int64_t pf) {
    switch (mr) {
#define PAIR(m) case m: panel_block(m, rows, k0, wg, kc, g, k0 == 0, pf); panel_block(m, rows, k0, wu, kc, u, k0 == 0, pf); break;
#if MR == 8
    PAIR(8) PAIR(7) PAIR(6) PAIR(5)
#endif
    PAIR(4) PAIR(3) PAIR(2)
    default: panel_block(1, rows, k0, wg, kc, g, k0 == 0, pf); panel_block(1, rows, k0, wu, kc, u, k0 == 0, pf); break;
#undef PAIR
    }
}

/* Gate/up panel pair p of one expert over its n rows (rows[i]: row i's x), k-blocked: every row tile
 * takes a KC block of both panels (2 * KC * NR floats = 24 KiB, inside L1d) before the next block, so
 * a panel comes from memory once and from L1 for the group's other tiles, where the whole-K loop
 * (2 x 96 KiB panels at H = 1024) re-read it from L2 per tile. Partial sums wait in bg / bu (n x NR
 * each); then h = silu(gate) * up. */
static void gated_group(const float *const *rows, int64_t n, const wt_t *wg, const wt_t *wu, int64_t K,
                        float *bg, float *bu, float *h, int64_t ldh, int64_t ncols) {
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = K - k0 < KC ? K - k0 : KC;
        for (int64_t r0 = 0; r0 < n; r0 += MR) {
            const int mr = n - r0 < MR ? (int)(n - r0) : MR;
            pair_block(mr, rows + r0, k0, wg + k0 * NR, wu + k0 * NR, kc, bg + r0 * NR, bu + r0 * NR,
                       pf_offset(n, r0, (int64_t)sizeof(wt_t) * KC * NR));
        }
    }
    for (int64_t r = 0; r < n; ++r) {
        vf a[3];
        for (int c = 0; c < 3; ++c) a[c] = silu(ldv(bg + r * NR + c * VW)) * ldv(bu + r * NR + c * VW);
        store_row(h + r * ldh, a, ncols);
    }
}

static inline __attribute__((always_inline)) void down_tile(const int mr, const float *const *rows,
                                                            const wt_t *w, int64_t K, float *const *out,
                                                            int64_t ncols, int64_t pf) {
    vf a[MR][3];
    panel_tile(mr, rows, w, K, a, pf);
    for (int r = 0; r < mr; ++r) store_row(out[r], a[r], ncols);
}

#ifndef MOE_BF16
int di_moe_nr(void) { return NR; }
#endif

/* out[t, :] = sum over slots j = 0 .. k-1, in that order, of wts[t, j] * y[t * k + j, :], then
 * + add[t, :] when add is given: each product rounded, then added (no fused multiply-add: the same
 * operations, in the same order, as torch's `(y * w).sum-by-slot` loop it replaces, so the same bits). */
static void combine_rows(const float *y, int64_t ldy, int64_t t, int64_t k, const float *wts, const float *add,
                         int64_t ldadd, float *out, int64_t H) {
    const float *w = wts + t * k;
    int64_t c = 0;
    for (; c + VW <= H; c += VW) {
        vf acc = splat(w[0]) * ldv(y + (t * k) * ldy + c);
        KEEP_ROUNDED(acc);
        for (int64_t j = 1; j < k; ++j) {
            vf p = splat(w[j]) * ldv(y + (t * k + j) * ldy + c);
            KEEP_ROUNDED(p);
            acc = acc + p;
        }
        if (add) acc = acc + ldv(add + t * ldadd + c);
        stv(out + c, acc);
    }
    for (; c < H; ++c) {
        volatile float acc = w[0] * y[(t * k) * ldy + c];
        for (int64_t j = 1; j < k; ++j) {
            volatile float p = w[j] * y[(t * k + j) * ldy + c];
            acc = acc + p;
        }
        out[c] = add ? acc + add[t * ldadd + c] : acc;
    }
}

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
    /* stable counting sort: within an expert, pairs keep their (token, slot) order */
    for (int64_t i = 0; i < R; ++i) ++count[idx[i] + 1];
    int64_t G = 0;
    for (int64_t e = 0; e < Eall; ++e) {
        if (count[e + 1]) {
            group_expert[G] = e;
            group_start[G++] = count[e];
        }
        count[e + 1] += count[e];
    }
    group_start[G] = R;
    for (int64_t i = 0; i < R; ++i) pair[count[idx[i]]++] = i;

    /* threads take the groups' items largest group first (a stable insertion sort by row count): a
     * shared expert's group holds every token, and taken last it left one thread finishing it alone */
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(G ? G : 1));
    if (!order) {
        free(count); free(pair); free(group_start); free(group_expert);
        return -2;
    }
    for (int64_t g = 0; g < G; ++g) {
        const int64_t n = group_start[g + 1] - group_start[g];
        int64_t i = g;
        for (; i > 0 && group_start[order[i - 1] + 1] - group_start[order[i - 1]] < n; --i) order[i] = order[i - 1];
        order[i] = g;
    }
    int64_t max_n = 0;
    for (int64_t g = 0; g < G; ++g)
        if (group_start[g + 1] - group_start[g] > max_n) max_n = group_start[g + 1] - group_start[g];
    /* per thread: a group's row pointers and its gate / up partial sums (max_n x NR floats each) */
#ifdef _OPENMP
    const int nthreads = omp_get_max_threads();
#else
    const int nthreads = 1;
#endif
    const size_t ptr_bytes = (sizeof(float *) * (size_t)max_n + 63) / 64 * 64;
    const size_t per_thread = ptr_bytes + sizeof(float) * 2 * NR * (size_t)max_n;  /* (NR floats: 96 or 192 B) */
    char *scratch = aligned_alloc(64, per_thread * (size_t)nthreads);
    if (!scratch) {
        free(count); free(pair); free(group_start); free(group_expert); free(order);
        return -2;
    }
    const int64_t Pi = (I + NR - 1) / NR, Ph = (H + NR - 1) / NR;
    const int64_t gu_stride = 2 * Pi * H * NR, down_stride = Ph * I * NR;
    SCHEDULE_BEGIN
#pragma omp parallel if (R * H * I >= 65536)
    {
#ifdef _OPENMP
        const int tid = omp_get_thread_num();
#else
        const int tid = 0;
#endif
        const float **rows = (const float **)(scratch + (size_t)tid * per_thread);
        float *bg = (float *)(scratch + (size_t)tid * per_thread + ptr_bytes);
#pragma omp for schedule(runtime)
        for (int64_t item = 0; item < G * Pi; ++item) {
            const int64_t g = order[item / Pi], p = item % Pi;
            const int64_t ex = group_expert[g];
            const wt_t *wg = (ex < E ? gu + ex * gu_stride : xgu + (ex - E) * gu_stride) + 2 * p * H * NR;
            const wt_t *wu = wg + H * NR;
            const int64_t ncols = I - p * NR < NR ? I - p * NR : NR;
            const int64_t r0 = group_start[g], n = group_start[g + 1] - r0;
            for (int64_t r = 0; r < n; ++r) rows[r] = x + (pair[r0 + r] / k) * ldx;
            gated_group(rows, n, wg, wu, H, bg, bg + n * NR, h + r0 * I + p * NR, I, ncols);
        }
        /* (the implicit barrier of the loop above: every h row is complete here) */
#pragma omp for schedule(runtime)
        for (int64_t item = 0; item < G * Ph; ++item) {
            const int64_t g = order[item / Ph], p = item % Ph;
            const int64_t ex = group_expert[g];
            const wt_t *w = (ex < E ? down + ex * down_stride : xdown + (ex - E) * down_stride) + p * I * NR;
            const int64_t ncols = H - p * NR < NR ? H - p * NR : NR;
            for (int64_t r0 = group_start[g]; r0 < group_start[g + 1]; r0 += MR) {
                const int64_t left = group_start[g + 1] - r0;
                const int mr = left < MR ? (int)left : MR;
                const int64_t pf = pf_offset(group_start[g + 1] - group_start[g], r0 - group_start[g],
                                             (int64_t)sizeof(wt_t) * I * NR);  /* the next panel */
                const float *hrows[MR];
                float *orows[MR];
                for (int r = 0; r < mr; ++r) {
                    hrows[r] = h + (r0 + r) * I;
                    orows[r] = y + pair[r0 + r] * ldy + p * NR;
                }
                switch (mr) {
#if MR == 8
                case 8: down_tile(8, hrows, w, I, orows, ncols, pf); break;
                case 7: down_tile(7, hrows, w, I, orows, ncols, pf); break;
                case 6: down_tile(6, hrows, w, I, orows, ncols, pf); break;
                case 5: down_tile(5, hrows, w, I, orows, ncols, pf); break;
#endif
                case 4: down_tile(4, hrows, w, I, orows, ncols, pf); break;
                case 3: down_tile(3, hrows, w, I, orows, ncols, pf); break;
                case 2: down_tile(2, hrows, w, I, orows, ncols, pf); break;
                default: down_tile(1, hrows, w, I, orows, ncols, pf); break;
                }
            }
        }
        if (wts) {
            /* (the implicit barrier of the down loop: every y row is complete here) */
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; ++t) combine_rows(y, ldy, t, k, wts, add, ldadd, out + t * ldo, H);
        }
    }
    SCHEDULE_END
    free(count); free(pair); free(group_start); free(group_expert); free(order); free(scratch);
    return 0;
}

#ifndef MOE_BF16
/* ---- a plain projection on the same register tile: y = x @ W.T -------------------------------------
 * For the MoE models' other projections on AVX2 CPUs (MLA's q/kv down and up projections, o_proj, the
 * router), which otherwise run on oneDNN there: the shared 8 x 48 panel GEMM (gemm.c) spills on 16
 * ymm registers. W [N, K] packed once as ceil(N / NR) panels [K][NR] (zero-padded past N); threads
 * split the panels; each panel is k-blocked like gated_group (a 2 * KC k-step block, 24 KiB, stays
 * in L1 while every row tile of x uses it; the partial sums wait in a per-thread M x NR buffer).
 * Every output element is one multiply-add chain over k = 0 .. K-1 in order whatever M and the tile
 * its row lands in (batch-invariant for every M, one row included). */
#define KCL (2 * KC)

int di_panel_linear_f32(const float *x, int64_t ldx, int64_t M, const float *w, int64_t K, int64_t N,
                        float *y, int64_t ldy) {
    if (M == 0 || N == 0) return 0;
    const int64_t P = (N + NR - 1) / NR;
#ifdef _OPENMP
    const int nthreads = omp_get_max_threads();
#else
    const int nthreads = 1;
#endif
    const float **rows = malloc(sizeof(float *) * (size_t)M);
    const size_t buf_bytes = (sizeof(float) * NR * (size_t)M + 63) / 64 * 64;
    float *bufs = aligned_alloc(64, buf_bytes * (size_t)nthreads);
    if (!rows || !bufs) {
        free(rows); free(bufs);
        return -2;
    }
    for (int64_t r = 0; r < M; ++r) rows[r] = x + r * ldx;
    SCHEDULE_BEGIN
#pragma omp parallel if (P > 1 && M * N * K >= 65536)
    {
#ifdef _OPENMP
        const int tid = omp_get_thread_num();
#else
        const int tid = 0;
#endif
        float *buf = (float *)((char *)bufs + (size_t)tid * buf_bytes);
#pragma omp for schedule(runtime)
        for (int64_t p = 0; p < P; ++p) {
            const float *wp = w + p * K * NR;
            const int64_t ncols = N - p * NR < NR ? N - p * NR : NR;
            for (int64_t k0 = 0; k0 < K; k0 += KCL) {
                const int64_t kc = K - k0 < KCL ? K - k0 : KCL;
                for (int64_t r0 = 0; r0 < M; r0 += MR) {
                    const int mr = M - r0 < MR ? (int)(M - r0) : MR;
                    const int64_t pf = pf_offset(M, r0, (int64_t)sizeof(float) * KCL * NR);
                    const float *const *rr = rows + r0;
                    float *b = buf + r0 * NR;
                    switch (mr) {
#define LBLOCK(m) case m: panel_block(m, rr, k0, wp + k0 * NR, kc, b, k0 == 0, pf); break;
#if MR == 8
                    LBLOCK(8) LBLOCK(7) LBLOCK(6) LBLOCK(5)
#endif
                    LBLOCK(4) LBLOCK(3) LBLOCK(2)
                    default: panel_block(1, rr, k0, wp + k0 * NR, kc, b, k0 == 0, pf); break;
#undef LBLOCK
                    }
                }
            }
            for (int64_t r = 0; r < M; ++r) {
                vf a[3];
                for (int c = 0; c < 3; ++c) a[c] = ldv(buf + r * NR + c * VW);
                store_row(y + r * ldy + p * NR, a, ncols);
            }
        }
    }
    SCHEDULE_END
    free(rows); free(bufs);
    return 0;
}
#endif /* MOE_BF16 */
