/* The store of one 8 x 48 register tile of the panel GEMMs (gemm.c and its 16-bit builds,
 * gemm_bf16dot.c): the includer defines NR (48, the panel's columns) and MR (8, the tile's rows) and
 * includes vec16.h first. */
#ifndef DI_PANEL_TILE_H
#define DI_PANEL_TILE_H

#include <string.h>

#include "vec16.h"

/* Adds the bias (if any) to rows r < mr of acc and writes them to y, columns [0, ncols) of this panel
 * (ncols < NR only in the last, padded panel). */
static inline __attribute__((always_inline)) void store_tile(const int mr, v16 acc[MR][3], float *y, int64_t ldy,
                                                             int64_t ncols, const float *bias) {
    for (int r = 0; r < mr; ++r) {
        float *yr = y + r * ldy;
        if (bias)
            for (int c = 0; c < 3; ++c) acc[r][c] += load16(bias + 16 * c);
        if (ncols == NR) {
            for (int c = 0; c < 3; ++c) store16(yr + 16 * c, acc[r][c]);
        } else {
            float tmp[NR];
            for (int c = 0; c < 3; ++c) store16(tmp + 16 * c, acc[r][c]);
            memcpy(yr, tmp, sizeof(float) * (size_t)ncols);
        }
    }
}

#endif
