/* Attention for a flat list of query tokens over a paged KV cache (fp32 math, CPU, OpenMP; the cache
 * in fp32 or bf16: di_token_attention_bf16 widens each bf16 key and value to fp32 as it loads it, an
 * exact conversion, so its result is the fp32 kernel's on the widened cache bit for bit).
 *
 * Query token t (T of them, H heads) attends to the len[t] cache slots idx[row[t]][0 .. len[t]),
 * in that order; a token with len[t] == 0 is skipped (its output rows are not written). Each
 * (token, head) pair is computed on its own by one thread with a fixed summation order (dot
 * products by a fixed lane tree, keys left to right, softmax sums in 16 lanes then a fixed tree),
 * so a token's output depends only on its query and the keys/values it sees: the same bits in a
 * decode step, a prefill, a chunked prefill or after a cached prefix, whatever else is in the batch.
 *
 * Head dims that are a multiple of 16 (up to 128) run on 16-float vectors with the query and the
 * output accumulator in registers (one specialised copy per head dim); larger multiples of 16 (latent
 * attention's entries) on 16-float vectors with the queries read from memory (heads_wide); others take a
 * plain loop.
 * Built at first use by deepinfer_kernels.native (cc -O3 -march=native -fopenmp).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec16.h"

#define MAX_DV 8 /* head dims up to 8 x 16 = 128 take the vector path */
#define MAX_HN 4 /* query heads of one KV head computed together */

typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));

/* 16 cache values from p (BF: bf16, widened exactly: its bits are the float's top half) */
static inline __attribute__((always_inline)) v16 kv16(const int BF, const char *p) {
    if (BF) return (v16)(__builtin_convertvector(*(const u16x16 *)p, i16v) << 16);
    return load16((const float *)p);
}

static inline __attribute__((always_inline)) float kv1(const int BF, const char *p, int64_t i) {
    if (!BF) return ((const float *)p)[i];
    union { uint32_t u; float f; } x = {(uint32_t)((const uint16_t *)p)[i] << 16};
    return x.f;
}

/* four 16-lane partial dot products -> lanes (a b c d).(0..7) + (8..15) then their (0..3) + (4..7):
 * hsum16's first two steps, for four vectors at once (chunk k of the result holds vector k's 4 lanes) */
static inline v16 reduce4(v16 a, v16 b, v16 c, v16 d) {
    const v16 ab = __builtin_shuffle(a, b, (i16v){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
                   __builtin_shuffle(a, b, (i16v){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
    const v16 cd = __builtin_shuffle(c, d, (i16v){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
                   __builtin_shuffle(c, d, (i16v){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
    return __builtin_shuffle(ab, cd, (i16v){0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}) +
           __builtin_shuffle(ab, cd, (i16v){4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
}

/* sixteen partial dot products p[0..15] -> their sums in key order, each by exactly hsum16's tree
 * ((i + i+8), then (+ i+4), (+ i+2), (+ i+1); float addition commutes bit for bit), so the scores are
 * the per-key hsum16 bits: 2.8 shuffles and adds per key instead of 8. reduce4 of keys (m, m+4, m+8,
 * m+12) puts key 4k + m in chunk k; the last two steps keep that chunk and put it in lane 4k + m. */
static inline v16 reduce16(const v16 *p) {
    const v16 e = reduce4(p[0], p[4], p[8], p[12]), f = reduce4(p[1], p[5], p[9], p[13]);
    const v16 g = reduce4(p[2], p[6], p[10], p[14]), h = reduce4(p[3], p[7], p[11], p[15]);
    const v16 ef = __builtin_shuffle(e, f, (i16v){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}) +
                   __builtin_shuffle(e, f, (i16v){2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
    const v16 gh = __builtin_shuffle(g, h, (i16v){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}) +
                   __builtin_shuffle(g, h, (i16v){2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
    return __builtin_shuffle(ef, gh, (i16v){0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30}) +
           __builtin_shuffle(ef, gh, (i16v){1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31});
}

/* the scores of keys j0 .. j0 + n - 1 for HN heads: each head's 16 partial dot products (p[h], lanes past
 * n zeroed here) summed by reduce16, scaled, stored at s[h * ls + j0 ..], and the running maxima m[h] */
static inline __attribute__((always_inline)) void score_block(const int HN, v16 p[][16], int n, float scale, float *s,
                                                              int64_t ls, int64_t j0, float *m) {
    for (int h = 0; h < HN; ++h) {
        for (int jj = n; jj < 16; ++jj) p[h][jj] = splat16(0.f);
        const v16 x = reduce16(p[h]) * scale;
        store16(s + h * ls + j0, x);
        for (int jj = 0; jj < n; ++jj) m[h] = x[jj] > m[h] ? x[jj] : m[h];
    }
}

/* each head's L scores (row h of s, ls apart) -> exp(score - m[h]) in place; inv[h] = 1 / their sum (in
 * 16 lanes, then hsum16's tree; lanes past L count as zero) */
static inline __attribute__((always_inline)) void softmax_rows(const int HN, float *s, int64_t ls, int64_t L,
                                                               const float *m, float *inv) {
    const i16v lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int h = 0; h < HN; ++h) {
        float *sh = s + h * ls;
        const v16 mv = splat16(m[h]);
        v16 z = splat16(0.f);
        int64_t j = 0;
        for (; j + 16 <= L; j += 16) {
            v16 e = exp16_nonpos(load16(sh + j) - mv);
            store16(sh + j, e);
            z += e;
        }
        if (j < L) { /* last partial block */
            for (int64_t i = L; i < j + 16; ++i) sh[i] = m[h];
            i16v keep = lane < (int32_t)(L - j);
            v16 e = (v16)((i16v)exp16_nonpos(load16(sh + j) - mv) & keep);
            store16(sh + j, e);
            z += e;
        }
        inv[h] = 1.f / hsum16(z);
    }
}

/* HN query heads (qh, q_sh apart) of one KV head: each K and V row is read once for all of them, and
 * the HN x DV output accumulators give the value sum independent chains (one head alone was bound by
 * the FMA latency of its DV chains). Every head's arithmetic is exactly the one-head order: per key the
 * same products and lane tree, keys left to right, the same softmax. One thread, SmolLM2 (9 / 3 heads,
 * D 64), 128 decode tokens over 52 keys, 30 layers: see the commit. s: scratch for HN rows of
 * round_up(L, 16) + 16 floats (ls apart). */
static inline __attribute__((always_inline)) void heads_vec(const int BF, const int DV, const int HN, const float *qh,
                                                            int64_t q_sh, const char *kc, const char *vc,
                                                            const int64_t *slots, int64_t slot_stride, int64_t L,
                                                            float scale, float *s, int64_t ls, float *o, int64_t D) {
    const int64_t es = BF ? 2 : 4, row = slot_stride * es; /* bytes per value, per cache slot */
    v16 q[MAX_HN][MAX_DV], acc[MAX_HN][MAX_DV], p[MAX_HN][16];
    float m[MAX_HN];
    for (int h = 0; h < HN; ++h) {
        for (int c = 0; c < DV; ++c) q[h][c] = load16(qh + h * q_sh + 16 * c);
        m[h] = -INFINITY;
    }
    for (int64_t j0 = 0; j0 < L; j0 += 16) {
        const int n = L - j0 < 16 ? (int)(L - j0) : 16;
        for (int jj = 0; jj < n; ++jj) {
            if (j0 + jj + 16 < L)
                for (int64_t b = 0; b < 16 * DV * es; b += 64) __builtin_prefetch(kc + slots[j0 + jj + 16] * row + b);
            for (int64_t b = 0; b < 16 * DV * es; b += 64) __builtin_prefetch(vc + slots[j0 + jj] * row + b);
            const char *k = kc + slots[j0 + jj] * row;
            const v16 k0 = kv16(BF, k);
            for (int h = 0; h < HN; ++h) p[h][jj] = q[h][0] * k0;
            for (int c = 1; c < DV; ++c) {
                const v16 kk = kv16(BF, k + 16 * es * c);
                for (int h = 0; h < HN; ++h) p[h][jj] += q[h][c] * kk;
            }
        }
        score_block(HN, p, n, scale, s, ls, j0, m);
    }
    float inv[MAX_HN];
    softmax_rows(HN, s, ls, L, m, inv);
    for (int h = 0; h < HN; ++h)
        for (int c = 0; c < DV; ++c) acc[h][c] = splat16(0.f);
    for (int64_t jj = 0; jj < L; ++jj) {
        const char *v = vc + slots[jj] * row;
        for (int c = 0; c < DV; ++c) {
            const v16 vv = kv16(BF, v + 16 * es * c);
            for (int h = 0; h < HN; ++h) acc[h][c] += splat16(s[h * ls + jj]) * vv;
        }
    }
    for (int h = 0; h < HN; ++h)
        for (int c = 0; c < DV; ++c) store16(o + h * D + 16 * c, acc[h][c] * inv[h]);
}

/* HN query heads (qh, q_sh apart) of one KV head, of a head dim that is a multiple of 16 past MAX_DV
 * vectors (latent attention's entries: 160 in benchmarks/moe.py's V3-shaped model, 576 in DeepSeek-V3,
 * all heads on one KV head): the queries read from memory, each key's vectors loaded once for the HN
 * heads; each head's dot product one 16-lane chain over the vectors in order and the scores by
 * reduce16, the softmax as heads_vec's, the value sum in chunks of accumulators (each lane one chain
 * over the keys in order, a chunk's values re-read from cache). A head's arithmetic is the same for
 * any HN. 128 decode tokens over ~48 entries, two runs each, against the plain loop this replaced and a
 * one-head version of this (every head re-reading the entries from L2): 8 heads x 160, 2 threads,
 * 0.34-0.43 ms vs 1.38-1.40 (plain) and 0.66-0.89 (one head); 16 heads x 576, 2.69-2.76 vs 7.58-7.69 and
 * 4.49 ms; one thread 0.63-0.79 vs 1.81-2.69 and 1.28-1.31, 5.05-5.10 vs 10.35-10.68 and 10.3-11.4.
 * s: HN rows of round_up(L, 16) + 16 floats, ls apart. */
static inline __attribute__((always_inline)) void heads_wide(const int BF, int64_t DV, const int HN, const float *qh,
                                                             int64_t q_sh, const char *kc, const char *vc,
                                                             const int64_t *slots, int64_t slot_stride, int64_t L,
                                                             float scale, float *s, int64_t ls, float *o, int64_t D) {
    const int64_t es = BF ? 2 : 4, row = slot_stride * es;
    v16 p[MAX_HN][16];
    float m[MAX_HN], inv[MAX_HN];
    for (int h = 0; h < HN; ++h) m[h] = -INFINITY;
    for (int64_t j0 = 0; j0 < L; j0 += 16) {
        const int n = L - j0 < 16 ? (int)(L - j0) : 16;
        for (int jj = 0; jj < n; ++jj) {
            if (j0 + jj + 16 < L)
                for (int64_t b = 0; b < 16 * DV * es; b += 64) __builtin_prefetch(kc + slots[j0 + jj + 16] * row + b);
            const char *k = kc + slots[j0 + jj] * row;
            v16 acc[MAX_HN];
            const v16 k0 = kv16(BF, k);
            for (int h = 0; h < HN; ++h) acc[h] = load16(qh + h * q_sh) * k0;
            for (int64_t c = 1; c < DV; ++c) {
                const v16 kk = kv16(BF, k + 16 * es * c);
                for (int h = 0; h < HN; ++h) acc[h] += load16(qh + h * q_sh + 16 * c) * kk;
            }
            for (int h = 0; h < HN; ++h) p[h][jj] = acc[h];
        }
        score_block(HN, p, n, scale, s, ls, j0, m);
    }
    softmax_rows(HN, s, ls, L, m, inv);
    const int NC = HN > 2 ? 4 : MAX_DV; /* value vectors a chunk: HN x NC accumulators in registers */
    for (int64_t c0 = 0; c0 < DV; c0 += NC) {
        const int nc = DV - c0 < NC ? (int)(DV - c0) : NC;
        v16 acc[MAX_HN][MAX_DV];
        for (int h = 0; h < HN; ++h)
            for (int c = 0; c < nc; ++c) acc[h][c] = splat16(0.f);
        for (int64_t jj = 0; jj < L; ++jj) {
            const char *v = vc + slots[jj] * row + 16 * es * c0;
            v16 w[MAX_HN];
            for (int h = 0; h < HN; ++h) w[h] = splat16(s[h * ls + jj]);
            for (int c = 0; c < nc; ++c) {
                const v16 vv = kv16(BF, v + 16 * es * c);
                for (int h = 0; h < HN; ++h) acc[h][c] += w[h] * vv;
            }
        }
        for (int h = 0; h < HN; ++h)
            for (int c = 0; c < nc; ++c) store16(o + h * D + 16 * (c0 + c), acc[h][c] * inv[h]);
    }
}

/* Any head dim: plain loops (scalar exp). */
static inline __attribute__((always_inline)) void head_any(const int BF, int64_t D, const float *qh, const char *kc,
                                                           const char *vc, const int64_t *slots, int64_t slot_stride,
                                                           int64_t L, float scale, float *s, float *o, float *kw) {
    const int64_t row = slot_stride * (BF ? 2 : 4);
    float m = -INFINITY;
    for (int64_t j = 0; j < L; ++j) {
        const float *kf = (const float *)(kc + slots[j] * row);
        if (BF) { /* widened into kw first: dot_lanes' order on the same values */
            for (int64_t d = 0; d < D; ++d) kw[d] = kv1(BF, kc + slots[j] * row, d);
            kf = kw;
        }
        const float x = dot_lanes(qh, kf, D) * scale;
        s[j] = x;
        m = x > m ? x : m;
    }
    float z = 0.f;
    for (int64_t j = 0; j < L; ++j) {
        s[j] = expf(s[j] - m);
        z += s[j];
    }
    for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
    for (int64_t j = 0; j < L; ++j) {
        const char *v = vc + slots[j] * row;
        for (int64_t d = 0; d < D; ++d) o[d] += s[j] * kv1(BF, v, d);
    }
    const float inv = 1.f / z;
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
}

/* q: [T, H, D] with strides (q_st, q_sh, 1); caches: [S, Hkv, D] contiguous (fp32, or bf16 with BF);
 * out: [T, H, D] contiguous; idx: int64 rows of idx_ld slots; row, len: int64 [T]. Returns 0, or 1
 * when a thread could not allocate its scratch. */
static inline __attribute__((always_inline)) int token_attention(
    const int BF, const float *q, int64_t q_st, int64_t q_sh, const char *kc, const char *vc, const int64_t *idx,
    int64_t idx_ld, const int64_t *row, const int64_t *len, float *out, int64_t T, int64_t H, int64_t Hkv, int64_t D,
    int64_t max_len, float scale) {
    const int64_t es = BF ? 2 : 4;
    const int64_t G = H / Hkv;
    const int64_t slot_stride = Hkv * D;
    const int DV = (D % 16 == 0 && D / 16 <= MAX_DV) ? (int)(D / 16) : 0;
    /* heads per work item: a KV head's G query heads in chunks of HN (at most 2 at D > 64, whose q and
     * accumulators would not fit the registers) */
    const int64_t HN = DV ? (G < (DV > 4 ? 2 : MAX_HN) ? G : (DV > 4 ? 2 : MAX_HN))
                          : D % 16 == 0 ? (G < MAX_HN ? G : MAX_HN) : 1; /* (wide: heads_wide, queries in memory) */
    const int64_t chunks = (G + HN - 1) / HN, ls = (max_len > 0 ? max_len : 1) + 16;
    int failed = 0;
#pragma omp parallel
    {
        /* HN rows of scores, then (head_any's bf16 keys) one widened key */
        float *s = (float *)malloc(sizeof(float) * (size_t)(HN * ls + D));
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
        /* every thread must reach the worksharing loop, even one without scratch */
#pragma omp for schedule(static)
        for (int64_t w = 0; w < T * Hkv * chunks; ++w) {
            if (!s) continue;
            const int64_t t = w / (Hkv * chunks), kh = w % (Hkv * chunks) / chunks;
            const int64_t h0 = kh * G + w % chunks * HN, L = len[t];
            const int hn = (int)(kh * G + G - h0 < HN ? kh * G + G - h0 : HN);
            /* the next item's first 64 keys and values into L2 while this one runs. Only its first 16
             * keys (into L1) before: a batch-128 decode over 30-84 keys, 30 layers' caches (SmolLM2
             * shapes), ran 21.8-25.7 ms instead of 28.4-40.4 (3 alternating pairs); 1 token over ~2000
             * keys and 8 over ~500 were level */
            if (w + 1 < T * Hkv * chunks) {
                const int64_t t1 = (w + 1) / (Hkv * chunks), kh1 = (w + 1) % (Hkv * chunks) / chunks;
                const int64_t *sl1 = idx + row[t1] * idx_ld;
                for (int64_t j = 0; j < len[t1] && j < 64; ++j)
                    for (int64_t d = 0; d < D * es; d += 64) {
                        __builtin_prefetch(kc + (sl1[j] * slot_stride + kh1 * D) * es + d, 0, 2);
                        __builtin_prefetch(vc + (sl1[j] * slot_stride + kh1 * D) * es + d, 0, 2);
                    }
            }
            if (L <= 0) continue; /* token computed elsewhere: its output rows are left as they are */
            const int64_t *slots = idx + row[t] * idx_ld;
            const float *qh = q + t * q_st + h0 * q_sh;
            const char *k0 = kc + kh * D * es, *v0 = vc + kh * D * es;
            float *o = out + (t * H + h0) * D;
#define HEADS(dv)                                                                                           \
    switch (hn) {                                                                                           \
    case 1: heads_vec(BF, dv, 1, qh, q_sh, k0, v0, slots, slot_stride, L, scale, s, ls, o, D); break;           \
    case 2: heads_vec(BF, dv, 2, qh, q_sh, k0, v0, slots, slot_stride, L, scale, s, ls, o, D); break;           \
    case 3: heads_vec(BF, dv, dv > 4 ? 2 : 3, qh, q_sh, k0, v0, slots, slot_stride, L, scale, s, ls, o, D); break; \
    default: heads_vec(BF, dv, dv > 4 ? 2 : 4, qh, q_sh, k0, v0, slots, slot_stride, L, scale, s, ls, o, D);     \
    }
            switch (DV) {
            case 1: HEADS(1); break;
            case 2: HEADS(2); break;
            case 3: HEADS(3); break;
            case 4: HEADS(4); break;
            case 5: HEADS(5); break;
            case 6: HEADS(6); break;
            case 7: HEADS(7); break;
            case 8: HEADS(8); break;
            default:
                if (D % 16 == 0) {
                    switch (hn) {
                    case 1: heads_wide(BF, D / 16, 1, qh, q_sh, k0, v0, slots, slot_stride, L, scale, s, ls, o, D); break;
                    case 2: heads_wide(BF, D / 16, 2, qh, q_sh, k0, v0, slots, slot_stride, L, scale, s, ls, o, D); break;
                    case 3: heads_wide(BF, D / 16, 3, qh, q_sh, k0, v0, slots, slot_stride, L, scale, s, ls, o, D); break;
                    default: heads_wide(BF, D / 16, 4, qh, q_sh, k0, v0, slots, slot_stride, L, scale, s, ls, o, D);
                    }
                } else {
                    for (int i = 0; i < hn; ++i)
                        head_any(BF, D, qh + i * q_sh, k0, v0, slots, slot_stride, L, scale, s, o + i * D, s + HN * ls);
                }
            }
#undef HEADS
        }
        free(s);
    }
    return failed;
}

int di_token_attention_f32(const float *q, int64_t q_st, int64_t q_sh, const float *kc, const float *vc,
                           const int64_t *idx, int64_t idx_ld, const int64_t *row, const int64_t *len,
                           float *out, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t max_len,
                           float scale) {
    return token_attention(0, q, q_st, q_sh, (const char *)kc, (const char *)vc, idx, idx_ld, row, len, out, T, H,
                           Hkv, D, max_len, scale);
}

/* the same over a bf16 cache (uint16 bit patterns) */
int di_token_attention_bf16(const float *q, int64_t q_st, int64_t q_sh, const uint16_t *kc, const uint16_t *vc,
                            const int64_t *idx, int64_t idx_ld, const int64_t *row, const int64_t *len,
                            float *out, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t max_len,
                            float scale) {
    return token_attention(1, q, q_st, q_sh, (const char *)kc, (const char *)vc, idx, idx_ld, row, len, out, T, H,
                           Hkv, D, max_len, scale);
}
