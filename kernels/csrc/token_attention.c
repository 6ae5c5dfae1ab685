/* Attention for a flat list of query tokens over a paged KV cache (fp32, CPU, OpenMP).
 *
 * Query token t (T of them, H heads) attends to the len[t] cache slots idx[row[t]][0 .. len[t]),
 * in that order; a token with len[t] == 0 is skipped (its output rows are not written). Each
 * (token, head) pair is computed on its own by one thread with a fixed summation order (dot
 * products by a fixed lane tree, keys left to right, softmax sums in 16 lanes then a fixed tree),
 * so a token's output depends only on its query and the keys/values it sees: the same bits in a
 * decode step, a prefill, a chunked prefill or after a cached prefix, whatever else is in the batch.
 *
 * Head dims that are a multiple of 16 (up to 128) run on 16-float vectors with the query and the
 * output accumulator in registers (one specialised copy per head dim); others take a plain loop.
 * Built at first use by deepinfer_kernels.native (cc -O3 -march=native -fopenmp).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec16.h"

#define MAX_DV 8 /* head dims up to 8 x 16 = 128 take the vector path */

/* One (token, head): s is scratch for round_up(L, 16) floats. */
static inline __attribute__((always_inline)) void head_vec(const int DV, const float *qh, const float *kc,
                                                           const float *vc, const int64_t *slots,
                                                           int64_t slot_stride, int64_t L, float scale,
                                                           float *s, float *o) {
    v16 q[MAX_DV], acc[MAX_DV];
    for (int c = 0; c < DV; ++c) q[c] = load16(qh + 16 * c);
    float m = -INFINITY;
    for (int64_t j = 0; j < L; ++j) {
        const float *k = kc + slots[j] * slot_stride;
        v16 p = q[0] * load16(k);
        for (int c = 1; c < DV; ++c) p += q[c] * load16(k + 16 * c);
        const float x = hsum16(p) * scale;
        s[j] = x;
        m = x > m ? x : m;
    }
    const v16 mv = splat16(m);
    v16 z = splat16(0.f);
    int64_t j = 0;
    for (; j + 16 <= L; j += 16) {
        v16 e = exp16_nonpos(load16(s + j) - mv);
        store16(s + j, e);
        z += e;
    }
    if (j < L) { /* last partial block: lanes past L count as zero */
        for (int64_t i = L; i < j + 16; ++i) s[i] = m;
        i16v lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        i16v keep = lane < (int32_t)(L - j);
        v16 e = (v16)((i16v)exp16_nonpos(load16(s + j) - mv) & keep);
        store16(s + j, e);
        z += e;
    }
    const float inv = 1.f / hsum16(z);
    for (int c = 0; c < DV; ++c) acc[c] = splat16(0.f);
    for (int64_t jj = 0; jj < L; ++jj) {
        const float *v = vc + slots[jj] * slot_stride;
        const v16 p = splat16(s[jj]);
        for (int c = 0; c < DV; ++c) acc[c] += p * load16(v + 16 * c);
    }
    for (int c = 0; c < DV; ++c) store16(o + 16 * c, acc[c] * inv);
}

/* Any head dim: plain loops (scalar exp). */
static void head_any(int64_t D, const float *qh, const float *kc, const float *vc, const int64_t *slots,
                     int64_t slot_stride, int64_t L, float scale, float *s, float *o) {
    float m = -INFINITY;
    for (int64_t j = 0; j < L; ++j) {
        const float x = dot_lanes(qh, kc + slots[j] * slot_stride, D) * scale;
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
        const float *v = vc + slots[j] * slot_stride;
        for (int64_t d = 0; d < D; ++d) o[d] += s[j] * v[d];
    }
    const float inv = 1.f / z;
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
}

/* q: [T, H, D] with strides (q_st, q_sh, 1); caches: [S, Hkv, D] contiguous; out: [T, H, D] contiguous;
 * idx: int64 rows of idx_ld slots; row, len: int64 [T]. Returns 0, or 1 when a thread could not
 * allocate its scratch. */
int di_token_attention_f32(const float *q, int64_t q_st, int64_t q_sh, const float *kc, const float *vc,
                           const int64_t *idx, int64_t idx_ld, const int64_t *row, const int64_t *len,
                           float *out, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t max_len,
                           float scale) {
    const int64_t G = H / Hkv;
    const int64_t slot_stride = Hkv * D;
    const int DV = (D % 16 == 0 && D / 16 <= MAX_DV) ? (int)(D / 16) : 0;
    int failed = 0;
#pragma omp parallel
    {
        float *s = (float *)malloc(sizeof(float) * (size_t)((max_len > 0 ? max_len : 1) + 16));
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
        /* every thread must reach the worksharing loop, even one without scratch */
#pragma omp for schedule(static)
        for (int64_t w = 0; w < T * H; ++w) {
            if (!s) continue;
            const int64_t t = w / H, h = w % H, L = len[t];
            if (L <= 0) continue; /* token computed elsewhere: its output rows are left as they are */
            const int64_t *slots = idx + row[t] * idx_ld;
            const float *qh = q + t * q_st + h * q_sh;
            const float *k0 = kc + (h / G) * D, *v0 = vc + (h / G) * D;
            float *o = out + (t * H + h) * D;
            switch (DV) {
            case 1: head_vec(1, qh, k0, v0, slots, slot_stride, L, scale, s, o); break;
            case 2: head_vec(2, qh, k0, v0, slots, slot_stride, L, scale, s, o); break;
            case 3: head_vec(3, qh, k0, v0, slots, slot_stride, L, scale, s, o); break;
            case 4: head_vec(4, qh, k0, v0, slots, slot_stride, L, scale, s, o); break;
            case 5: head_vec(5, qh, k0, v0, slots, slot_stride, L, scale, s, o); break;
            case 6: head_vec(6, qh, k0, v0, slots, slot_stride, L, scale, s, o); break;
            case 7: head_vec(7, qh, k0, v0, slots, slot_stride, L, scale, s, o); break;
            case 8: head_vec(8, qh, k0, v0, slots, slot_stride, L, scale, s, o); break;
            default: head_any(D, qh, k0, v0, slots, slot_stride, L, scale, s, o);
            }
        }
        free(s);
    }
    return failed;
}
