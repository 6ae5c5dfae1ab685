/* The level deepinfer_kernels.cpu chose, for every kernel of this build (cpu_level.h). */
#include "cpu_level.h"

static volatile int cpu_level = 0, cpu_vnni = 0;

/* level: cpu.kernel_level(); vnni: the CPU's VNNI may be used at this level. Returns the level now in
 * force: `level` bounded by what this build was compiled for (a caller that gets less refuses it). */
int di_cpu_set(int level, int vnni) {
    cpu_level = level < 0 ? 0 : level > DI_BUILD_LEVEL ? DI_BUILD_LEVEL : level;
    cpu_vnni = vnni != 0;
    return cpu_level;
}

int di_cpu_level(void) { return cpu_level; }

int di_cpu_vnni_at(int level) {
#ifdef DI_HAVE_VNNI
    return cpu_vnni && level >= DI_VNNI_LEVEL;
#else
    (void)level;
    return 0;
#endif
}
