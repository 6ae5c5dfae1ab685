/* Multi-head latent attention (models/mla.py), the step between its projections and the attention, for
 * T query tokens in one call: each head's rope part of q rotated into the attention query's tail, and
 * each token's cache entry (kv_a_layernorm of the latent, then the rotated shared rope key) written to
 * its slot. It replaces ~12 torch ops a layer (two de-interleaves, two rotations, a norm, a cat, an
 * index_copy_); both the per-op path and the decode stack (decode_stack.c) call it, so the two compute
 * the same bits.
 *
 * q: [T, H, nope + rope] rows ldq apart; ckv: [T, r + rope] rows ldc apart (kv_a_proj_with_mqa's output:
 * the latent, then the rope key); cos, sin: [T, rope] (sin with rotate_half's sign folded in, as
 * models/layers.py's RotaryEmbedding tables). interleave: DeepSeek's rope pairs (x0 x1 x2 x3 ...) are
 * first reordered to (x0 x2 ... x1 x3 ...), the rotate-half layout, for q and k alike. Rotation:
 * out[i] = x[i] * cos[i] + x[(i + rope/2) % rope] * sin[i], each product rounded (no fused multiply-add)
 * and then summed. The latent's RMSNorm is rmsnorm.c's (weight kv_norm, epsilon eps). q_full: [T, H,
 * r + rope] contiguous, only each head's last rope values written; cache: [S, r + rope] contiguous, fp32
 * or (BF) bf16 rounded to nearest even (torch's conversion). Every token is computed on its own
 * (batch-invariant). Returns 0, or 1 if a slot is outside [0, S) (that token's entry is not written).
 */
#include <stdint.h>
#include <string.h>

#include "keep_rounded.h"
#include "kv_bf16.h"

int di_add_rmsnorm_f32(const float *x, const float *residual, const float *w, float eps, float *out,
                       float *res_out, int64_t M, int64_t D);

static void rotate(const float *x, int interleave, const float *c, const float *s, int64_t D, float *out) {
    const int64_t half = D / 2;
    float v[D];
    for (int64_t i = 0; i < half; ++i) {
        v[i] = interleave ? x[2 * i] : x[i];
        v[i + half] = interleave ? x[2 * i + 1] : x[i + half];
    }
    for (int64_t i = 0; i < D; ++i) {
        float a = v[i] * c[i], b = v[i < half ? i + half : i - half] * s[i];
        KEEP_ROUNDED(a);
        KEEP_ROUNDED(b);
        out[i] = a + b;
    }
}

static inline __attribute__((always_inline)) int mla_rope_latent(
    const int BF, const float *q, int64_t ldq, const float *ckv, int64_t ldc, int64_t T, int64_t H, int64_t nope,
    int64_t rope, int64_t r, const float *cos, const float *sin, const float *kv_norm, float eps, int interleave,
    const int64_t *slots, int64_t S, void *cache, float *q_full) {
    const int64_t E = r + rope; /* a cache entry's values */
    int bad = 0;
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; ++t) {
        const float *c = cos + t * rope, *s = sin + t * rope;
        for (int64_t h = 0; h < H; ++h)
            rotate(q + t * ldq + h * (nope + rope) + nope, interleave, c, s, rope, q_full + (t * H + h) * E + r);
        if (slots[t] < 0 || slots[t] >= S) {
#pragma omp atomic write
            bad = 1;
            continue;
        }
        float entry[E];
        di_add_rmsnorm_f32(ckv + t * ldc, 0, kv_norm, eps, entry, 0, 1, r);
        rotate(ckv + t * ldc + r, interleave, c, s, rope, entry + r);
        if (BF)
            for (int64_t i = 0; i < E; ++i) ((uint16_t *)cache)[slots[t] * E + i] = kv_to_bf16(entry[i]);
        else
            memcpy((float *)cache + slots[t] * E, entry, sizeof(float) * (size_t)E);
    }
    return bad;
}

int di_mla_rope_latent_f32(const float *q, int64_t ldq, const float *ckv, int64_t ldc, int64_t T, int64_t H,
                           int64_t nope, int64_t rope, int64_t r, const float *cos, const float *sin,
                           const float *kv_norm, float eps, int interleave, const int64_t *slots, int64_t S,
                           float *cache, float *q_full) {
    return mla_rope_latent(0, q, ldq, ckv, ldc, T, H, nope, rope, r, cos, sin, kv_norm, eps, interleave, slots, S,
                           cache, q_full);
}

int di_mla_rope_latent_bf16(const float *q, int64_t ldq, const float *ckv, int64_t ldc, int64_t T, int64_t H,
                            int64_t nope, int64_t rope, int64_t r, const float *cos, const float *sin,
                            const float *kv_norm, float eps, int interleave, const int64_t *slots, int64_t S,
                            uint16_t *cache, float *q_full) {
    return mla_rope_latent(1, q, ldq, ckv, ldc, T, H, nope, rope, r, cos, sin, kv_norm, eps, interleave, slots, S,
                           cache, q_full);
}
