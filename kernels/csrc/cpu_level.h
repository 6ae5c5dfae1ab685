/* The CPU level the native library runs at: set once, when deepinfer_kernels.native loads the
 * library, from deepinfer_kernels.cpu (di_cpu_set), and never above what this build was compiled for
 * (one build per level, see cpu.py). The only CPU knowledge the kernels use at run time: nothing here
 * asks the CPU itself, so DEEPINFER_CPU=avx2 on an AVX-512 machine runs exactly an AVX2 machine's code. */
#ifndef DEEPINFER_CPU_LEVEL_H
#define DEEPINFER_CPU_LEVEL_H

/* 0 generic, 1 AVX2 + FMA + F16C, 2 also AVX-512 F/BW/DQ/VL, 3 also AVX512_BF16 */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#if defined(__AVX512BF16__)
#define DI_BUILD_LEVEL 3
#else
#define DI_BUILD_LEVEL 2
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define DI_BUILD_LEVEL 1
#else
#define DI_BUILD_LEVEL 0
#endif

/* vpdpbusd for the int8 dot products: AVX512_VNNI (from level 2) or AVX-VNNI (from level 1), where
 * this level's build has it (compiled in only where the CPU has it: cpu.compiler_flags) */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DI_HAVE_VNNI 1
#define DI_VNNI_LEVEL 2
#define DI_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define DI_HAVE_VNNI 1
#define DI_VNNI_LEVEL 1
#define DI_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif

int di_cpu_level(void);
/* 1 where the int8 dot products use vpdpbusd at kernel level `level` (a test's cap included) */
int di_cpu_vnni_at(int level);

#endif
