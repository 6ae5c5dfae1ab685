/* fp32 -> bf16 for a KV cache: rounded to nearest even, any NaN -> 0xFFFF. What torch's tensor conversion
 * (Tensor.to(torch.bfloat16), vectorised on CPU) gives, bit for bit, so a cache entry written by a native
 * kernel (rope_store_kv.c, mla_rope_latent.c) and one written by torch's index_copy_ of x.to(bfloat16)
 * agree. */
#ifndef DEEPINFER_KV_BF16_H
#define DEEPINFER_KV_BF16_H
#include <stdint.h>
#include <string.h>

static inline uint16_t kv_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffff;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#endif
