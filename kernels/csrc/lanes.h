/* The one dot product of the native kernels: 16 independent lanes (GCC vectorises them without
 * -ffast-math) summed by a fixed tree, so the result's bits depend only on the inputs. */
#ifndef DEEPINFER_LANES_H
#define DEEPINFER_LANES_H
#include <stdint.h>

#define LANES 16

static inline float dot_lanes(const float *a, const float *b, int64_t D) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= D; i += LANES)
        for (int l = 0; l < LANES; ++l) acc[l] += a[i + l] * b[i + l];
    for (int l = 0; i < D; ++i, ++l) acc[l] += a[i] * b[i];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
    return acc[0];
}
#endif
