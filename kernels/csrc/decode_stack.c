/* Every decoder layer of a Llama / Qwen2 / Qwen3 model, dense or with Qwen-style MoE layers, or of a
 * DeepSeek-V2 / V3 model (latent attention, MoE with a shared expert), for a batch of M query tokens
 * (decodes, drafts to verify, short prefill chunks: row t attends to positions 0..pos[t] of its
 * sequence) in one call, fp32 activations, the KV cache in fp32 or bf16. Weights as GGUF blocks
 * (csrc/qgemm.c) or as packed panels (csrc/gemm.c: fp32, bf16, fp16 or bf16 dot products); an MoE
 * layer's experts as moe_gemm.c / gemm_bf16dot.c stacks.
 *
 * Per layer: add + RMSNorm, then the attention block: q|k|v projection (+ bias), rotary + KV-cache
 * store, attention over the paged cache, o projection (gqa_attention); or latent attention
 * (mla_attention: q_a, its norm and q_b, kv_a, rope + the latent cache entries, each head's absorbed
 * query, attention over the entries as one KV head, each head's value projection, o); add + RMSNorm,
 * then the MLP: gate|up projection, silu * mul (in the GEMM for gated panels), down projection; or an
 * MoE layer's router projection, routing (moe_route.c) and the routed experts (and a shared expert's
 * chunks) with their slot combine (one grouped call); then the final add + RMSNorm. Each op is the C
 * kernel the per-op path (deepinfer/engine/models/layers.py, mla.py, moe.py through the ctypes wrappers) calls, with the same arguments in the same order, so the result is
 * bit-identical to that path in the same mode; what this saves is the Python between the ops (a
 * ctypes call, checks and a torch allocation each: ~17 us per op on this host against 1.5 us for the
 * norm itself, ~10 ops per layer).
 *
 * Threads: each kernel keeps its own OpenMP region (torch's pool), as on the per-op path.
 * The model (weights, caches, rotary tables, scratch) is bound once in a di_ds_model filled by
 * deepinfer_kernels/decode_stack.py; a step passes only its hidden input, positions, KV slots and
 * block tables.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qgemm.h"

/* the per-op path's kernels: the quantised projections (qgemm.h), rmsnorm.c, rope_store_kv.c,
 * token_attention.c, silu_mul.c */
int di_add_rmsnorm_f32(const float *x, const float *residual, const float *w, float eps, float *out,
                       float *res_out, int64_t M, int64_t D);
int di_rope_store_kv_f32(const float *qkv, int64_t ld, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                         const float *cos, const float *sin, const int64_t *slots, int64_t S, float *kc,
                         float *vc, float *q_out, const float *qn, const float *kn, float eps);
int di_token_attention_f32(const float *q, int64_t q_st, int64_t q_sh, const float *kc, const float *vc,
                           const int64_t *idx, int64_t idx_ld, const int64_t *row, const int64_t *len,
                           float *out, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t max_len,
                           float scale);
int di_rope_store_kv_bf16(const float *qkv, int64_t ld, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                          const float *cos, const float *sin, const int64_t *slots, int64_t S, uint16_t *kc,
                          uint16_t *vc, float *q_out, const float *qn, const float *kn, float eps);
int di_token_attention_bf16(const float *q, int64_t q_st, int64_t q_sh, const uint16_t *kc, const uint16_t *vc,
                            const int64_t *idx, int64_t idx_ld, const int64_t *row, const int64_t *len,
                            float *out, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t max_len,
                            float scale);
int di_silu_mul_f32(const float *gu, int64_t ldg, int64_t M, int64_t I, float *out);
/* latent attention's rope and cache write (mla_rope_latent.c) */
int di_mla_rope_latent_f32(const float *q, int64_t ldq, const float *ckv, int64_t ldc, int64_t T, int64_t H,
                           int64_t nope, int64_t rope, int64_t r, const float *cos, const float *sin,
                           const float *kv_norm, float eps, int interleave, const int64_t *slots, int64_t S,
                           float *cache, float *q_full);
int di_mla_rope_latent_bf16(const float *q, int64_t ldq, const float *ckv, int64_t ldc, int64_t T, int64_t H,
                            int64_t nope, int64_t rope, int64_t r, const float *cos, const float *sin,
                            const float *kv_norm, float eps, int interleave, const int64_t *slots, int64_t S,
                            uint16_t *cache, float *q_full);
/* the panel GEMMs (gemm.c and its 16-bit builds, gemm_bf16dot.c), the MoE router and experts */
int di_gemm_f32(const float *x, int64_t ldx, int64_t M, const float *wp, int64_t K, int64_t N, int gated,
                const float *bias, float *y, int64_t ldy);
int di_gemm_bf16(const float *x, int64_t ldx, int64_t M, const uint16_t *wp, int64_t K, int64_t N, int gated,
                 const float *bias, float *y, int64_t ldy);
int di_gemm_f16(const float *x, int64_t ldx, int64_t M, const uint16_t *wp, int64_t K, int64_t N, int gated,
                const float *bias, float *y, int64_t ldy);
int di_gemm_bf16dot(const float *x, int64_t ldx, int64_t M, const uint16_t *wp, int64_t K, int64_t N, int gated,
                    const float *bias, float *y, int64_t ldy);
int di_moe_route_f32(const float *logits, int64_t lde, int64_t T, int64_t E, const float *bias, int scoring,
                     int64_t n_group, int64_t topk_group, int group_score, int64_t top_k, int norm, float eps,
                     float scale, float *w_out, int64_t *idx_out);
void di_sigmoid_f32(const float *x, int64_t n, float *y);
#define DS_EXPERTS_ARGS(wt)                                                                                  \
    const float *x, int64_t ldx, int64_t T, int64_t k, const int64_t *idx, int64_t E, const wt *gu,         \
        const wt *down, int64_t xE, const wt *xgu, const wt *xdown, int64_t H, int64_t I, float *h, float *y, \
        int64_t ldy, const float *wts, const float *add, int64_t ldadd, float *out, int64_t ldo
int di_moe_experts_f32(DS_EXPERTS_ARGS(float));
int di_moe_experts_bf16(DS_EXPERTS_ARGS(uint16_t));
int di_moe_experts_bf16dot(DS_EXPERTS_ARGS(uint16_t));

/* a projection's bound arguments: GGUF blocks as quant.RowKernel binds them, {W's address, row bytes,
 * format, N, K}; or packed panels (native.PackedWeight), {panels' address, gated, DS_PANEL_*, N, K},
 * the call native.linear / gated_linear makes (gated: silu(gate) * up, N of each half) */
typedef int64_t di_ds_weight[5];
enum { DS_PANEL_F32 = 100, DS_PANEL_BF16 = 101, DS_PANEL_F16 = 102, DS_PANEL_BF16DOT = 103 };

/* an MoE layer (models/moe.py's MoeBlock): the router's panels (E outputs) and moe_route.route's
 * arguments; the routed experts as moe_gemm.PackedExperts holds them, and a shared expert as `shared`
 * more experts of that shape (its chunks: NativeExperts.combined's fused call, each weighted 1). Or,
 * with no router (all zeros), a dense gated MLP on the same kernel as one expert (NativeGatedMlp). */
enum { DS_EXPERTS_F32 = 0, DS_EXPERTS_BF16 = 1, DS_EXPERTS_BF16DOT = 2 };
typedef struct {
    di_ds_weight router;
    const float *score_bias;       /* [E] (choosing only), or NULL */
    const void *gate_up, *down;    /* the experts' stacks */
    int64_t experts, top_k, inter; /* E, k, the experts' intermediate size */
    int64_t kind;                  /* DS_EXPERTS_*: the kernel (the stacks' storage) */
    int64_t scoring, n_group, topk_group, group_score, norm;
    float eps, scale;
    int64_t shared;                             /* the shared expert's chunks (0: none) */
    const void *shared_gate_up, *shared_down; /* their stacks, the routed experts' storage */
    di_ds_weight shared_gate; /* Qwen2-MoE's shared-expert gate [1 x hidden] as panels (zeros: none): its
                               * chunks' slots weighted sigmoid(x . gate) instead of 1 */
} di_ds_moe;

/* a latent attention block (models/mla.py's MlaAttention, absorbed projections one linear a head): q_a
 * (or, with no q_lora, the q projection) and q_b as panels, kv_a_proj_with_mqa, the two norms, each
 * head's W_uk^T [r x nope] and W_uv [v x r] panels; the o projection is the layer's `o` */
typedef struct {
    di_ds_weight q_a, q_b, kv_a;
    const float *q_a_norm, *kv_a_norm; /* [q_lora] (or NULL without q_lora), [r] */
    const di_ds_weight *uk, *uv;       /* [heads] each */
    int64_t interleave;                /* DeepSeek's interleaved rope pairs */
    float q_a_eps, kv_a_eps, scale;
} di_ds_mla;

typedef struct {
    const float *in_norm, *post_norm; /* [hidden] */
    const float *qkv_bias;            /* [(H + 2 Hkv) D], or NULL */
    const float *q_norm, *k_norm;     /* [D] per-head RMSNorm weights of q and k (Qwen3), or both NULL */
    void *k_cache, *v_cache;          /* [slots, Hkv, D] contiguous, fp32 or (kv_bf16) bf16 */
    di_ds_weight qkv, o, gate_up, down; /* (gate_up, down unused in an MoE layer) */
    const di_ds_moe *moe;               /* the MLP is this MoE block, or NULL */
    const di_ds_mla *mla;               /* the attention is this latent block (k_cache: its [slots, 1, r + rope]
                                           entries; qkv unused), or NULL */
} di_ds_layer;

typedef struct {
    int64_t n_layers, hidden, heads, kv_heads, head_dim, inter;
    int64_t slots;      /* KV-cache slots per layer */
    int64_t block_size; /* slots per block of the block tables */
    int64_t positions;  /* rows of the rotary tables */
    int64_t mode;       /* DI_Q_EXACT or DI_Q_INT8 */
    int64_t max_rows;   /* rows the scratch holds */
    int64_t many;       /* the exact mode's kernel from panel_m rows: DS_MANY_PANEL / _OUTER / _BF16 */
    int64_t panel_m;    /* quant.PANEL_M: the exact mode's row kernel stops below it */
    int64_t outer_rows, outer_rows_q4; /* the int8 mode's vpdpbusd kernel from these rows (Q8_0 / Q4_x) */
    int64_t kv_bf16;                   /* the caches hold bf16 (the *_bf16 kernels) */
    int64_t moe_experts, moe_top_k, moe_inter; /* the MoE layers' largest E, k (+ shared chunks) and intermediate size (0: none) */
    int64_t mla_r, mla_rope, mla_nope, mla_v, mla_q_lora; /* the latent layers' sizes (all 0: none; q_lora 0: a plain q) */
    float eps, scale;
    const float *cos, *sin; /* [positions, head_dim], sin carrying rotate_half's sign */
    const float *final_norm;
    const di_ds_layer *layers;
    void *work; /* di_decode_stack_work_bytes(model) bytes, 64-byte aligned */
} di_ds_model;

enum { DS_OK = 0, DS_BAD_SHAPE = 1, DS_BAD_POSITION = 2, DS_BAD_SLOT = 3, DS_NO_MEMORY = 4, DS_KERNEL = 5 };

static int64_t kmax(const di_ds_model *m) {
    int64_t k = m->hidden;
    if (m->heads * m->head_dim > k) k = m->heads * m->head_dim;
    if (m->inter > k) k = m->inter;
    return k;
}

/* the scratch, carved in this order, each part 64-byte aligned */
typedef struct {
    float *res, *h, *x, *qkv, *q, *att, *gu, *act, *cs, *sn, *xs, *xsum, *logits, *rw, *rw2, *mh, *my;
    float *lq, *lqa, *lqn, *lckv, *lqf, *latt, *lout; /* latent attention's */
    int64_t *lens, *rowid, *ridx, *ridx2;
    int8_t *qx;
} scratch;

static size_t carve(const di_ds_model *m, char *base, scratch *s) {
    const int64_t R = m->max_rows, D = m->head_dim, K = kmax(m);
    const int64_t qkv_n = (m->heads + 2 * m->kv_heads) * D;
    size_t off = 0;
#define TAKE(field, type, count)                                                   \
    do {                                                                           \
        if (s) s->field = (type *)(base + off);                                    \
        off += ((size_t)(count) * sizeof(type) + 63) & ~(size_t)63;               \
    } while (0)
    TAKE(res, float, R * m->hidden);
    TAKE(h, float, R * m->hidden);
    TAKE(x, float, R * m->hidden);
    TAKE(qkv, float, R * qkv_n);
    TAKE(q, float, R * m->heads * D);
    TAKE(att, float, R * m->heads * D);
    TAKE(gu, float, R * 2 * m->inter);
    TAKE(act, float, R * m->inter);
    TAKE(cs, float, R * D);
    TAKE(sn, float, R * D);
    TAKE(xs, float, R * (K / QK));
    TAKE(xsum, float, R * (K / QK));
    TAKE(logits, float, R * m->moe_experts);
    TAKE(rw, float, R * m->moe_top_k);
    TAKE(rw2, float, R * m->moe_top_k);
    TAKE(mh, float, R * m->moe_top_k * m->moe_inter);
    TAKE(my, float, R * m->moe_top_k * m->hidden);
    TAKE(lens, int64_t, R);
    TAKE(rowid, int64_t, R);
    TAKE(ridx, int64_t, R * m->moe_top_k);
    TAKE(ridx2, int64_t, R * m->moe_top_k);
    const int64_t E = m->mla_r + m->mla_rope;
    TAKE(lq, float, R * m->heads * (m->mla_nope + m->mla_rope));
    TAKE(lqa, float, R * m->mla_q_lora);
    TAKE(lqn, float, R * m->mla_q_lora);
    TAKE(lckv, float, R * E);
    TAKE(lqf, float, R * m->heads * E);
    TAKE(latt, float, R * m->heads * E);
    TAKE(lout, float, R * m->heads * m->mla_v);
    TAKE(qx, int8_t, R * K);
#undef TAKE
    return off;
}

int64_t di_decode_stack_work_bytes(const di_ds_model *m) { return (int64_t)carve(m, 0, 0); }

/* the many-row kernels (1 where one refuses): qgemm_i8_outer.c (the int8 row kernel's bits),
 * qgemm_panel.c (the exact row kernel's bits), qgemm_outer.c and qgemm_bf16.c (one fixed order each) */
int di_qgemm_outer_i8(const float *x, int64_t ldx, int64_t M, const uint8_t *w, int64_t row_bytes, int fmt,
                      int64_t N, int64_t K, float *y, int64_t ldy);
int di_qgemm_panel(const float *x, int64_t ldx, int64_t M, const uint8_t *w, int64_t row_bytes, int fmt,
                   int64_t N, int64_t K, float *y, int64_t ldy);
int di_qgemm_outer(const float *x, int64_t ldx, int64_t M, const uint8_t *w, int64_t row_bytes, int fmt,
                   int64_t N, int64_t K, float *y, int64_t ldy);
int di_qgemm_outer_bf16(const float *x, int64_t ldx, int64_t M, const uint8_t *w, int64_t row_bytes, int fmt,
                        int64_t N, int64_t K, float *y, int64_t ldy);

/* From panel_m rows QuantLinear's exact-mode calls leave the row kernel for the kernel `many` names
 * (quant_linear.py: the panel kernel in the batch-invariant mode, else the outer-product kernel, or in
 * the bf16 mode the bf16 one; OUTER_M = BF16_M = PANEL_M there), each falling back as quant.py's
 * wrappers do where it refuses. The int8 mode's thresholds (outer_rows*) are quant_linear.py's
 * INT8_OUTER_M / INT8_OUTER_M_Q4 (the same bits as the row path: they only pick the faster kernel).
 * All are the caller's (deepinfer_kernels/decode_stack.py), so the two paths share one definition. */
enum { DS_MANY_PANEL = 0, DS_MANY_OUTER = 1, DS_MANY_BF16 = 2 };

static int project_exact(const di_ds_model *m, const di_ds_weight w, const float *x, int64_t M, float *y) {
    if (M < m->panel_m) return di_qgemm_exact_bound(w, x, M, y);
    const uint8_t *wp = (const uint8_t *)(intptr_t)w[0];
    const int64_t rb = w[1], N = w[3], K = w[4];
    const int fmt = (int)w[2];
    if (m->many == DS_MANY_BF16 && !di_qgemm_outer_bf16(x, K, M, wp, rb, fmt, N, K, y, N)) return 0;
    if (m->many >= DS_MANY_OUTER && !di_qgemm_outer(x, K, M, wp, rb, fmt, N, K, y, N)) return 0;
    if (!di_qgemm_panel(x, K, M, wp, rb, fmt, N, K, y, N)) return 0;
    return di_qgemm(DI_Q_EXACT, 1, x, K, 0, 0, 0, M, wp, rb, fmt, N, K, y, N);
}

/* panels: native._gemm's call, x rows ldx apart, y rows ldy apart (each output row depends only on
 * its input row: the same bits at any strides) */
static int project_panels_ld(const di_ds_weight w, const float *x, int64_t ldx, int64_t M, const float *bias, float *y,
                             int64_t ldy) {
    const void *p = (const void *)(intptr_t)w[0];
    const int gated = (int)w[1];
    const int64_t N = w[3], K = w[4];
    switch (w[2]) {
    case DS_PANEL_F32: return di_gemm_f32(x, ldx, M, (const float *)p, K, N, gated, bias, y, ldy);
    case DS_PANEL_BF16: return di_gemm_bf16(x, ldx, M, (const uint16_t *)p, K, N, gated, bias, y, ldy);
    case DS_PANEL_F16: return di_gemm_f16(x, ldx, M, (const uint16_t *)p, K, N, gated, bias, y, ldy);
    case DS_PANEL_BF16DOT: return di_gemm_bf16dot(x, ldx, M, (const uint16_t *)p, K, N, gated, bias, y, ldy);
    default: return -1;
    }
}

/* x rows dense, y [M, N] */
static int project_panels(const di_ds_weight w, const float *x, int64_t M, const float *bias, float *y) {
    return project_panels_ld(w, x, w[4], M, bias, y, w[3]);
}

/* y [M, N] = x [M, K] @ W.T (+ bias): packed panels as native.linear computes them, or blocks as
 * QuantLinear's call in this mode (exact: below PANEL_M rows
 * RowKernel, from there project_exact; int8: qlinear's quantise-then-integer-dot path, level 1, or
 * from outer_rows rows qlinear_int8_outer where it runs) */
static int project(const di_ds_model *m, const scratch *s, const di_ds_weight w, const float *x, int64_t M,
                   const float *bias, float *y) {
    int rc;
    const int64_t N = w[3], K = w[4];
    if (w[2] >= DS_PANEL_F32) return project_panels(w, x, M, bias, y) ? DS_KERNEL : DS_OK;
    if (m->mode == DI_Q_EXACT) {
        rc = project_exact(m, w, x, M, y);
    } else if (M >= ((w[2] == FMT_Q4_0 || w[2] == FMT_Q4_1) ? m->outer_rows_q4 : m->outer_rows) &&
               !di_qgemm_outer_i8(x, K, M, (const uint8_t *)(intptr_t)w[0], w[1], (int)w[2], N, K, y, N)) {
        rc = 0;
    } else {
        rc = di_q8_quantize_rows(x, K, M, K, s->qx, s->xs, s->xsum);
        if (!rc)
            rc = di_qgemm(DI_Q_INT8, 1, 0, 0, s->qx, s->xs, s->xsum, M, (const uint8_t *)(intptr_t)w[0], w[1],
                          (int)w[2], N, K, y, N);
    }
    if (!rc && bias)
        for (int64_t r = 0; r < M; ++r)
            for (int64_t n = 0; n < N; ++n) y[r * N + n] += bias[n];
    return rc ? DS_KERNEL : DS_OK;
}

/* the experts' grouped call (moe_gemm.moe_experts' arguments): pairs' outputs to y, or with wts their
 * slot combine to out */
static int run_experts(const di_ds_model *m, const di_ds_moe *e, const float *x, int64_t M, int64_t k,
                       const int64_t *idx, float *h, float *y, const float *wts, float *out) {
    const int64_t hid = m->hidden, E = e->experts, I = e->inter, xE = e->shared;
    switch (e->kind) {
    case DS_EXPERTS_F32:
        return di_moe_experts_f32(x, hid, M, k, idx, E, (const float *)e->gate_up, (const float *)e->down, xE,
                                  (const float *)e->shared_gate_up, (const float *)e->shared_down, hid, I, h, y, hid,
                                  wts, 0, 0, out, hid);
    case DS_EXPERTS_BF16:
        return di_moe_experts_bf16(x, hid, M, k, idx, E, (const uint16_t *)e->gate_up, (const uint16_t *)e->down, xE,
                                   (const uint16_t *)e->shared_gate_up, (const uint16_t *)e->shared_down, hid, I, h, y,
                                   hid, wts, 0, 0, out, hid);
    case DS_EXPERTS_BF16DOT:
        return di_moe_experts_bf16dot(x, hid, M, k, idx, E, (const uint16_t *)e->gate_up, (const uint16_t *)e->down,
                                      xE, (const uint16_t *)e->shared_gate_up, (const uint16_t *)e->shared_down, hid,
                                      I, h, y, hid, wts, 0, 0, out, hid);
    default: return -1;
    }
}

/* out [M, hidden] = an MoE layer on x: MoeBlock.forward's calls (the router's logits, route, the
 * experts with the slot combine in one call, a shared expert's chunks as slots k.. weighted 1, or with
 * a shared-expert gate sigmoid(x . gate) (its panels, then di_sigmoid_f32), as NativeExperts.combined
 * appends them) with the same arguments. Without a router (router[0] 0):
 * a dense gated MLP packed as a one-expert stack (expert_kernels.NativeGatedMlp): every row to expert
 * 0, its output straight to out. */
static int moe_mlp(const di_ds_model *m, const scratch *s, const di_ds_moe *e, const float *x, int64_t M, float *out) {
    int rc;
    if (!e->router[0]) {
        for (int64_t t = 0; t < M; ++t) s->ridx[t] = 0;
        rc = run_experts(m, e, x, M, 1, s->ridx, s->mh, out, 0, 0);
    } else {
        const int64_t E = e->experts;
        if (project_panels(e->router, x, M, 0, s->logits)) return DS_KERNEL;
        if (di_moe_route_f32(s->logits, E, M, E, e->score_bias, (int)e->scoring, e->n_group, e->topk_group,
                             (int)e->group_score, e->top_k, (int)e->norm, e->eps, e->scale, s->rw, s->ridx))
            return DS_NO_MEMORY;
        const int64_t k = e->top_k, xE = e->shared;
        const float *wts = s->rw;
        const int64_t *idx = s->ridx;
        if (xE) { /* [routed slots | the shared chunks], weights [routed | 1, or the gate] */
            float *gate = NULL;
            if (e->shared_gate[0]) { /* the router's logits are consumed: their scratch holds the gate's */
                gate = s->logits;
                if (project_panels(e->shared_gate, x, M, 0, gate)) return DS_KERNEL;
                di_sigmoid_f32(gate, M, gate);
            }
            for (int64_t t = 0; t < M; ++t) {
                for (int64_t j = 0; j < k; ++j) {
                    s->ridx2[t * (k + xE) + j] = s->ridx[t * k + j];
                    s->rw2[t * (k + xE) + j] = s->rw[t * k + j];
                }
                for (int64_t j = 0; j < xE; ++j) {
                    s->ridx2[t * (k + xE) + k + j] = E + j;
                    s->rw2[t * (k + xE) + k + j] = gate ? gate[t] : 1.f;
                }
            }
            wts = s->rw2;
            idx = s->ridx2;
        }
        rc = run_experts(m, e, x, M, k + xE, idx, s->mh, s->my, wts, out);
    }
    return rc == -2 ? DS_NO_MEMORY : rc ? DS_KERNEL : DS_OK;
}

/* s->x [M, hidden] = a GQA attention block on s->h: q|k|v (+ bias), rotary + KV store (Qwen3's q/k
 * norms in it), attention over the paged cache, o */
static int gqa_attention(const di_ds_model *m, const scratch *s, const di_ds_layer *ly, const int64_t *slots,
                         const int64_t *idx, int64_t L, int64_t M) {
    const int64_t H = m->heads, Hkv = m->kv_heads, D = m->head_dim, qkv_n = (H + 2 * Hkv) * D;
    int rc;
    if ((rc = project(m, s, ly->qkv, s->h, M, ly->qkv_bias, s->qkv))) return rc;
    if (m->kv_bf16 ? di_rope_store_kv_bf16(s->qkv, qkv_n, M, H, Hkv, D, s->cs, s->sn, slots, m->slots, ly->k_cache,
                                           ly->v_cache, s->q, ly->q_norm, ly->k_norm, m->eps)
                   : di_rope_store_kv_f32(s->qkv, qkv_n, M, H, Hkv, D, s->cs, s->sn, slots, m->slots, ly->k_cache,
                                          ly->v_cache, s->q, ly->q_norm, ly->k_norm, m->eps))
        return DS_BAD_SLOT;
    if (m->kv_bf16 ? di_token_attention_bf16(s->q, H * D, D, ly->k_cache, ly->v_cache, idx, L, s->rowid, s->lens,
                                             s->att, M, H, Hkv, D, L, m->scale)
                   : di_token_attention_f32(s->q, H * D, D, ly->k_cache, ly->v_cache, idx, L, s->rowid, s->lens,
                                            s->att, M, H, Hkv, D, L, m->scale))
        return DS_NO_MEMORY;
    return project(m, s, ly->o, s->att, M, 0, s->x);
}

/* s->x [M, hidden] = a latent attention block on s->h: MlaAttention.forward's calls with the same
 * arguments (q_a or q, kv_a, the q_a norm and q_b, rope and the cache entries, each head's absorbed
 * query, the attention over the latent entries as one KV head, each head's value projection, o). */
static int mla_attention(const di_ds_model *m, const scratch *s, const di_ds_layer *ly, const int64_t *slots,
                         const int64_t *idx, int64_t L, int64_t M) {
    const di_ds_mla *a = ly->mla;
    const int64_t H = m->heads, r = m->mla_r, rope = m->mla_rope, nope = m->mla_nope, v = m->mla_v;
    const int64_t qk = nope + rope, E = r + rope;
    int rc;
    if (m->mla_q_lora) {
        if ((rc = project(m, s, a->q_a, s->h, M, 0, s->lqa))) return rc;
        di_add_rmsnorm_f32(s->lqa, 0, a->q_a_norm, a->q_a_eps, s->lqn, 0, M, m->mla_q_lora);
        if ((rc = project(m, s, a->q_b, s->lqn, M, 0, s->lq))) return rc;
    } else if ((rc = project(m, s, a->q_a, s->h, M, 0, s->lq))) {
        return rc;
    }
    if ((rc = project(m, s, a->kv_a, s->h, M, 0, s->lckv))) return rc;
    if (m->kv_bf16 ? di_mla_rope_latent_bf16(s->lq, H * qk, s->lckv, E, M, H, nope, rope, r, s->cs, s->sn,
                                             a->kv_a_norm, a->kv_a_eps, (int)a->interleave, slots, m->slots,
                                             ly->k_cache, s->lqf)
                   : di_mla_rope_latent_f32(s->lq, H * qk, s->lckv, E, M, H, nope, rope, r, s->cs, s->sn,
                                            a->kv_a_norm, a->kv_a_eps, (int)a->interleave, slots, m->slots,
                                            ly->k_cache, s->lqf))
        return DS_BAD_SLOT;
    for (int64_t h = 0; h < H; ++h)
        if (project_panels_ld(a->uk[h], s->lq + h * qk, H * qk, M, 0, s->lqf + h * E, H * E)) return DS_KERNEL;
    if (m->kv_bf16 ? di_token_attention_bf16(s->lqf, H * E, E, ly->k_cache, ly->k_cache, idx, L, s->rowid, s->lens,
                                             s->latt, M, H, 1, E, L, a->scale)
                   : di_token_attention_f32(s->lqf, H * E, E, ly->k_cache, ly->k_cache, idx, L, s->rowid, s->lens,
                                            s->latt, M, H, 1, E, L, a->scale))
        return DS_NO_MEMORY;
    for (int64_t h = 0; h < H; ++h)
        if (project_panels_ld(a->uv[h], s->latt + h * E, H * E, M, 0, s->lout + h * v, H * v)) return DS_KERNEL;
    return project(m, s, ly->o, s->lout, M, 0, s->x);
}

/* x_in [M, hidden]: the token embeddings; pos, slots: int64 [M]; bt: int64 block tables [M, bt_ld];
 * out [M, hidden]: the hidden states after the first n_layers layers and the final norm. The token of
 * row t sits at position pos[t] of its sequence, whose context is positions 0..pos[t] (this token
 * included: its KV is written to slots[t] first). Returns DS_OK, or a DS_* error (nothing past the
 * failing op is computed). */
int di_decode_stack(const di_ds_model *m, int64_t n_layers, const float *x_in, int64_t M, const int64_t *pos,
                    const int64_t *slots, const int64_t *bt, int64_t bt_ld, float *out) {
    if (M < 1 || M > m->max_rows || n_layers < 1 || n_layers > m->n_layers) return DS_BAD_SHAPE;
    scratch s;
    carve(m, (char *)m->work, &s);
    const int64_t D = m->head_dim, hid = m->hidden, I = m->inter, bs = m->block_size;
    int64_t L = 0;
    for (int64_t t = 0; t < M; ++t) {
        if (pos[t] < 0 || pos[t] >= m->positions || pos[t] / bs >= bt_ld) return DS_BAD_POSITION;
        s.lens[t] = pos[t] + 1;
        s.rowid[t] = t;
        if (s.lens[t] > L) L = s.lens[t];
        memcpy(s.cs + t * D, m->cos + pos[t] * D, sizeof(float) * (size_t)D);
        memcpy(s.sn + t * D, m->sin + pos[t] * D, sizeof(float) * (size_t)D);
    }
    /* each row's context slots, as the runner's _context_slots lays them out (row t: idx[t, 0..lens[t])) */
    int64_t *idx = (int64_t *)malloc(sizeof(int64_t) * (size_t)(M * L));
    if (!idx) return DS_NO_MEMORY;
    for (int64_t t = 0; t < M; ++t) {
        const int64_t *b = bt + t * bt_ld;
        for (int64_t j = 0; j < s.lens[t]; ++j) {
            const int64_t slot = b[j / bs] * bs + j % bs;
            if (slot < 0 || slot >= m->slots) {
                free(idx);
                return DS_BAD_SLOT;
            }
            idx[t * L + j] = slot;
        }
    }
    int rc = DS_OK;
    const float *residual = x_in; /* layer 0: the embeddings (not written), then s.res in place */
    for (int64_t l = 0; l < n_layers && !rc; ++l) {
        const di_ds_layer *ly = &m->layers[l];
        if (l == 0) di_add_rmsnorm_f32(x_in, 0, ly->in_norm, m->eps, s.h, 0, M, hid);
        else di_add_rmsnorm_f32(s.x, residual, ly->in_norm, m->eps, s.h, s.res, M, hid);
        rc = ly->mla ? mla_attention(m, &s, ly, slots, idx, L, M) : gqa_attention(m, &s, ly, slots, idx, L, M);
        if (rc) break;
        di_add_rmsnorm_f32(s.x, residual, ly->post_norm, m->eps, s.h, s.res, M, hid);
        residual = s.res;
        if (ly->moe) {
            rc = moe_mlp(m, &s, ly->moe, s.h, M, s.x);
        } else if (ly->gate_up[2] >= DS_PANEL_F32 && ly->gate_up[1]) { /* silu * mul in the GEMM */
            if ((rc = project(m, &s, ly->gate_up, s.h, M, 0, s.act))) break;
            rc = project(m, &s, ly->down, s.act, M, 0, s.x);
        } else {
            if ((rc = project(m, &s, ly->gate_up, s.h, M, 0, s.gu))) break;
            di_silu_mul_f32(s.gu, 2 * I, M, I, s.act);
            rc = project(m, &s, ly->down, s.act, M, 0, s.x);
        }
    }
    free(idx);
    if (rc) return rc;
    di_add_rmsnorm_f32(s.x, residual, m->final_norm, m->eps, out, s.res, M, hid);
    return DS_OK;
}
