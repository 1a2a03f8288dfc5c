/* Count Sketch's loops (the API and the ISA macros: fs_kernels.h). */
#include <string.h>
#include <math.h>

#include "fs_kernels.h"

/* Count Sketch unsketch, the first step for one client: the threshold t, the rank-th
   largest |estimate| (fs_kth_largest) over a fixed sample of n coordinates, an estimate
   being the lower median over the r rows of sign[j][i] * S[cell[j][i]] (cell = j * c +
   h_j(i); sign +1 or -1, int8), i.e. CountSketch._estimate_at, abs and topk. The terms are
   gathered row by row into g (room for r * n floats: independent loads), then sorted
   across the rows by an odd-even transposition network of min/max over whole rows (r
   rounds, vectorized; a per-coordinate insertion sort ran 4x slower on its branches). */
float fs_cs_sample_threshold(const float *table, int64_t r, int64_t n, const int64_t *cell, const int8_t *sign,
                             int64_t rank, float *restrict g) {
    for (int64_t j = 0; j < r; j++)
        for (int64_t i = 0; i < n; i++) {
            float e = table[cell[j * n + i]];
            g[j * n + i] = sign[j * n + i] < 0 ? -e : e;
        }
    for (int64_t round = 0; round < r; round++)
        for (int64_t q = round & 1; q + 1 < r; q += 2) {
            float *restrict a = g + q * n, *restrict b = g + (q + 1) * n;
            for (int64_t i = 0; i < n; i++) {
                float lo = a[i] < b[i] ? a[i] : b[i], hi = a[i] < b[i] ? b[i] : a[i];
                a[i] = lo;
                b[i] = hi;
            }
        }
    return fs_kth_largest(g + (r - 1) / 2 * n, n, rank, 1);
}

/* Count Sketch unsketch, the last step for one client: of the m >= k candidates
   (coordinate cols[i] < 2^62, estimate vals[i]; coordinates distinct) keep every one with
   |val| > t and then the first ones (in candidate order) with |val| == t until there are
   k, t being the k-th largest |val| (fs_kth_largest, fs_top_positions: codecs.c);
   write them to out_cols / out_vals in ascending coordinate order (an LSD radix sort, 11
   bits a pass, through tmp_cols / tmp_vals, each room for k). Returns how many were kept
   (k for finite estimates). */
int64_t fs_cs_top(const int64_t *cols, const float *vals, int64_t m, int64_t k, int64_t *out_cols,
                  float *out_vals, int64_t *tmp_cols, float *tmp_vals) {
    int64_t w = fs_top_positions(vals, 1, m, fs_kth_largest(vals, m, k, 1), k, tmp_cols), top = 0;
    for (int64_t i = 0; i < w; i++) {
        out_cols[i] = cols[tmp_cols[i]];
        out_vals[i] = vals[tmp_cols[i]];
        if (out_cols[i] > top) top = out_cols[i];
    }
    int64_t *kc = out_cols, *kc2 = tmp_cols;
    float *kv = out_vals, *kv2 = tmp_vals;
    for (int shift = 0; shift == 0 || (top >> shift) > 0; shift += 11) {
        int64_t count[2049] = {0};
        for (int64_t i = 0; i < w; i++) count[((kc[i] >> shift) & 2047) + 1]++;
        for (int q = 0; q < 2048; q++) count[q + 1] += count[q];
        for (int64_t i = 0; i < w; i++) {
            int64_t at = count[(kc[i] >> shift) & 2047]++;
            kc2[at] = kc[i];
            kv2[at] = kv[i];
        }
        int64_t *tc = kc; kc = kc2; kc2 = tc;
        float *tv = kv; kv = kv2; kv2 = tv;
    }
    if (kc != out_cols) { /* an odd number of passes: the result is in tmp */
        memcpy(out_cols, kc, (size_t)w * sizeof(int64_t));
        memcpy(out_vals, kv, (size_t)w * sizeof(float));
    }
    return w;
}

/* Block b of y, the block permuted by pi (y[pi[p]] = x[b*c + p]; zero at the slots of
   missing positions p >= n in a short block), into y (c floats). y is in cache and x is
   read in order: the hardware prefetcher streams x from memory (the kernel before this
   one gathered y in slot order, i.e. read x at random places of a block, and took ~10 ms
   at d = 1e7, c = 1e5, r = 5 where this one takes ~6: a C harness, the two interleaved).
   pi's line structure (countsketch.py): with `ldst` given (else NULL), position line P
   (positions 16P..16P+15, P < c / 16) is slot line ldst[P], its 16 values in the order
   tauinv (y[16 ldst[P] + l] = x[b*c + 16P + tauinv[l]], what pi says), so a line is one
   64-byte load, with AVX-512 one in-register permute, and one store; the other positions
   (the last c % 16, those of a short block's last line, or all of them without ldst) go
   one at a time through pi (int32, c < 2^31). */
static void sketch_block(const float *restrict xb, int64_t n, int64_t c, const int32_t *pi, const int32_t *ldst,
                         const int32_t *tauinv, float *restrict y) {
    const int64_t nl = ldst ? c / 16 : 0, whole = n / 16 < nl ? n / 16 : nl; /* lines of x to move whole */
    if (n < c) memset(y, 0, (size_t)c * sizeof(float));
#if FS_AVX512
    const __m512i tperm = ldst ? _mm512_loadu_si512(tauinv) : _mm512_setzero_si512();
#endif
    for (int64_t P = 0; P < whole; P++) {
        const float *src = xb + 16 * P;
        float *dst = y + 16 * (int64_t)ldst[P];
#if FS_AVX512
        _mm512_storeu_ps(dst, _mm512_permutexvar_ps(tperm, _mm512_loadu_ps(src)));
#else
        for (int l = 0; l < 16; l++) dst[l] = src[tauinv[l]];
#endif
    }
    for (int64_t p = 16 * whole; p < n; p++) y[pi[p]] = xb[p];
}

/* Count Sketch, one client, block-shift hashes (see countsketch.py): for each block b
   of c coordinates (the last may be shorter: n = min(c, d - b*c)), y_b = the block
   permuted by pi (sketch_block), and row j of acc (c floats per row, zeroed by the caller)
   gets acc[j][(shift[j][b] + u) mod c] += y_b[u], or -= where neg[j][b]: blocks in order,
   so every cell sums its terms in the order of the eager code (the same bits).
   SKETCH_GROUP blocks at a time (fewer in the last group): their y in ybuf (room for
   min(SKETCH_GROUP, blocks) * c floats, the caller's), then each row once for the group,
   cell m getting its G terms in one pass, from the windows y_g[(m - shift) mod c] (cut
   where one of them wraps). The table (r * c floats: 2 MB at r = 5, c = 1e5) is larger
   than a core's L2, so every pass over it is traffic to L3: one pass per group instead of
   one per block took the encode from ~6.8 to ~5.9 ms at d = 1e7 (a C harness). */
enum { SKETCH_GROUP = 4 };

void fs_sketch(const float *restrict x, int64_t d, int64_t c, int64_t r, int64_t blocks, const int32_t *pi,
               const int32_t *ldst, const int32_t *tauinv, const int64_t *shifts, const uint8_t *neg,
               float *restrict acc, float *restrict ybuf) {
    for (int64_t b0 = 0; b0 < blocks; b0 += SKETCH_GROUP) {
        const int G = blocks - b0 < SKETCH_GROUP ? (int)(blocks - b0) : SKETCH_GROUP;
        for (int g = 0; g < G; g++) {
            int64_t lo = (b0 + g) * c;
            sketch_block(x + lo, d - lo < c ? d - lo : c, c, pi, ldst, tauinv, ybuf + g * c);
        }
        for (int64_t j = 0; j < r; j++) {
            int64_t sh[SKETCH_GROUP], cut[SKETCH_GROUP + 2];
            float sg[SKETCH_GROUP];
            int nc = 0;
            cut[nc++] = 0;
            for (int g = 0; g < G; g++) {
                sh[g] = shifts[j * blocks + b0 + g];
                sg[g] = neg[j * blocks + b0 + g] ? -1.0f : 1.0f; /* sg * y is exact: the same sums */
                cut[nc++] = sh[g];
            }
            cut[nc++] = c;
            for (int a = 1; a < nc; a++) /* sorted: between two cuts no window wraps */
                for (int q = a; q > 0 && cut[q - 1] > cut[q]; q--) {
                    int64_t t = cut[q];
                    cut[q] = cut[q - 1];
                    cut[q - 1] = t;
                }
            float *row = acc + j * c;
            for (int q = 0; q + 1 < nc; q++) {
                int64_t lo = cut[q], hi = cut[q + 1];
                const float *p[SKETCH_GROUP]; /* p[g][m] = y_g[(m - sh[g]) mod c] for m in [lo, hi) */
                for (int g = 0; g < G; g++) p[g] = ybuf + g * c + (lo >= sh[g] ? -sh[g] : c - sh[g]);
                if (G == 4) {
                    const float *p0 = p[0], *p1 = p[1], *p2 = p[2], *p3 = p[3];
                    const float a0 = sg[0], a1 = sg[1], a2 = sg[2], a3 = sg[3];
                    for (int64_t m = lo; m < hi; m++)
                        row[m] = (((row[m] + a0 * p0[m]) + a1 * p1[m]) + a2 * p2[m]) + a3 * p3[m];
                } else {
                    for (int g = 0; g < G; g++) {
                        const float *pg = p[g], ag = sg[g];
                        for (int64_t m = lo; m < hi; m++) row[m] += ag * pg[m];
                    }
                }
            }
        }
    }
}

/* Bit-sliced counters: add word w to the count whose bit k is plane[k] (np planes). */
static inline void count_add(uint64_t *plane, int np, uint64_t w) {
    for (int k = 0; k < np; k++) { /* no early exit: a data-dependent branch costs more */
        uint64_t t = plane[k] & w;
        plane[k] ^= w;
        w = t;
    }
}

/* Per bit, whether the count (np planes) is at least q: compared from the top bit down. */
static inline uint64_t count_ge(const uint64_t *plane, int np, int64_t q) {
    uint64_t gt = 0, eq = ~(uint64_t)0;
    for (int k = np - 1; k >= 0; k--) {
        if ((q >> k) & 1) eq &= plane[k];
        else {
            gt |= eq & plane[k];
            eq &= ~plane[k];
        }
    }
    return gt | eq;
}

#if FS_AVX512
/* count_add and count_ge on 8 words at a time */
static inline void count_add8(__m512i *plane, int np, __m512i w) {
    for (int k = 0; k < np; k++) {
        __m512i t = _mm512_and_si512(plane[k], w);
        plane[k] = _mm512_xor_si512(plane[k], w);
        w = t;
    }
}

static inline __m512i count_ge8(const __m512i *plane, int np, int64_t q) {
    __m512i gt = _mm512_setzero_si512(), eq = _mm512_set1_epi64(-1);
    for (int k = np - 1; k >= 0; k--) {
        if ((q >> k) & 1) eq = _mm512_and_si512(eq, plane[k]);
        else {
            gt = _mm512_or_si512(gt, _mm512_and_si512(eq, plane[k]));
            eq = _mm512_andnot_si512(plane[k], eq);
        }
    }
    return _mm512_or_si512(gt, eq);
}
#endif

/* The slots u0..u0+n of block b whose coordinates pass (see fs_cs_candidates), into hit
   (offsets from u0, ascending); returns how many. np: planes of the counters (a constant
   at each call, so that they are unrolled into registers). */
static inline __attribute__((always_inline)) int64_t
cs_hits(const uint64_t *hi_bits, const uint64_t *lo_bits, int64_t words, int64_t r, const int64_t *shifts,
        const uint8_t *neg, int64_t blocks, int64_t b, int64_t u0, int64_t n, const int np, int64_t q_hi,
        int64_t q_lo, int32_t *restrict hit) {
    const uint64_t *hp[64], *lp[64];
    uint64_t flip[64];
    int sh[64];
    for (int64_t j = 0; j < r; j++) { /* row j's window: from bit off, word by word */
        int64_t off = shifts[j * blocks + b] + u0;
        hp[j] = hi_bits + j * words + (off >> 6);
        lp[j] = lo_bits + j * words + (off >> 6);
        sh[j] = (int)(off & 63);
        flip[j] = -(uint64_t)neg[j * blocks + b]; /* sigma < 0: the two marks swap roles */
    }
    int64_t h = 0, u = 0, w = 0;
#if FS_AVX512
    for (; u + 512 <= n; u += 512, w += 8) { /* 512 slots: 8 words per row, shifted in-register */
        __m512i up[7], down[7];
        for (int k = 0; k < np; k++) up[k] = down[k] = _mm512_setzero_si512();
        for (int64_t j = 0; j < r; j++) { /* a vector shift by 64 gives 0: s = 0 needs no care */
            __m128i sr = _mm_cvtsi32_si128(sh[j]), sl = _mm_cvtsi32_si128(64 - sh[j]);
            __m512i ge = _mm512_or_si512(_mm512_srl_epi64(_mm512_loadu_si512(hp[j] + w), sr),
                                         _mm512_sll_epi64(_mm512_loadu_si512(hp[j] + w + 1), sl));
            __m512i le = _mm512_or_si512(_mm512_srl_epi64(_mm512_loadu_si512(lp[j] + w), sr),
                                         _mm512_sll_epi64(_mm512_loadu_si512(lp[j] + w + 1), sl));
            __m512i swap = _mm512_and_si512(_mm512_xor_si512(ge, le), _mm512_set1_epi64((long long)flip[j]));
            count_add8(up, np, _mm512_xor_si512(ge, swap));
            count_add8(down, np, _mm512_xor_si512(le, swap));
        }
        __m512i pass = _mm512_or_si512(count_ge8(up, np, q_hi), count_ge8(down, np, q_lo));
        for (unsigned nz = _mm512_test_epi64_mask(pass, pass); nz; nz &= nz - 1) {
            int q = __builtin_ctz(nz);
            uint64_t bits = (uint64_t)_mm_cvtsi128_si64(
                _mm512_castsi512_si128(_mm512_permutexvar_epi64(_mm512_set1_epi64(q), pass)));
            for (; bits; bits &= bits - 1) hit[h++] = (int32_t)(u + 64 * q + __builtin_ctzll(bits));
        }
    }
#endif
    for (; u < n; u += 64, w++) {
        uint64_t up[7] = {0, 0, 0, 0, 0, 0, 0}, down[7] = {0, 0, 0, 0, 0, 0, 0};
        for (int64_t j = 0; j < r; j++) { /* (x << 1) << (63 - s): no shift by 64 when s = 0 */
            uint64_t ge = (hp[j][w] >> sh[j]) | ((hp[j][w + 1] << 1) << (63 - sh[j]));
            uint64_t le = (lp[j][w] >> sh[j]) | ((lp[j][w + 1] << 1) << (63 - sh[j]));
            uint64_t swap = (ge ^ le) & flip[j];
            count_add(up, np, ge ^ swap);
            count_add(down, np, le ^ swap);
        }
        uint64_t pass = count_ge(up, np, q_hi) | count_ge(down, np, q_lo);
        if (n - u < 64) pass &= ((uint64_t)1 << (n - u)) - 1;
        for (; pass; pass &= pass - 1) hit[h++] = (int32_t)(u + __builtin_ctzll(pass));
    }
    return h;
}

/* Count Sketch unsketch candidates, one client (see CountSketch._unsketch_sparse): rs is
   the r rows rho * S[j] (c floats each). Coordinate i = b*c + pinv[u] (block b, slot u)
   has terms v_j = sigma[j][b] * rs[j][(shift[j][b] + u) mod c], and its lower median
   (rank p = (r - 1) / 2) has |median| >= t exactly when at least r - p terms are >= t or at
   least p + 1 are <= -t. So the kernel first marks, per row, the cells with rs >= t and
   those with rs <= -t as two bit rows (doubled: bit m and m + c are cell m, so a block's
   window never wraps; in `scratch`, room for fs_cs_scratch_words(r, c) words); a term of
   block b is >= t where row j's window at shift[j][b] has the first mark (the second when
   sigma[j][b] < 0) and <= -t where it has the other. Counting those marks 64 slots at a
   time with bit operations picks exactly the coordinates that pass (about a third of
   those with r - p heavy cells of either sign), and only those pay the r random reads of
   their terms for the median's value. Blocks and slots in order; writes at most cap
   (coordinate, median) pairs and returns how many there are (more than cap: call again
   with more room). The hits of a chunk of CS_HIT_CHUNK slots are listed first (in
   scratch, after the bit rows), then their terms gathered 16 hits at a time: long chunks
   fill the gathers (~10 hits in 4096 slots at d = 1e7, k = 1e4; 65536 slots took the
   kernel from ~1.25 to ~1.1 ms). r <= 64. */
enum { CS_HIT_CHUNK = 1 << 16 };

/* Words (uint64) of scratch that fs_cs_candidates needs for r rows of c cells. */
int64_t fs_cs_scratch_words(int64_t r, int64_t c) { return 2 * r * (2 * c / 64 + 2) + CS_HIT_CHUNK / 2; }

int64_t fs_cs_candidates(const float *rs, int64_t r, int64_t c, int64_t blocks, int64_t d, const int64_t *shifts,
                         const uint8_t *neg, const int32_t *pinv, float t, uint64_t *restrict scratch,
                         int64_t cap, int64_t *cols, float *vals) {
    enum { CH = CS_HIT_CHUNK };
    int64_t found = 0;
    const int64_t rank = (r - 1) / 2, q_hi = r - rank, q_lo = rank + 1, words = 2 * c / 64 + 2;
    uint64_t *hi_bits = scratch, *lo_bits = scratch + r * words; /* row j at j * words */
    int32_t *hit = (int32_t *)(scratch + 2 * r * words);
    int np = 0; /* bits of a count of up to r */
    while ((int64_t)1 << np <= r) np++;
    memset(scratch, 0, (size_t)(2 * r * words) * sizeof(uint64_t));
    for (int64_t j = 0; j < r; j++) {
        const float *row = rs + j * c;
        uint64_t *hb = hi_bits + j * words, *lb = lo_bits + j * words;
        int64_t m = 0;
#if FS_AVX512
        const __m512 vt = _mm512_set1_ps(t), vnt = _mm512_set1_ps(-t);
        for (; m + 16 <= 2 * c; m += 16) { /* 16 marks at once, unless the 16 cells wrap */
            int64_t at0 = m < c ? m : m - c;
            if (at0 + 16 > c) break;
            __m512 v = _mm512_loadu_ps(row + at0);
            uint16_t ge = _mm512_cmp_ps_mask(v, vt, _CMP_GE_OQ), le = _mm512_cmp_ps_mask(v, vnt, _CMP_LE_OQ);
            memcpy((uint16_t *)hb + (m >> 4), &ge, 2);
            memcpy((uint16_t *)lb + (m >> 4), &le, 2);
        }
#endif
        for (; m < 2 * c; m++) {
            float v = row[m < c ? m : m - c];
            hb[m >> 6] |= (uint64_t)(v >= t) << (m & 63);
            lb[m >> 6] |= (uint64_t)(v <= -t) << (m & 63);
        }
    }
    for (int64_t b = 0; b < blocks; b++) {
#if FS_AVX512
        const int64_t n_b = d - b * c < c ? d - b * c : c; /* block b's coordinates */
#endif
        for (int64_t u0 = 0; u0 < c; u0 += CH) {
            int64_t n = c - u0 < CH ? c - u0 : CH, h = 0;
            switch (np) { /* a constant np for the inlined counters: planes in registers */
            case 1: h = cs_hits(hi_bits, lo_bits, words, r, shifts, neg, blocks, b, u0, n, 1, q_hi, q_lo, hit); break;
            case 2: h = cs_hits(hi_bits, lo_bits, words, r, shifts, neg, blocks, b, u0, n, 2, q_hi, q_lo, hit); break;
            case 3: h = cs_hits(hi_bits, lo_bits, words, r, shifts, neg, blocks, b, u0, n, 3, q_hi, q_lo, hit); break;
            case 4: h = cs_hits(hi_bits, lo_bits, words, r, shifts, neg, blocks, b, u0, n, 4, q_hi, q_lo, hit); break;
            case 5: h = cs_hits(hi_bits, lo_bits, words, r, shifts, neg, blocks, b, u0, n, 5, q_hi, q_lo, hit); break;
            case 6: h = cs_hits(hi_bits, lo_bits, words, r, shifts, neg, blocks, b, u0, n, 6, q_hi, q_lo, hit); break;
            default: h = cs_hits(hi_bits, lo_bits, words, r, shifts, neg, blocks, b, u0, n, 7, q_hi, q_lo, hit);
            }
#if FS_AVX512
            /* 16 hits at a time: their r terms gathered row by row (independent loads, so
               their latencies overlap), the median by a min/max transposition sort */
            const __m512i vc = _mm512_set1_epi32((int)c);
            for (int64_t i = 0; i < h; i += 16) {
                __mmask16 live = h - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (h - i)) - 1);
                __m512i uu = _mm512_maskz_loadu_epi32(live, hit + i); /* slots from u0 */
                __m512 v[64];
                for (int64_t j = 0; j < r; j++) {
                    __m512i m = _mm512_add_epi32(uu, _mm512_set1_epi32((int)(shifts[j * blocks + b] + u0)));
                    m = _mm512_mask_sub_epi32(m, _mm512_cmpge_epi32_mask(m, vc), m, vc); /* mod c */
                    __m512 e = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, m, rs + j * c, 4);
                    v[j] = neg[j * blocks + b] ? _mm512_sub_ps(_mm512_setzero_ps(), e) : e;
                }
                for (int64_t round = 0; round < r; round++)
                    for (int64_t q = round & 1; q + 1 < r; q += 2) {
                        __m512 lo = _mm512_min_ps(v[q], v[q + 1]);
                        v[q + 1] = _mm512_max_ps(v[q], v[q + 1]);
                        v[q] = lo;
                    }
                /* keep the live hits of this block's n_b coordinates whose |median| >= t
                   (always, by the counts; kept as the definition), packed in registers
                   and stored whole where 16 more fit under cap (else one by one) */
                const __m512 med = v[(r - 1) / 2];
                const __m512i pos = _mm512_mask_i32gather_epi32(
                    _mm512_setzero_si512(), live, _mm512_add_epi32(uu, _mm512_set1_epi32((int)u0)), pinv, 4);
                const __mmask16 keep = live & _mm512_cmplt_epi32_mask(pos, _mm512_set1_epi32((int)n_b)) &
                                       _mm512_cmp_ps_mask(_mm512_abs_ps(med), _mm512_set1_ps(t), _CMP_GE_OQ);
                const __m512i kp = _mm512_maskz_compress_epi32(keep, pos);
                const __m512 kv = _mm512_maskz_compress_ps(keep, med);
                const int got = __builtin_popcount(keep);
                if (found + 16 <= cap) {
                    const __m512i base = _mm512_set1_epi64(b * c);
                    _mm512_storeu_ps(vals + found, kv);
                    const __m256i lo8 = _mm512_castsi512_si256(kp), hi8 = _mm512_extracti64x4_epi64(kp, 1);
                    _mm512_storeu_si512(cols + found, _mm512_add_epi64(base, _mm512_cvtepi32_epi64(lo8)));
                    _mm512_storeu_si512(cols + found + 8, _mm512_add_epi64(base, _mm512_cvtepi32_epi64(hi8)));
                } else {
                    int32_t kpos[16];
                    float kval[16];
                    _mm512_storeu_si512(kpos, kp);
                    _mm512_storeu_ps(kval, kv);
                    for (int q = 0; q < got && found + q < cap; q++) {
                        cols[found + q] = b * c + kpos[q];
                        vals[found + q] = kval[q];
                    }
                }
                found += got;
            }
#else
            enum { AHEAD = 8 };
            int64_t at[64 * (AHEAD + 1)];
            for (int64_t i = 0; i < h + AHEAD; i++) {
                if (i < h) { /* where hit i's terms are; prefetched AHEAD hits early */
                    int64_t *a = at + (i % (AHEAD + 1)) * 64;
                    for (int64_t j = 0; j < r; j++) {
                        int64_t m = shifts[j * blocks + b] + u0 + hit[i];
                        a[j] = j * c + (m >= c ? m - c : m);
                        __builtin_prefetch(rs + a[j]);
                    }
                    __builtin_prefetch(pinv + u0 + hit[i]);
                }
                if (i < AHEAD) continue;
                int64_t k = i - AHEAD, u = u0 + hit[k];
                int64_t coord = b * c + pinv[u];
                if (coord >= d) continue;
                const int64_t *a = at + (k % (AHEAD + 1)) * 64;
                float v[64];
                for (int64_t j = 0; j < r; j++) {
                    float e = neg[j * blocks + b] ? -rs[a[j]] : rs[a[j]];
                    int64_t p = j;
                    while (p > 0 && v[p - 1] > e) { v[p] = v[p - 1]; p--; }
                    v[p] = e;
                }
                float med = v[(r - 1) / 2];
                if (fabsf(med) >= t) { /* always, by the counts; kept as the definition */
                    if (found < cap) { cols[found] = coord; vals[found] = med; }
                    found++;
                }
            }
#endif
        }
    }
    return found;
}
