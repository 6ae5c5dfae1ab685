/* What the grouped expert kernels (moe_gemm.c, gemm_bf16dot.c's di_moe_experts_bf16dot) share: the
 * stable counting sort of (token, slot) pairs by expert, and the near-equal splits of a group's rows
 * into tiles and of an expert's panels into items. */
#ifndef DEEPINFER_EXPERT_SORT_H
#define DEEPINFER_EXPERT_SORT_H
#include <stdint.h>

/* idx: R expert ids in [0, E) (checked by the caller); count: E + 1 zeroed. Fills pair (sorted position ->
 * pair index), pos (pair index -> sorted position, when not NULL), and for each of the G experts with
 * pairs, in expert order, gexp[g] (its id) and gstart[g] (its first sorted position), gstart[G] = R.
 * Stable: within an expert, pairs keep their (token, slot) order. Returns G. */
static inline int64_t sort_by_expert(const int64_t *idx, int64_t R, int64_t E, int64_t *count, int64_t *pair,
                                     int64_t *pos, int64_t *gstart, int64_t *gexp) {
    for (int64_t i = 0; i < R; ++i) ++count[idx[i] + 1];
    int64_t G = 0;
    for (int64_t e = 0; e < E; ++e) {
        if (count[e + 1]) {
            gexp[G] = e;
            gstart[G++] = count[e];
        }
        count[e + 1] += count[e];
    }
    gstart[G] = R;
    for (int64_t i = 0; i < R; ++i) {
        const int64_t s = count[idx[i]]++;
        pair[s] = i;
        if (pos) pos[i] = s;
    }
    return G;
}

/* n things (rows, panels) in `parts` parts of near-equal size: part i starts at *start; returns its size */
static inline int split_parts(int64_t n, int64_t parts, int64_t i, int64_t *start) {
    const int64_t base = n / parts, extra = n % parts;
    *start = i * base + (i < extra ? i : extra);
    return (int)(base + (i < extra));
}

/* the same in ceil(n / most) parts (each at most `most`) */
static inline int split_even(int64_t n, int64_t most, int64_t i, int64_t *start) {
    return split_parts(n, (n + most - 1) / most, i, start);
}
#endif
