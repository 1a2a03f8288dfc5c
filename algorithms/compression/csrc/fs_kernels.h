/* The codecs' fused CPU loops: the library's whole API. Every function the library exports is
   declared here with FS_API (the build hides all other symbols), and native.py derives its
   ctypes signatures from these lines, so a prototype is written once: the compiler holds each
   definition to it, ctypes calls through it. Pointers become c_void_p; the scalar types are
   int, int64_t, float and double (native.py refuses any other). What each loop computes is
   said above its definition (codecs.c, countsketch.c). */
#ifndef FS_KERNELS_H
#define FS_KERNELS_H

#include <stdint.h>

#define FS_API __attribute__((visibility("default")))

/* The instruction-set level the loops are compiled for, from the compiler's -march: one
   of these three branches is taken in every loop that has vector code. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define FS_AVX512 1
#else
#define FS_AVX512 0
#endif
#if defined(__AVX2__)
#define FS_AVX2 1
#else
#define FS_AVX2 0
#endif
#if FS_AVX2
#include <immintrin.h>
#endif

/* Build: the level compiled in ("avx512", "avx2" or "scalar"), and whether this CPU runs it. */
FS_API const char *fs_isa(void);
FS_API int fs_cpu_ok(void);

/* Quantizers (codecs.c). */
FS_API double fs_sign_encode(const float *x, int64_t n, uint8_t *bits);
FS_API void fs_lut_decode(const uint8_t *bits, int64_t n, const float *lut, float *out);
FS_API void fs_onebit_encode(const float *x, int64_t n, const int64_t *off, const int64_t *rows,
                             const int64_t *cols, double *sp, double *sn, int64_t *cnt, uint8_t *bits);
FS_API void fs_onebit_decode(const uint8_t *bits, int64_t n, const int64_t *off, const int64_t *rows,
                             const int64_t *cols, const float *a0, const float *a1, float *out);

/* Top-k and sparse decode (codecs.c). */
FS_API void fs_scatter_dense(float *out, int64_t n, const int64_t *idx, const float *val, int64_t m);
FS_API int64_t fs_collect_abs_ge(const float *x, int64_t n, float thr, int64_t *idx, float *val, int64_t cap);
FS_API float fs_kth_largest(const float *val, int64_t m, int64_t k, int absolute);
FS_API int64_t fs_select_top(const float *val, const int64_t *idx, int64_t m, int64_t k, int64_t *out);

/* Count Sketch (countsketch.c). */
FS_API float fs_cs_sample_threshold(const float *table, int64_t r, int64_t n, const int64_t *cell,
                                    const int8_t *sign, int64_t rank, float *g);
FS_API int64_t fs_cs_top(const int64_t *cols, const float *vals, int64_t m, int64_t k, int64_t *out_cols,
                         float *out_vals, int64_t *tmp_cols, float *tmp_vals);
FS_API void fs_sketch(const float *x, int64_t d, int64_t c, int64_t r, int64_t blocks, const int32_t *pi,
                      const int32_t *ldst, const int32_t *tauinv, const int64_t *shifts, const uint8_t *neg,
                      float *acc, float *ybuf);
FS_API int64_t fs_cs_scratch_words(int64_t r, int64_t c);
FS_API int64_t fs_cs_candidates(const float *rs, int64_t r, int64_t c, int64_t blocks, int64_t d,
                                const int64_t *shifts, const uint8_t *neg, const int32_t *pinv, float t,
                                uint64_t *scratch, int64_t cap, int64_t *cols, float *vals);

/* Shared by the two files, not exported: the positions of the top k of val[0:m] (|val| if
   `absolute`) given the k-th largest t (codecs.c). */
int64_t fs_top_positions(const float *val, int absolute, int64_t m, float t, int64_t k, int64_t *pos);

#endif
