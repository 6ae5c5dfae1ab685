/* Token bitmasks of constrained decoding (deepinfer/grammar/bitmask.py's layout: int32 words, bit t % 32
 * of word t / 32 set = token t allowed).
 *
 * di_apply_bitmask_f32 sets every disallowed logit of the listed rows to -inf. The torch version picked
 * one of three vectorised paths (save-fill-restore, a sparse scatter, a table gather) from the mask and
 * still took 50-120 ms per step on 64 rows of a 49k vocabulary (the extraction job of
 * benchmarks/structured.py, 2 cores, under load): the gathers and scatters allocate several copies of
 * the logits. Here each word costs one compare when it allows everything (free text), 32 stores when it
 * allows nothing (structure), and a bit walk otherwise; the logits are touched in place, once.
 *
 * di_bitmask_forced_byte answers the jump-forward probe's question for one mask row: the first byte
 * every allowed token starts with, if they all share one (xgrammar_backend._next_bytes_forced did it
 * with numpy's unpackbits over the non-zero words, ~170 us per call). */
#include <math.h>
#include <stdint.h>

int di_apply_bitmask_f32(float *logits, int64_t ld, int64_t V, const int32_t *mask, int64_t W,
                         const int64_t *rows, int64_t R) {
    if (W * 32 < V)
        return 1;
    const float ninf = -INFINITY;
    for (int64_t i = 0; i < R; i++) {
        const int64_t r = rows[i];
        float *l = logits + r * ld;
        const uint32_t *m = (const uint32_t *)(mask + r * W);
        for (int64_t w = 0; w * 32 < V; w++) {
            const uint32_t word = m[w];
            if (word == 0xFFFFFFFFu)
                continue;
            float *lw = l + w * 32;
            const int n = V - w * 32 < 32 ? (int)(V - w * 32) : 32;
            if (word == 0) {
                for (int k = 0; k < n; k++)
                    lw[k] = ninf;
                continue;
            }
            uint32_t off = ~word;
            if (n < 32)
                off &= (1u << n) - 1u;
            while (off) {
                lw[__builtin_ctz(off)] = ninf;
                off &= off - 1u;
            }
        }
    }
    return 0;
}

/* t runs over the allowed token ids below V of one mask row, ascending (`continue` goes to the next) */
#define FOR_EACH_ALLOWED(mask, W, V, t)                                                 \
    for (int64_t w_ = 0; w_ < (W) && w_ * 32 < (V); w_++)                               \
        for (uint32_t word_ = (uint32_t)(mask)[w_]; word_; word_ &= word_ - 1u)         \
            for (int64_t t = w_ * 32 + __builtin_ctz(word_), once_ = 1; once_ && t < (V); once_ = 0)

/* first_byte[t]: token t's first byte, or -1 (special or empty token: never forces a byte).
 * Returns the shared first byte (0-255), -1 when no allowed token has one, -2 when two bytes differ. */
int di_bitmask_forced_byte(const int32_t *mask, int64_t W, const int16_t *first_byte, int64_t V) {
    int found = -1;
    FOR_EACH_ALLOWED(mask, W, V, t) {
        const int b = first_byte[t];
        if (b < 0)
            continue;
        if (found < 0)
            found = b;
        else if (b != found)
            return -2;
    }
    return found;
}

/* The allowed token with the smallest rank[t] (ties: the lowest id), or -1 when none is allowed: the
 * complete-within-budget guard's closing-path step (grammar/budget.py), which unpacked the row's
 * allowed ids with numpy and took torch's argmin over them (~1 ms per step of the walk on a 49k
 * vocabulary; a JSON object's closing path is 20+ steps, walked again for each candidate checked). */
int64_t di_bitmask_min_rank(const int32_t *mask, int64_t W, const int64_t *rank, int64_t V) {
    int64_t best = -1, best_rank = 0;
    FOR_EACH_ALLOWED(mask, W, V, t) {
        if (best < 0 || rank[t] < best_rank) {
            best = t;
            best_rank = rank[t];
        }
    }
    return best;
}
