/* Shared declarations of the quantised-weight kernels (qgemm.c: 32-element formats and the driver;
 * qgemm_k.c: GGUF k-quants; qgemm_i8.c: the int8 mode; qgemm_panel.c / qgemm_outer.c / qgemm_bf16.c / qgemm_i8_outer.c: many
 * rows), and
 * the entry points other kernels call (decode_stack.c). */
#ifndef DEEPINFER_QGEMM_H
#define DEEPINFER_QGEMM_H
#include <stdint.h>

#define QK 32    /* elements per block of Q4_0 / Q4_1 / Q8_0, and per activation block of the int8 mode */
#define QK_K 256 /* elements per super-block of Q4_K / Q6_K */
enum { FMT_Q4_0 = 2, FMT_Q4_1 = 3, FMT_Q8_0 = 8, FMT_Q4_K = 12, FMT_Q6_K = 14 }; /* ggml type ids */
enum { DI_Q_EXACT = 0, DI_Q_INT8 = 1 };

/* y = x @ W.T (qgemm.c's driver; mode DI_Q_EXACT reads x, DI_Q_INT8 qx / xs / xsum) and the same for a
 * weight bound once, wargs = {W's address, row bytes, format, N, K} (quant.RowKernel) */
int di_qgemm(int mode, int level, const float *x, int64_t ldx, const int8_t *qx, const float *xs, const float *xsum,
             int64_t M, const uint8_t *w, int64_t row_bytes, int fmt, int64_t N, int64_t K, float *y, int64_t ldy);
int di_qgemm_exact_bound(const int64_t *wargs, const float *x, int64_t M, float *y);
int di_qgemm_int8_bound(const int64_t *wargs, const float *x, int64_t M, float *y);

int di_q_block_bytes(int fmt);
int di_q_block_elems(int fmt);
int di_q_cpu_level(void); /* 0 scalar, 1 AVX2 + FMA + F16C, 2 also AVX-512 F/BW/DQ/VL, 3 also AVX512_BF16 */
void di_q_set_level_cap(int cap);
float di_q_half(uint16_t h);

/* one weight row of K elements as fp32 (any format); avx2: use the AVX2 code */
void di_q_dequant_row(int fmt, int avx2, const uint8_t *row, int64_t K, float *out);

/* k-quants: one row of W against up to 4 rows of x (exact) or of qx/xs/xsum (int8) */
void di_qk_dequant_row(int fmt, int avx2, const uint8_t *row, int64_t K, float *out);
void di_qk_tile(int mode, int level, int fmt, const uint8_t *wrow, int64_t K, const float *x, int64_t ldx,
                const int8_t *qx, const float *xs, const float *xsum, int mr, float *y, int64_t ldy);

/* the int8 mode of the 32-element formats (qgemm_i8.c): rows n0 <= n < n1 of W for all M rows of x */
int di_q8_quantize_rows(const float *x, int64_t ldx, int64_t M, int64_t K, int8_t *qx, float *scale, float *bsum);
void di_qi8_chunk(int fmt, int level, const uint8_t *w, int64_t rb, int64_t n0, int64_t n1, const int8_t *qx,
                  const float *xs, const float *xsum, int64_t M, int64_t K, float *y, int64_t ldy);
#endif
