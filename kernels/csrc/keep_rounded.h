/* KEEP_ROUNDED(v): an opaque use of a value (a rounded product), so the compiler (the library is built
 * with -ffp-contract=fast) cannot fuse it into the next add as one fused multiply-add. In a register where
 * AVX is there (no instruction), else through a volatile copy. Shared by moe_gemm.c's slot combine and
 * mla_rope_latent.c's rotation, whose bits must be torch's separate multiply and add. */
#ifndef DEEPINFER_KEEP_ROUNDED_H
#define DEEPINFER_KEEP_ROUNDED_H
#if defined(__AVX__)
#define KEEP_ROUNDED(v) __asm__("" : "+x"(v))
#else
#define KEEP_ROUNDED(v) do { volatile __typeof__(v) keep_ = (v); (v) = keep_; } while (0)
#endif
#endif
