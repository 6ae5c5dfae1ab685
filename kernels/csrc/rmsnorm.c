/* Fused residual add + RMSNorm over rows (fp32, CPU, OpenMP over rows when there are many).
 *
 * sum = x + residual (written to res_out); out = sum * w / sqrt(mean(sum^2) + eps). One thread
 * per row with a fixed summation order, so a row's bits never depend on the other rows.
 * residual may be NULL (plain RMSNorm of x; res_out unused).
 */
#include <math.h>
#include <stdint.h>

#include "vec16.h"

static void row(const float *x, const float *r, const float *w, float eps, float *out, float *res, int64_t D) {
    const float *s = x;
    if (r) {
        for (int64_t i = 0; i < D; ++i) res[i] = x[i] + r[i];
        s = res;
    }
    const float inv = 1.f / sqrtf(dot_lanes(s, s, D) / (float)D + eps);
    for (int64_t j = 0; j < D; ++j) out[j] = s[j] * inv * w[j];
}

int di_add_rmsnorm_f32(const float *x, const float *residual, const float *w, float eps, float *out,
                       float *res_out, int64_t M, int64_t D) {
    if (M >= 16) {
#pragma omp parallel for schedule(static)
        for (int64_t m = 0; m < M; ++m)
            row(x + m * D, residual ? residual + m * D : 0, w, eps, out + m * D, res_out ? res_out + m * D : 0, D);
    } else {
        for (int64_t m = 0; m < M; ++m)
            row(x + m * D, residual ? residual + m * D : 0, w, eps, out + m * D, res_out ? res_out + m * D : 0, D);
    }
    return 0;
}
