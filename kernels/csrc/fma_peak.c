/* This CPU's fp32 multiply-add peak as the native kernels can reach it: every thread of torch's
 * OpenMP pool runs CHAINS independent 16-float multiply-add chains (a = a * b + c; the library is
 * built with -ffp-contract=fast, so one FMA each), registers only, no memory traffic. Enough chains
 * to cover the FMA latency (Zen 4: one 512-bit FMA a cycle on two 256-bit pipes, 4 cycles' latency,
 * so 4 in flight; 12 also cover cores with two 512-bit pipes).
 *
 * benchmarks/moe.py sets the model-FLOP rates of DeepInfer and transformers against it: a rate near
 * it cannot be raised by any kernel, only by doing fewer FLOPs or cheaper ones. Measured on the 2-core
 * Zen 4 host: 215-234 GFLOP/s with two threads (115 with one), while the engine's dense fp32 GEMM ran
 * 216-223 GFLOP/s.
 *
 * With b = 0.5 and c = 1 every chain converges to 2 (exactly, after ~28 steps in fp32 from starts up
 * to 14): past that *sum is 2 x 16 x CHAINS x threads, which the caller checks (the loop really ran).
 */
#include <stdint.h>

#include "vec16.h"

#define CHAINS 12

int64_t di_fma_peak_f32(int64_t iters, double *sum) {
    int64_t flops = 0;
    double total = 0;
#pragma omp parallel reduction(+ : flops, total)
    {
        volatile float seed = 3.f, b_in = 0.5f, c_in = 1.f; /* unknown to the compiler: no folding */
        const v16 b = splat16(b_in), c = splat16(c_in);
        /* twelve named chains (an array of them was kept on the stack: a load and a store per FMA) */
        const v16 s0 = splat16(seed);
        v16 a0 = s0, a1 = s0 + 1.f, a2 = s0 + 2.f, a3 = s0 + 3.f, a4 = s0 + 4.f, a5 = s0 + 5.f;
        v16 a6 = s0 + 6.f, a7 = s0 + 7.f, a8 = s0 + 8.f, a9 = s0 + 9.f, a10 = s0 + 10.f, a11 = s0 + 11.f;
        for (int64_t n = 0; n < iters; ++n) {
            a0 = a0 * b + c, a1 = a1 * b + c, a2 = a2 * b + c, a3 = a3 * b + c;
            a4 = a4 * b + c, a5 = a5 * b + c, a6 = a6 * b + c, a7 = a7 * b + c;
            a8 = a8 * b + c, a9 = a9 * b + c, a10 = a10 * b + c, a11 = a11 * b + c;
        }
        const v16 s = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)) + ((a8 + a9) + (a10 + a11));
        total += (double)hsum16(s);
        flops += 2 * 16 * CHAINS * iters;
    }
    *sum = total;
    return flops;
}
