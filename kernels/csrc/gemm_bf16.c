/* The projection GEMM over a bf16 checkpoint's weights as stored (di_gemm_bf16): gemm.c compiled
 * again with its panels' storage type set to bf16 (see the GEMM_BF16 note there). */
#define GEMM_BF16 1
#include "gemm.c"
