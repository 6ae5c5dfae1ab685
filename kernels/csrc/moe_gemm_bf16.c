/* The grouped expert kernel over bf16 weights (di_moe_experts_bf16): moe_gemm.c compiled again with
 * its weights' storage type set to bf16 (see the MOE_BF16 note there). */
#define MOE_BF16 1
#include "moe_gemm.c"
