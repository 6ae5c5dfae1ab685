/* The projection GEMM over an fp16 checkpoint's weights as stored (di_gemm_f16): gemm.c compiled
 * again with its panels' storage type set to fp16 (see the GEMM_F16 note there). */
#define GEMM_F16 1
#include "gemm.c"
