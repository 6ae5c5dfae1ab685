/* Attention for a flat list of query tokens over a paged KV cache (fp32, CPU, OpenMP).
 *
 * Query token t (T of them, H heads) attends to the len[t] cache slots idx[row[t]][0 .. len[t]),
 * in that order; a token with len[t] == 0 is skipped (its output rows are not written). Each
 * (token, kv head) pair is computed on its own by one thread with a fixed summation order (keys left
 * to right, dot products from lanes.h), so a token's
 * output depends only on its query and the keys/values it sees: the same bits in a decode step, a
 * prefill, a chunked prefill or after a cached prefix, whatever else is in the batch.
 * Built at first use by deepinfer_kernels.native (cc -O3 -march=native -fopenmp).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "lanes.h"

/* q: [T, H, D] with strides (q_st, q_sh, 1); caches: [S, Hkv, D] contiguous; out: [T, H, D] contiguous;
 * idx: int64 rows of idx_ld slots; row, len: int64 [T]; scratch per thread: G * max_len floats.
 * Returns 0, or 1 when a thread could not allocate its scratch. */
int di_token_attention_f32(const float *q, int64_t q_st, int64_t q_sh, const float *kc, const float *vc,
                           const int64_t *idx, int64_t idx_ld, const int64_t *row, const int64_t *len,
                           float *out, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t max_len,
                           float scale) {
    const int64_t G = H / Hkv;
    const int64_t slot_stride = Hkv * D;
    int failed = 0;
#pragma omp parallel
    {
        float *s = (float *)malloc(sizeof(float) * (size_t)(G * (max_len > 0 ? max_len : 1) + G * D + 2 * G));
        float *acc = s ? s + G * max_len : NULL, *mx = s ? acc + G * D : NULL, *sum = s ? mx + G : NULL;
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
        /* every thread must reach the worksharing loop, even one without scratch */
#pragma omp for schedule(static)
            for (int64_t w = 0; w < T * Hkv; ++w) {
                if (!s) continue;
                const int64_t t = w / Hkv, h = w % Hkv, L = len[t];
                if (L <= 0) continue; /* token computed elsewhere: its output rows are left as they are */
                const int64_t *slots = idx + row[t] * idx_ld;
                const float *qh = q + t * q_st + h * G * q_sh;
                for (int64_t g = 0; g < G; ++g) { mx[g] = -INFINITY; sum[g] = 0.f; }
                for (int64_t j = 0; j < L; ++j) {
                    const float *k = kc + slots[j] * slot_stride + h * D;
                    for (int64_t g = 0; g < G; ++g) {
                        float v = dot_lanes(qh + g * q_sh, k, D) * scale;
                        s[g * L + j] = v;
                        if (v > mx[g]) mx[g] = v;
                    }
                }
                for (int64_t g = 0; g < G; ++g) {
                    float *sg = s + g * L;
                    const float m = mx[g];
                    for (int64_t j = 0; j < L; ++j) sg[j] = expf(sg[j] - m);
                    float z = 0.f;
                    for (int64_t j = 0; j < L; ++j) z += sg[j]; /* left to right */
                    sum[g] = z;
                }
                for (int64_t i = 0; i < G * D; ++i) acc[i] = 0.f;
                for (int64_t j = 0; j < L; ++j) {
                    const float *v = vc + slots[j] * slot_stride + h * D;
                    for (int64_t g = 0; g < G; ++g) {
                        const float p = s[g * L + j];
                        float *a = acc + g * D;
                        for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
                    }
                }
                for (int64_t g = 0; g < G; ++g) {
                    float *o = out + (t * H + h * G + g) * D;
                    const float inv = 1.f / sum[g];
                    for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d] * inv;
                }
            }
        free(s);
    }
    return failed;
}
