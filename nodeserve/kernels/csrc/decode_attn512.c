/* Decode attention with AVX-512 for head_dim 64 and 128: one query token of one sequence (or a verify step's rows
 * of one sequence, read together) against its K/V where they lie in the pages (float32, or float16 widened as it is
 * loaded). cpu_kernels.c's ns_paged_decode_attention_local calls it per sequence and keeps its AVX2 loop for other
 * head sizes and for machines without AVX-512F.
 *
 * The AVX2 kernel's shape (flash-decoding on one core: page by page, an online softmax per head, each page's K
 * and V read from memory once and kept in L1 while every head reads its part) at twice the width, and with the
 * softmax vectorised: a head's q is D/16 registers; 16 keys' dot products accumulate in 16 registers, and one
 * transpose-reduce (hsum16x16) leaves their 16 scores in one register, so the max, the exp and the sum of 16 keys
 * are one vector op each. Softmax in base 2 (q pre-scaled by log2 e; exp2_ps in simd512.h).
 */
#include <math.h>
#include <stdint.h>
#include <stddef.h>
#include <string.h>

#include "decode_attn.h"
#include "simd512.h"

#define KEYS 16  /* keys per block: one score register */

#if NS_AVX512
/* [sum(a[0]), ..., sum(a[15])]: each level adds halves of two vectors, so a lane only ever sums its own key's
 * partials (a key past the page's end stays in its own lane, where the caller masks it). */
static inline __m512 hsum16x16(const __m512 a[KEYS]) {
    __m512 c[8], d[4], e[2];
    for (int i = 0; i < 8; i++)  /* c[i]: 128-bit lanes 0-1 key 2i, 2-3 key 2i + 1 */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xee));
    for (int i = 0; i < 4; i++)  /* d[i]: 128-bit lane L key 4i + L */
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xdd));
    for (int i = 0; i < 2; i++)  /* e[i]: 128-bit lane L keys 8i + L, 8i + 4 + L (two floats each) */
        e[i] = _mm512_add_ps(_mm512_shuffle_ps(d[2 * i], d[2 * i + 1], 0x88),
                             _mm512_shuffle_ps(d[2 * i], d[2 * i + 1], 0xdd));
    const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xdd));
    /* f[4L + m] is key 4m + L */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), f);
}

/* 16 values of a float32 or (f16) float16 pool at p, as float32. */
static inline __attribute__((always_inline)) __m512 kv_load16(const char *p, const int f16) {
    return f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)) : _mm512_loadu_ps((const float *)p);
}

/* max(x) in every lane: no scalar round trip in the softmax's chain. */
static inline __m512 allmax(__m512 x) {
    x = _mm512_max_ps(x, _mm512_shuffle_f32x4(x, x, 0x4e));
    x = _mm512_max_ps(x, _mm512_shuffle_f32x4(x, x, 0xb1));
    x = _mm512_max_ps(x, _mm512_shuffle_ps(x, x, 0x4e));
    return _mm512_max_ps(x, _mm512_shuffle_ps(x, x, 0xb1));
}

/* Rows of one sequence (R of them: a verify step's, core/speculation.py), head_dim 16 * D16: every query head (H,
 * G per KV head) of row r over keys first[r] .. len[r] - 1 of `table`'s pages (first > 0: a sliding window). Pages
 * before first's are never read, nor are the slots before first on its page: they may be freed and hold anything,
 * NaN included. Page by page, each row in turn: a page is read from memory once for all the rows, and each row's
 * arithmetic is the one it would have alone (the same pages in the same order), bit for bit.
 * q, out [R, H, D]; m, l: R H floats of scratch (running max and sum). */
static inline __attribute__((always_inline)) void attend_rows(
        const int D16, const int f16, const float *q, int64_t R, int64_t H, int64_t G, const void *kv,
        const int64_t *table, const int64_t *first, const int64_t *len, int64_t page_size, int64_t token_stride,
        float scale, float *m, float *l, float *out, ns_seq_pages next, int asked) {
    int64_t lo = first[0], hi = len[0];  /* the keys any row reads */
    for (int64_t r = 1; r < R; r++) {
        lo = first[r] < lo ? first[r] : lo;
        hi = len[r] > hi ? len[r] : hi;
    }
    const ns_seq_pages seq = ns_read_pages(table, lo, hi, page_size);
    const int64_t es = f16 ? 2 : 4, D = 16 * D16, page_stride = 2 * page_size * token_stride;
    const int64_t page_bytes = page_stride * es, row = token_stride * es;  /* bytes */
    const __m512 vscale = _mm512_set1_ps(scale * 1.4426950408889634f);  /* log2 e: softmax in base 2 */
    for (int64_t g = 0; g < R * H; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    memset(out, 0, sizeof(float) * (size_t)(R * H * D));
    const int64_t fp = lo / page_size;  /* the first page read: the prefetch counts from it */
    for (int64_t t0 = fp * page_size; t0 < hi; t0 += page_size) {
        const char *page = (const char *)kv + table[t0 / page_size] * page_bytes;
        const int64_t ip = t0 / page_size, share = (page_bytes / 64 + H - 1) / H * 64;
        int prefetched = 0;
        for (int64_t r = 0; r < R; r++) {
            if (t0 >= len[r] || t0 + page_size <= first[r]) continue;  /* not one of row r's pages */
            const int64_t n_page = len[r] - t0 < page_size ? len[r] - t0 : page_size;
            const int64_t j_lo = t0 < first[r] ? first[r] - t0 : 0;
            const float *qr = q + r * H * D;
            float *outr = out + r * H * D, *mr = m + r * H, *lr = l + r * H;
            for (int64_t g = 0; g < H; g++) {  /* head g reads KV head g / G */
                if (!prefetched)  /* once a page, spread over the first row's heads */
                    ns_prefetch_page_share(kv, seq, next, asked, ip - fp, page_bytes, g * share, share);
                const char *kh = page + (g / G) * D * es, *vh = kh + page_size * row;
                __m512 vq[8], o[8], o2[8];
                for (int c = 0; c < D16; c++) {
                    vq[c] = _mm512_mul_ps(_mm512_loadu_ps(qr + g * D + 16 * c), vscale);
                    o[c] = _mm512_loadu_ps(outr + g * D + 16 * c);
                }
                /* lg: the running sum spread over the lanes (l in lane 0), summed once after the page */
                __m512 mg = _mm512_set1_ps(mr[g]), lg = _mm512_maskz_mov_ps(1, _mm512_set1_ps(lr[g]));
                for (int64_t j0 = j_lo; j0 < n_page; j0 += KEYS) {
                    const int64_t n = n_page - j0 < KEYS ? n_page - j0 : KEYS;
                    __m512 acc[KEYS];
                    for (int j = 0; j < KEYS; j++) {
                        if (j >= n) { acc[j] = _mm512_setzero_ps(); continue; }
                        const char *k = kh + (j0 + j) * row;
                        acc[j] = _mm512_mul_ps(vq[0], kv_load16(k, f16));
                        for (int c = 1; c < D16; c++)
                            acc[j] = _mm512_fmadd_ps(vq[c], kv_load16(k + 16 * c * es, f16), acc[j]);
                    }
                    const __mmask16 valid = (__mmask16)((1u << n) - 1);
                    const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, hsum16x16(acc));
                    const __m512 mx = _mm512_max_ps(mg, allmax(s));
                    const __m512 corr = exp2_ps(_mm512_sub_ps(mg, mx));  /* 0 on the first block (mg = -inf) */
                    const __m512 p = _mm512_maskz_mov_ps(valid, exp2_ps(_mm512_sub_ps(s, mx)));
                    lg = _mm512_fmadd_ps(lg, corr, p);
                    mg = mx;
                    for (int c = 0; c < D16; c++) {
                        o[c] = _mm512_mul_ps(o[c], corr);
                        o2[c] = _mm512_setzero_ps();
                    }
                    int64_t j = 0;
                    for (; j + 2 <= n; j += 2) {  /* two chains: the multiply-add latency overlaps */
                        const char *v = vh + (j0 + j) * row;
                        const __m512 w0 = _mm512_permutexvar_ps(_mm512_set1_epi32((int)j), p);
                        const __m512 w1 = _mm512_permutexvar_ps(_mm512_set1_epi32((int)j + 1), p);
                        for (int c = 0; c < D16; c++) {
                            o[c] = _mm512_fmadd_ps(w0, kv_load16(v + 16 * c * es, f16), o[c]);
                            o2[c] = _mm512_fmadd_ps(w1, kv_load16(v + row + 16 * c * es, f16), o2[c]);
                        }
                    }
                    if (j < n) {
                        const char *v = vh + (j0 + j) * row;
                        const __m512 w0 = _mm512_permutexvar_ps(_mm512_set1_epi32((int)j), p);
                        for (int c = 0; c < D16; c++) o[c] = _mm512_fmadd_ps(w0, kv_load16(v + 16 * c * es, f16), o[c]);
                    }
                    for (int c = 0; c < D16; c++) o[c] = _mm512_add_ps(o[c], o2[c]);
                }
                for (int c = 0; c < D16; c++) _mm512_storeu_ps(outr + g * D + 16 * c, o[c]);
                mr[g] = _mm512_cvtss_f32(mg);
                lr[g] = _mm512_reduce_add_ps(lg);
            }
            prefetched = 1;
        }
    }
    for (int64_t g = 0; g < R * H; g++) {
        const __m512 inv = _mm512_set1_ps(1.0f / l[g]);
        for (int c = 0; c < D16; c++)
            _mm512_storeu_ps(out + g * D + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(out + g * D + 16 * c), inv));
    }
}

/* One function per head size and dtype, each compiled as a loop of its own. */
#define NS_ATTEND_FN(name, D16, f16)                                                                             \
    static __attribute__((noinline)) void name(const float *q, int64_t R, int64_t H, int64_t G, const void *kv,  \
                                               const int64_t *table, const int64_t *first, const int64_t *len,   \
                                               int64_t page_size, int64_t ts, float scale, float *m, float *l,   \
                                               float *out, ns_seq_pages next, int asked) {                       \
        attend_rows(D16, f16, q, R, H, G, kv, table, first, len, page_size, ts, scale, m, l, out, next, asked);  \
    }
NS_ATTEND_FN(attend_d64, 4, 0)
NS_ATTEND_FN(attend_d64_f16, 4, 1)
NS_ATTEND_FN(attend_d128, 8, 0)
NS_ATTEND_FN(attend_d128_f16, 8, 1)
#undef NS_ATTEND_FN
#endif

/* out [R, H, D] = R query rows q [R, H, D] of one sequence (a verify step's, or one decode), row r over its keys
 * first[r] .. len[r] - 1 in `table`'s pages of one pool layer kv [num_pages, 2, page_size, KH, D], float32 or
 * (kv_f16) float16; m_l: 2 R H floats of scratch. Returns 0, or -1 when this build or head size has no kernel here
 * (the caller runs its own). */
int ns_decode_attend_rows512(const float *q, int64_t R, const void *kv, const int64_t *table, const int64_t *first,
                             const int64_t *len, float *out, int64_t H, int64_t KH, int64_t D, int64_t page_size,
                             float scale, float *m_l, int kv_f16, ns_seq_pages next, int asked) {
#if NS_AVX512
    const int64_t G = H / KH, ts = KH * D;
    float *m = m_l, *l = m_l + R * H;
    void (*fn)(const float *, int64_t, int64_t, int64_t, const void *, const int64_t *, const int64_t *,
               const int64_t *, int64_t, int64_t, float, float *, float *, float *, ns_seq_pages, int) =
        D == 64 ? (kv_f16 ? attend_d64_f16 : attend_d64) : D == 128 ? (kv_f16 ? attend_d128_f16 : attend_d128) : NULL;
    if (!fn) return -1;
    fn(q, R, H, G, kv, table, first, len, page_size, ts, scale, m, l, out, next, asked);
    return 0;
#else
    (void)q; (void)R; (void)kv; (void)table; (void)first; (void)len; (void)out; (void)H; (void)KH; (void)D;
    (void)page_size; (void)scale; (void)m_l; (void)kv_f16; (void)next; (void)asked;
    return -1;
#endif
}
