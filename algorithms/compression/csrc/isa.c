/* What the library was built for: native.py checks it before any loop runs (a library built
   for a wider -march than this CPU's would stop the process on its first vector instruction). */
#include "fs_kernels.h"

const char *fs_isa(void) { return FS_AVX512 ? "avx512" : FS_AVX2 ? "avx2" : "scalar"; }

int fs_cpu_ok(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    return (!FS_AVX2 || (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) &&
           (!FS_AVX512 || (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")));
#else
    return 1; /* no vector branch off x86-64 */
#endif
}
