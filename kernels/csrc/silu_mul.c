/* silu(g) * u for the rows of a fused gate|up projection (fp32, CPU): out[m, i] = silu(gu[m, i]) *
 * gu[m, I + i]. The quantized projections' MLP (per-op path and the native decode stack alike).
 *
 * silu16 (vec16.h) times u: within ~2e-7 of F.silu(g) * u relative. Every element goes through the same
 * 16-lane code (a row's tail is padded into a vector), so an element's bits depend only on its own g
 * and u: batch-invariant.
 */
#include <stdint.h>
#include <string.h>

#include "vec16.h"

static inline v16 silu_mul16(v16 g, v16 u) { return silu16(g) * u; }

/* gu: [M, 2I] rows ldg apart (gate then up); out: [M, I] dense. */
int di_silu_mul_f32(const float *gu, int64_t ldg, int64_t M, int64_t I, float *out) {
#pragma omp parallel for schedule(static) if (M * I >= 65536)
    for (int64_t m = 0; m < M; ++m) {
        const float *g = gu + m * ldg, *u = g + I;
        float *o = out + m * I;
        int64_t i = 0;
        for (; i + 16 <= I; i += 16) store16(o + i, silu_mul16(load16(g + i), load16(u + i)));
        if (i < I) {
            float gt[16] = {0}, ut[16] = {0}, ot[16];
            memcpy(gt, g + i, sizeof(float) * (size_t)(I - i));
            memcpy(ut, u + i, sizeof(float) * (size_t)(I - i));
            store16(ot, silu_mul16(load16(gt), load16(ut)));
            memcpy(o + i, ot, sizeof(float) * (size_t)(I - i));
        }
    }
    return 0;
}
