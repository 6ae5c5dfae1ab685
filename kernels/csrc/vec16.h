/* The native kernels' arithmetic helpers: 16-float vectors through GCC/Clang vector extensions
 * (AVX-512 where the CPU has it, narrower registers elsewhere; the library is built with
 * -march=native), and a dot product for any length. Every reduction here has a fixed order, so
 * results depend only on the inputs. */
#ifndef DEEPINFER_VEC16_H
#define DEEPINFER_VEC16_H
#include <stdint.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4))); /* for unaligned loads/stores */
typedef int32_t i16v __attribute__((vector_size(64)));

static inline v16 load16(const float *p) { return *(const v16u *)p; }
static inline void store16(float *p, v16 x) { *(v16u *)p = x; }
static inline v16 splat16(float x) { return (v16){0} + x; }

/* lanes summed by a fixed tree: (0..7)+(8..15), then halves of that, ... */
static inline float hsum16(v16 x) {
    x += __builtin_shuffle(x, (i16v){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    x += __builtin_shuffle(x, (i16v){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    x += __builtin_shuffle(x, (i16v){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    x += __builtin_shuffle(x, (i16v){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return x[0];
}

/* exp(x) for x <= 0 (softmax after subtracting the max); inputs below -87 give exp(-87) ~ 1.6e-38.
 * 2^n * p(f) with n = round(x / ln 2), f = x - n ln 2 in [-0.35, 0.35] and p the degree-7 Taylor
 * polynomial (truncation error < 1e-8 relative): within ~2 ulp of expf. */
static inline v16 exp16_nonpos(v16 x) {
    const v16 lo = splat16(-87.0f);
    i16v small = x < lo;
    x = (v16)(((i16v)lo & small) | ((i16v)x & ~small));
    const v16 magic = splat16(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    v16 t = x * 1.44269504088896341f + magic;
    v16 n = t - magic;
    v16 f = x - n * 0.693145751953125f; /* ln 2 split in two for an exact first product */
    f = f - n * 1.4286068202862268e-06f;
    v16 p = splat16(1.f / 5040.f);
    p = p * f + 1.f / 720.f;
    p = p * f + 1.f / 120.f;
    p = p * f + 1.f / 24.f;
    p = p * f + 1.f / 6.f;
    p = p * f + 0.5f;
    p = p * f + 1.f;
    p = p * f + 1.f;
    i16v e = __builtin_convertvector(n, i16v) << 23;
    return (v16)((i16v)p + e);
}

/* silu(g) = g / (1 + e) for g >= 0, g e / (1 + e) below, with e = exp(-|g|) <= 1, so nothing overflows;
 * each lane depends only on its own g. One silu for every native kernel on v16 (gemm.c's gated tile,
 * silu_mul.c): in the int8 mode, where greedy picks flip on ulp changes, greedy agreement with fp32 on
 * test_quantized_engine's prompts was 5/8 with it, as with torch's silu (2/8 with g * (1 / (1 + e))). */
static inline v16 silu16(v16 g) {
    const i16v sign = (i16v){0} + INT32_MIN; /* the sign bit (splat16(-0.f) would be +0: 0 + -0) */
    const v16 e = exp16_nonpos((v16)((i16v)g | sign)); /* exp(-|g|) */
    const i16v neg = (i16v)g >> 31;                    /* all ones where g's sign bit is set */
    const v16 num = (v16)(((i16v)(g * e) & neg) | ((i16v)g & ~neg));
    return num / (1.f + e);
}

/* Dot product of any length in 16 independent lanes (GCC vectorises them without -ffast-math),
 * summed by a fixed tree (RMSNorm, and attention for head dims that are not a multiple of 16). */
static inline float dot_lanes(const float *a, const float *b, int64_t D) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= D; i += 16)
        for (int l = 0; l < 16; ++l) acc[l] += a[i + l] * b[i + l];
    for (int l = 0; i < D; ++i, ++l) acc[l] += a[i] * b[i];
    for (int w = 8; w > 0; w /= 2)
        for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
    return acc[0];
}
#endif
