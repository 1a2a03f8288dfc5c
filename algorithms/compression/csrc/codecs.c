/* The quantizers' and top-k's loops (the API and the ISA macros: fs_kernels.h). */
#include <string.h>
#include <math.h>

#include "fs_kernels.h"

/* Outputs over this many bytes are written with streaming stores (no read for ownership
   of their lines; they would not stay in cache anyway). */
#define STREAM_BYTES ((int64_t)8 << 20)

/* Bit e % 8 of byte e / 8 of `bits` is [x[e] >= 0] (false for NaN, true for -0.0). */
static inline uint8_t byte_ge0(const float *p) {
#if FS_AVX2
    return (uint8_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p), _mm256_setzero_ps(), _CMP_GE_OQ));
#else
    uint8_t b = 0;
    for (int j = 0; j < 8; j++) b |= (uint8_t)((p[j] >= 0.0f) << j);
    return b;
#endif
}

/* Pack [x[e] >= 0] for e in [lo, hi). Whole bytes are assigned; the partial bytes at
   either end are OR-ed into (the caller zeroes `bits` first). */
static void pack_ge0(const float *x, int64_t lo, int64_t hi, uint8_t *bits) {
    int64_t e = lo;
    for (; e < hi && (e & 7); e++)
        if (x[e] >= 0.0f) bits[e >> 3] |= (uint8_t)(1u << (e & 7));
    for (; e + 8 <= hi; e += 8) bits[e >> 3] = byte_ge0(x + e);
    for (; e < hi; e++)
        if (x[e] >= 0.0f) bits[e >> 3] |= (uint8_t)(1u << (e & 7));
}

/* Sign codec, encode: pack x[0:n] >= 0 into `bits` (zeroed by the caller) and return
   sum |x| accumulated in double (8 lanes, then added up). */
double fs_sign_encode(const float *x, int64_t n, uint8_t *bits) {
    double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t e = 0;
#if FS_AVX2
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (; e + 8 <= n; e += 8) {
        __m256 v = _mm256_loadu_ps(x + e);
        bits[e >> 3] = (uint8_t)_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GE_OQ));
        __m256 a = _mm256_and_ps(v, absmask);
        a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(a)));
        a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)));
    }
    _mm256_storeu_pd(lane, a0);
    _mm256_storeu_pd(lane + 4, a1);
#else
    for (; e + 8 <= n; e += 8) {
        bits[e >> 3] = byte_ge0(x + e);
        for (int j = 0; j < 8; j++) lane[j] += fabs((double)x[e + j]);
    }
#endif
    for (; e < n; e++) {
        if (x[e] >= 0.0f) bits[e >> 3] |= (uint8_t)(1u << (e & 7));
        lane[e & 7] += fabs((double)x[e]);
    }
    return ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
}

/* out[e] = lut[8 * byte + bit] for e in [0, n): one table of 256 x 8 floats. */
void fs_lut_decode(const uint8_t *bits, int64_t n, const float *lut, float *out) {
    int64_t full = n >> 3;
    for (int64_t i = 0; i < full; i++) memcpy(out + 8 * i, lut + 8 * (int64_t)bits[i], 32);
    for (int64_t e = 8 * full; e < n; e++) out[e] = lut[8 * (int64_t)bits[full] + (e & 7)];
}

#if FS_AVX2
/* max(v, 0) and min(v, 0) of values already in float64 (exact: float32 -> float64 is);
   the operand order keeps the float32 form's sums: a NaN goes to the min's sum only */
#define POS(a) _mm256_max_pd((a), _mm256_setzero_pd())
#define NEG(a) _mm256_min_pd(_mm256_setzero_pd(), (a))
#define LO(v) _mm256_cvtps_pd(_mm256_castps256_ps128(v)) /* floats 0-3 of v in float64 */
#define HI(v) _mm256_cvtps_pd(_mm256_extractf128_ps((v), 1)) /* floats 4-7 */
/* the positive parts of a (floats 0-3) and b (4-7) into p0, p1, the negative parts into q0, q1 */
#define SUMS(p0, p1, q0, q1, a, b) do { \
        p0 = _mm256_add_pd(p0, POS(a)); p1 = _mm256_add_pd(p1, POS(b)); \
        q0 = _mm256_add_pd(q0, NEG(a)); q1 = _mm256_add_pd(q1, NEG(b)); \
    } while (0)
#endif

#if FS_AVX512
/* onebit_encode's inner loop with AVX-512, 16 columns at a time from column c0 on, rows
   r0..r1 (one block): the same sums in the same order as the AVX2 loop, bit for bit (a
   masked add of v where v >= 0 adds what max(v, 0) adds: an add of +-0 leaves a sum as
   it is; NaN fails the compare and goes to the negatives' sum, as with min), counts and
   bits from the compare's mask. Rows r1..r2 (the next block) are prefetched a line per
   row per step: without it the 8 interleaved row streams read at ~2/3 of the speed of
   one. Returns the first column not done. */
static int64_t onebit_cols16(const float *restrict t, int64_t off, int64_t cols, int64_t r0, int64_t r1, int64_t r2,
                             int64_t c0, double *restrict sp, double *restrict sn, int64_t *restrict cnt,
                             uint8_t *restrict bits, int fused) {
#define LO8(v) _mm512_cvtps_pd(_mm512_castps512_ps256(v))
#define HI8(v) _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)))
#define ADD16(p0, p1, q0, q1, v, g) do { __m512d a_ = LO8(v), b_ = HI8(v); \
        __mmask8 l_ = (__mmask8)(g), h_ = (__mmask8)((g) >> 8); \
        p0 = _mm512_mask_add_pd(p0, l_, p0, a_); q0 = _mm512_mask_add_pd(q0, (__mmask8)~l_, q0, a_); \
        p1 = _mm512_mask_add_pd(p1, h_, p1, b_); q1 = _mm512_mask_add_pd(q1, (__mmask8)~h_, q1, b_); \
    } while (0)
    const __m512i one = _mm512_set1_epi32(1);
    for (; c0 + 16 <= cols; c0 += 16) {
        for (int64_t i = r1; i < r2; i++) __builtin_prefetch(t + i * cols + c0);
        __m512d p0 = _mm512_loadu_pd(sp + c0), p1 = _mm512_loadu_pd(sp + c0 + 8);
        __m512d q0 = _mm512_loadu_pd(sn + c0), q1 = _mm512_loadu_pd(sn + c0 + 8);
        __m512d e0 = _mm512_setzero_pd(), e1 = e0, f0 = e0, f1 = e0;
        __m512i m = _mm512_setzero_si512();
        int64_t r = r0;
        for (; r + 2 <= r1; r += 2) {
            __m512 v = _mm512_loadu_ps(t + r * cols + c0), v2 = _mm512_loadu_ps(t + (r + 1) * cols + c0);
            __mmask16 g = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GE_OQ);
            __mmask16 g2 = _mm512_cmp_ps_mask(v2, _mm512_setzero_ps(), _CMP_GE_OQ);
            ADD16(p0, p1, q0, q1, v, g);
            ADD16(e0, e1, f0, f1, v2, g2);
            m = _mm512_mask_add_epi32(m, g, m, one);
            m = _mm512_mask_add_epi32(m, g2, m, one);
            if (fused) {
                uint16_t w = g, w2 = g2;
                memcpy(bits + ((off + r * cols + c0) >> 3), &w, 2);
                memcpy(bits + ((off + (r + 1) * cols + c0) >> 3), &w2, 2);
            }
        }
        if (r < r1) { /* an odd block's last row */
            __m512 v = _mm512_loadu_ps(t + r * cols + c0);
            __mmask16 g = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GE_OQ);
            ADD16(p0, p1, q0, q1, v, g);
            m = _mm512_mask_add_epi32(m, g, m, one);
            if (fused) {
                uint16_t w = g;
                memcpy(bits + ((off + r * cols + c0) >> 3), &w, 2);
            }
        }
        _mm512_storeu_pd(sp + c0, _mm512_add_pd(p0, e0));
        _mm512_storeu_pd(sp + c0 + 8, _mm512_add_pd(p1, e1));
        _mm512_storeu_pd(sn + c0, _mm512_add_pd(q0, f0));
        _mm512_storeu_pd(sn + c0 + 8, _mm512_add_pd(q1, f1));
        _mm512_storeu_si512(cnt + c0, _mm512_add_epi64(_mm512_loadu_si512(cnt + c0),
                                                       _mm512_cvtepi32_epi64(_mm512_castsi512_si256(m))));
        _mm512_storeu_si512(cnt + c0 + 8, _mm512_add_epi64(_mm512_loadu_si512(cnt + c0 + 8),
                                                           _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(m, 1))));
    }
#undef ADD16
#undef HI8
#undef LO8
    return c0;
}
#endif

/* 1-bit SGD, encode, one tensor: x points at the flat vector, the tensor is the
   rows x cols matrix at offset `off`. Adds per column the sum of max(v, 0) (sp), of
   min(v, 0) (sn, as v - max(v, 0), exact) and the count of v >= 0 (cnt), row after
   row in float64 (with AVX2, even and odd rows of a block in two sums added at its end),
   and packs the tensor's bits (x >= 0) into `bits` (zeroed by the caller). */
static void onebit_encode(const float *restrict x, int64_t off, int64_t rows, int64_t cols, double *restrict sp,
                          double *restrict sn, int64_t *restrict cnt, uint8_t *restrict bits) {
    const float *t = x + off;
    if (cols == 1) { /* one column: 8 lanes over the flat range */
        double p[8] = {0}, q[8] = {0};
        int64_t c[8] = {0};
        for (int64_t i = 0; i < rows; i++) {
            float v = t[i], w = v >= 0.0f ? v : 0.0f;
            p[i & 7] += w;
            q[i & 7] += (double)(v - w);
            c[i & 7] += v >= 0.0f;
        }
        for (int j = 0; j < 8; j++) {
            sp[0] += p[j];
            sn[0] += q[j];
            cnt[0] += c[j];
        }
        pack_ge0(x, off, off + rows, bits);
        return;
    }
    int64_t block = 4096 / cols; /* rows per block: about 16 KB, still in cache when packed */
    if (block < 1) block = 1;
#if FS_AVX2
    /* whole bytes of bits per 8 columns of a row: packed in the same pass as the sums */
    const int fused = (off & 7) == 0 && (cols & 7) == 0;
#else
    const int fused = 0;
#endif
    for (int64_t r0 = 0; r0 < rows; r0 += block) {
        int64_t r1 = r0 + block < rows ? r0 + block : rows, c0 = 0;
#if FS_AVX2
        int64_t r2 = r1 + block < rows ? r1 + block : rows; /* the next block, prefetched */
#endif
#if FS_AVX512
        c0 = onebit_cols16(t, off, cols, r0, r1, r2, c0, sp, sn, cnt, bits, fused);
#endif
#if FS_AVX2
        for (; c0 + 8 <= cols; c0 += 8) { /* 8 columns' sums in registers down the block */
            for (int64_t i = r1; i < r2; i++) __builtin_prefetch(t + i * cols + c0);
            __m256d p0 = _mm256_loadu_pd(sp + c0), p1 = _mm256_loadu_pd(sp + c0 + 4);
            __m256d q0 = _mm256_loadu_pd(sn + c0), q1 = _mm256_loadu_pd(sn + c0 + 4);
            __m256i m = _mm256_setzero_si256(); /* this block's counts, 32 bits (at most 4096 rows) */
            /* two rows at a time into two sets of float64 sums (even and odd rows), added at
               the end of the block: half the add latency chain per row, every term still exact
               in float64 (so a column of copies of one value has that value as its mean) */
            __m256d e0 = _mm256_setzero_pd(), e1 = _mm256_setzero_pd();
            __m256d f0 = _mm256_setzero_pd(), f1 = _mm256_setzero_pd();
            int64_t r = r0;
            for (; r + 2 <= r1; r += 2) {
                __m256 v = _mm256_loadu_ps(t + r * cols + c0), v2 = _mm256_loadu_ps(t + (r + 1) * cols + c0);
                __m256 ge = _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GE_OQ);
                __m256 ge2 = _mm256_cmp_ps(v2, _mm256_setzero_ps(), _CMP_GE_OQ);
                __m256d a = LO(v), b = HI(v);
                __m256d a2 = LO(v2), b2 = HI(v2);
                SUMS(p0, p1, q0, q1, a, b);
                SUMS(e0, e1, f0, f1, a2, b2);
                m = _mm256_sub_epi32(m, _mm256_castps_si256(ge)); /* ge is -1 where v >= 0 */
                m = _mm256_sub_epi32(m, _mm256_castps_si256(ge2));
                if (fused) {
                    bits[(off + r * cols + c0) >> 3] = (uint8_t)_mm256_movemask_ps(ge);
                    bits[(off + (r + 1) * cols + c0) >> 3] = (uint8_t)_mm256_movemask_ps(ge2);
                }
            }
            if (r < r1) { /* an odd block's last row */
                __m256 v = _mm256_loadu_ps(t + r * cols + c0);
                __m256 ge = _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GE_OQ);
                __m256d a = LO(v), b = HI(v);
                SUMS(p0, p1, q0, q1, a, b);
                m = _mm256_sub_epi32(m, _mm256_castps_si256(ge));
                if (fused) bits[(off + r * cols + c0) >> 3] = (uint8_t)_mm256_movemask_ps(ge);
            }
            p0 = _mm256_add_pd(p0, e0);
            p1 = _mm256_add_pd(p1, e1);
            q0 = _mm256_add_pd(q0, f0);
            q1 = _mm256_add_pd(q1, f1);
            __m256i m0 = _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)(cnt + c0)),
                                          _mm256_cvtepi32_epi64(_mm256_castsi256_si128(m)));
            __m256i m1 = _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)(cnt + c0 + 4)),
                                          _mm256_cvtepi32_epi64(_mm256_extracti128_si256(m, 1)));
            _mm256_storeu_pd(sp + c0, p0);
            _mm256_storeu_pd(sp + c0 + 4, p1);
            _mm256_storeu_pd(sn + c0, q0);
            _mm256_storeu_pd(sn + c0 + 4, q1);
            _mm256_storeu_si256((__m256i *)(cnt + c0), m0);
            _mm256_storeu_si256((__m256i *)(cnt + c0 + 4), m1);
        }
#endif
        for (int64_t r = r0; r < r1 && c0 < cols; r++) {
            const float *row = t + r * cols;
            for (int64_t c = c0; c < cols; c++) {
                float v = row[c], w = v >= 0.0f ? v : 0.0f;
                sp[c] += w;
                sn[c] += (double)(v - w);
                cnt[c] += v >= 0.0f;
            }
        }
        if (!fused) pack_ge0(x, off + r0 * cols, off + r1 * cols, bits);
    }
}

/* The same over a layout of n tensors (tensor i: rows[i] x cols[i] at off[i]); the
   per-column outputs of the tensors follow each other (sum of cols entries). */
void fs_onebit_encode(const float *x, int64_t n, const int64_t *off, const int64_t *rows, const int64_t *cols,
                      double *sp, double *sn, int64_t *cnt, uint8_t *bits) {
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++) {
        onebit_encode(x, off[i], rows[i], cols[i], sp + c, sn + c, cnt + c, bits);
        c += cols[i];
    }
}

static inline float pick(const uint8_t *bits, int64_t e, float a0, float a1) {
    return (bits[e >> 3] >> (e & 7)) & 1 ? a1 : a0;
}

/* Store 8 floats at o: streamed past the caches (nt, o 32-byte aligned) or plain. */
#if FS_AVX2
static inline void put8(float *o, __m256 v, int nt) {
    if (nt) _mm256_stream_ps(o, v);
    else _mm256_storeu_ps(o, v);
}
#endif

/* 1-bit SGD, decode, one tensor: out (the flat vector) at e = off + r * cols + c gets
   a1[c] where bit e is set, else a0[c]; with cols == 1, a0[0] / a1[0] for the whole
   range. A pure select: the stored floats come back bit for bit. `nt`: an output too
   large to stay in cache is streamed to memory (no read for ownership of its lines). */
static void onebit_decode(const uint8_t *bits, int64_t off, int64_t rows, int64_t cols, const float *a0,
                          const float *a1, float *out, int nt) {
#if !FS_AVX2
    (void)nt; /* plain stores only */
#endif
    if (cols == 1) {
        float z = a0[0], o = a1[0];
        int64_t e = off, hi = off + rows;
        for (; e < hi && (e & 7); e++) out[e] = pick(bits, e, z, o);
#if FS_AVX2
        const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        const __m256 vz = _mm256_set1_ps(z), vo = _mm256_set1_ps(o);
        const int s = nt && ((uintptr_t)(out + e) & 31) == 0;
        for (; e + 8 <= hi; e += 8) {
            __m256i m = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bits[e >> 3]), sel), sel);
            put8(out + e, _mm256_blendv_ps(vz, vo, _mm256_castsi256_ps(m)), s);
        }
#endif
        for (; e < hi; e++) out[e] = pick(bits, e, z, o);
        return;
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t e0 = off + r * cols, c = 0;
        float *o = out + e0;
        for (; c < cols && ((e0 + c) & 7); c++) o[c] = pick(bits, e0 + c, a0[c], a1[c]);
#if FS_AVX2
        const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        const int s = nt && ((uintptr_t)(o + c) & 31) == 0;
        for (; c + 8 <= cols; c += 8) {
            __m256i m = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bits[(e0 + c) >> 3]), sel), sel);
            put8(o + c, _mm256_blendv_ps(_mm256_loadu_ps(a0 + c), _mm256_loadu_ps(a1 + c),
                                         _mm256_castsi256_ps(m)), s);
        }
#endif
        for (; c < cols; c++) o[c] = pick(bits, e0 + c, a0[c], a1[c]);
    }
}

/* The same over a layout (see fs_onebit_encode); a0 and a1 hold each tensor's columns
   one after another. Outputs over 8 MB are streamed (see onebit_decode). */
void fs_onebit_decode(const uint8_t *bits, int64_t n, const int64_t *off, const int64_t *rows, const int64_t *cols,
                      const float *a0, const float *a1, float *out) {
    int64_t c = 0, end = 0;
    for (int64_t i = 0; i < n; i++)
        if (off[i] + rows[i] * cols[i] > end) end = off[i] + rows[i] * cols[i];
    const int nt = end * (int64_t)sizeof(float) > STREAM_BYTES;
    for (int64_t i = 0; i < n; i++) {
        onebit_decode(bits, off[i], rows[i], cols[i], a0 + c, a1 + c, out, nt);
        c += cols[i];
    }
#if FS_AVX2
    if (nt) _mm_sfence(); /* the streamed stores are visible before the caller reads `out` */
#endif
}

/* Sparse decode: out[0:n] = 0 except out[idx[i]] = val[i] (i < m, idx in [0, n), checked
   by the caller). The zeros of an output over 8 MB are streamed past the caches (no read
   for ownership of its lines: ~2/3 of the time of a cached fill), then fenced before the
   values are written. */
void fs_scatter_dense(float *out, int64_t n, const int64_t *idx, const float *val, int64_t m) {
    int64_t e = 0;
#if FS_AVX2
    if (n * (int64_t)sizeof(float) > STREAM_BYTES) {
        for (; e < n && ((uintptr_t)(out + e) & 31); e++) out[e] = 0.0f;
        const __m256 z = _mm256_setzero_ps();
        for (; e + 32 <= n; e += 32) {
            _mm256_stream_ps(out + e, z);
            _mm256_stream_ps(out + e + 8, z);
            _mm256_stream_ps(out + e + 16, z);
            _mm256_stream_ps(out + e + 24, z);
        }
        _mm_sfence();
    }
#endif
    if (e < n) memset(out + e, 0, (size_t)(n - e) * sizeof(float));
    for (int64_t i = 0; i < m; i++) out[idx[i]] = val[i];
}

/* Top-k candidates: the positions e in [0, n) with |x[e]| >= thr, ascending, into idx
   and their |x[e]| into val unless it is NULL (room for cap); returns how many there are
   (more than cap: only cap were written). */
int64_t fs_collect_abs_ge(const float *x, int64_t n, float thr, int64_t *idx, float *val, int64_t cap) {
    int64_t m = 0, e = 0;
#if FS_AVX2
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 vt = _mm256_set1_ps(thr);
    for (; e + 8 <= n; e += 8) {
        int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(x + e), absmask), vt, _CMP_GE_OQ));
        while (mask) {
            int j = __builtin_ctz(mask);
            if (m < cap) {
                idx[m] = e + j;
                if (val) val[m] = fabsf(x[e + j]);
            }
            m++;
            mask &= mask - 1;
        }
    }
#endif
    for (; e < n; e++)
        if (fabsf(x[e]) >= thr) {
            if (m < cap) {
                idx[m] = e;
                if (val) val[m] = fabsf(x[e]);
            }
            m++;
        }
    return m;
}

/* The exact top-k once the k-th largest magnitude t is known: the positions i of
   val[0:m] (|val[i]| if `absolute`, else val[i] itself), in order, of every one above t
   and then of the first ones equal to t until there are k, into pos. Returns how many. */
int64_t fs_top_positions(const float *val, int absolute, int64_t m, float t, int64_t k, int64_t *pos) {
    int64_t above = 0, w = 0;
    for (int64_t i = 0; i < m; i++) above += (absolute ? fabsf(val[i]) : val[i]) > t;
    int64_t ties = k - above;
    for (int64_t i = 0; i < m && w < k; i++) {
        float a = absolute ? fabsf(val[i]) : val[i];
        if (a > t || (a == t && ties-- > 0)) pos[w++] = i;
    }
    return w;
}

/* A float's bits as an unsigned key in the order of the values (|v| if `absolute`): NaN
   above +inf, as torch's sort and kthvalue place it. */
static inline uint32_t order_key(float v, int absolute) {
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    if (absolute) return b & 0x7fffffffu;
    return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}

/* The k-th largest (1 <= k <= m) of val[0:m], or of |val| if `absolute`: exactly the value
   torch's kthvalue(m - k + 1) gives, by a radix select on order_key, 11 + 11 + 10 bits
   (three passes over val, each counting the keys that share the prefix found so far). */
float fs_kth_largest(const float *val, int64_t m, int64_t k, int absolute) {
    static const int shift[3] = {21, 10, 0}, width[3] = {11, 11, 10};
    uint32_t prefix = 0, mask = 0;
    int64_t want = k; /* the want-th largest of the keys under the prefix */
    for (int pass = 0; pass < 3; pass++) {
        const uint32_t top = (1u << width[pass]) - 1;
        int64_t count[2048] = {0};
        for (int64_t i = 0; i < m; i++) {
            uint32_t key = order_key(val[i], absolute);
            if ((key & mask) == prefix) count[(key >> shift[pass]) & top]++;
        }
        uint32_t q = top;
        while (count[q] < want) want -= count[q--]; /* k <= m: stops at a bucket */
        prefix |= q << shift[pass];
        mask |= top << shift[pass];
    }
    uint32_t b = absolute ? prefix : ((prefix & 0x80000000u) ? prefix & 0x7fffffffu : ~prefix);
    float v;
    memcpy(&v, &b, sizeof v);
    return v;
}

/* Of the candidates idx[0:m] (ascending) with magnitudes val[0:m], 1 <= k <= m, write to
   out, in order, the top k: fs_top_positions with t the k-th largest magnitude
   (fs_kth_largest). Returns how many were written (k for finite magnitudes). */
int64_t fs_select_top(const float *val, const int64_t *idx, int64_t m, int64_t k, int64_t *out) {
    int64_t w = fs_top_positions(val, 0, m, fs_kth_largest(val, m, k, 0), k, out);
    for (int64_t i = 0; i < w; i++) out[i] = idx[out[i]]; /* out[i] >= i: read before written over */
    return w;
}

