/* Rotary embedding of q and k straight out of the fused q|k|v projection, with k and v written to
 * their paged-cache slots (CPU; fp32 math, the cache in fp32 or bf16): one call per layer in place of
 * ~8 torch ops (split, roll, multiplies, two index_copy_) on the decode path, where those ops' fixed
 * costs dominate.
 *
 * Rotate-half convention (HF): out[i] = x[i] * cos[i] + x[(i + D/2) % D] * sin[i], with the sign of
 * rotate_half folded into sin (sin[i] < D/2 holds -sin). Each token is computed on its own
 * (batch-invariant).
 *
 * Qwen3's per-head RMSNorm of q and k (qn, kn: [D] weights, NULL when the model has none) runs in the
 * same pass, before the rotation, by rmsnorm.c's di_add_rmsnorm_f32 on each head. Why: on the
 * Qwen3-MoE benchmark model (benchmarks/moe.py, batch 128) the torch path (two norm calls, then x * cos + roll(x) * sin on q and on k, then the cache write) took 0.41 s of a
 * 7.7 s run, 5%, nearly all fixed per-op costs.
 */
#include <stdint.h>
#include <string.h>

#include "kv_bf16.h"

static void rotate(const float *x, const float *c, const float *s, int64_t D, float *out) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; ++i) out[i] = x[i] * c[i] + x[i + half] * s[i];
    for (int64_t i = half; i < D; ++i) out[i] = x[i] * c[i] + x[i - half] * s[i];
}

/* rmsnorm.c: one row (M = 1) runs serially, so it is safe inside this file's parallel loop */
int di_add_rmsnorm_f32(const float *x, const float *residual, const float *w, float eps, float *out,
                       float *res_out, int64_t M, int64_t D);

/* n values of x into a cache row: as they are (fp32), or rounded (BF) */
static inline __attribute__((always_inline)) void put(const int BF, const float *x, int64_t n, void *dst) {
    if (BF)
        for (int64_t i = 0; i < n; ++i) ((uint16_t *)dst)[i] = kv_to_bf16(x[i]);
    else
        memcpy(dst, x, sizeof(float) * (size_t)n);
}

/* qkv: [T, (H + 2 Hkv) D] rows ld apart; cos, sin: [T, D]; slots: int64 [T] in [0, S);
 * caches: [S, Hkv, D] contiguous (fp32, or bf16 with BF); q_out: [T, H, D] contiguous; qn, kn: the
 * q and k heads' RMSNorm weights [D] (both or neither), eps their epsilon. Returns 0, or 1 if a slot
 * is out of range (that token's k and v are not written; its q is still written). */
static inline __attribute__((always_inline)) int rope_store_kv(const int BF, const float *qkv, int64_t ld, int64_t T,
                                                               int64_t H, int64_t Hkv, int64_t D, const float *cos,
                                                               const float *sin, const int64_t *slots, int64_t S,
                                                               char *kc, char *vc, float *q_out, const float *qn,
                                                               const float *kn, float eps) {
    const int64_t row = Hkv * D * (BF ? 2 : 4); /* bytes per cache slot */
    int bad = 0;
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; ++t) {
        const float *x = qkv + t * ld, *c = cos + t * D, *s = sin + t * D;
        float normed[D], kr[D];
        for (int64_t h = 0; h < H; ++h) {
            const float *qh = x + h * D;
            if (qn) {
                di_add_rmsnorm_f32(qh, 0, qn, eps, normed, 0, 1, D);
                qh = normed;
            }
            rotate(qh, c, s, D, q_out + (t * H + h) * D);
        }
        if (slots[t] < 0 || slots[t] >= S) {
#pragma omp atomic write
            bad = 1;
            continue;
        }
        char *k = kc + slots[t] * row, *v = vc + slots[t] * row;
        for (int64_t h = 0; h < Hkv; ++h) {
            const float *kh = x + (H + h) * D;
            if (kn) {
                di_add_rmsnorm_f32(kh, 0, kn, eps, normed, 0, 1, D);
                kh = normed;
            }
            rotate(kh, c, s, D, kr);
            put(BF, kr, D, k + h * D * (BF ? 2 : 4));
        }
        put(BF, x + (H + Hkv) * D, Hkv * D, v);
    }
    return bad;
}

int di_rope_store_kv_f32(const float *qkv, int64_t ld, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                         const float *cos, const float *sin, const int64_t *slots, int64_t S, float *kc,
                         float *vc, float *q_out, const float *qn, const float *kn, float eps) {
    return rope_store_kv(0, qkv, ld, T, H, Hkv, D, cos, sin, slots, S, (char *)kc, (char *)vc, q_out, qn, kn, eps);
}

/* bf16 caches (uint16 bit patterns): k and v rounded as they are stored; q stays fp32 */
int di_rope_store_kv_bf16(const float *qkv, int64_t ld, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                          const float *cos, const float *sin, const int64_t *slots, int64_t S, uint16_t *kc,
                          uint16_t *vc, float *q_out, const float *qn, const float *kn, float eps) {
    return rope_store_kv(1, qkv, ld, T, H, Hkv, D, cos, sin, slots, S, (char *)kc, (char *)vc, q_out, qn, kn, eps);
}
