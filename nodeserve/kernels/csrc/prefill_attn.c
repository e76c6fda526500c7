/* Prefill attention over the paged KV pool with AVX-512: a chunk of Lq query tokens after num_prefix cached ones
 * (0 for a prompt's first chunk), query i seeing every key up to its own position (with a sliding window, only
 * its last `window` ones), K/V read where they lie in the pages (no gather, no mask tensor, no score past the
 * diagonal computed, no page before the chunk's first query's window read).
 *
 * Why by hand: torch's CPU flash attention takes no page table (the pages are gathered first) and no causal
 * offset (a chunk after a prefix needs a mask, or two calls merged by their log-sum-exps), and it runs on the
 * calling thread only; this one splits its tasks with a lent core (lend.c), so a long prompt's attention uses the
 * machine as its GEMMs do.
 *
 * Layout: lanes are query tokens. A task is 16 consecutive query tokens of one head; its Q is transposed to
 * qt[d] = (the 16 tokens' q[d]) and its scores for a block of up to 16 keys are 16 vectors s[j] (key j for the 16
 * tokens), so each multiply-add broadcasts one K (or V) value from a packed block and the online softmax's max and
 * sum over keys are vertical (no horizontal reductions). Softmax in base 2 (q pre-scaled by log2 e), exp2 by a
 * degree-7 polynomial and scalef (simd512.h).
 *
 * Tasks are handed out by an atomic counter, the longest first (the last query tokens see the most keys), so a
 * lent core takes tasks until its own device wants it back and finishes at most the one it is on (~0.1 ms).
 * Each task is computed whole by one thread: the output does not depend on the split.
 *
 * Builds without AVX-512 run prefill_attn_avx2.c's kernel (8 query tokens a task) behind the same entry point.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "prefill_attn.h"
#include "simd512.h"
#define NS_PREFILL NS_AVX512
#if NS_AVX512 && defined(__AVX512BF16__)
#define NS_PREFILL_BF16 1
#else
#define NS_PREFILL_BF16 0
#endif

#define LANES 16    /* query tokens per task, one per lane */
#define KEYS 16     /* keys per block: 16 score vectors */
#define MAX_D NS_PREFILL_MAX_D
#define MIN_SPLIT_PAIRS 4096

int ns_prefill_avx2_supported(void);  /* prefill_attn_avx2.c: builds without AVX-512 run that one */
int ns_prefill_attention_avx2(const float *q, int64_t ldq, const void *kv, const int64_t *table, int64_t num_prefix,
                              int64_t Lq, float *out, int64_t ldo, int64_t H, int64_t KH, int64_t D,
                              int64_t page_size, float scale, int kv_f16, int bf16, int64_t window);

int ns_prefill_supported(void) { return NS_PREFILL || ns_prefill_avx2_supported(); }
int ns_prefill_bf16_supported(void) { return NS_PREFILL_BF16; }

static int64_t num_tasks(const struct ns_prefill *a) { return prefill_num_tasks(a, LANES); }

typedef void (*ns_tasks_fn)(const void *ctx, atomic_long *next, const atomic_int *lent);
void ns_run_tasks(ns_tasks_fn fn, const void *ctx, int split_ok);  /* lend.c */

#if NS_PREFILL
/* out [0, D) = the pool's elements at .. at + D, as float32 (float16 widened, 16 at a time). */
static void widen_row(const void *kv, int64_t at, int f16, int64_t D, float *out) {
    if (!f16) {
        memcpy(out, (const float *)kv + at, sizeof(float) * (size_t)D);
        return;
    }
    const uint16_t *h = (const uint16_t *)kv + at;
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) _mm512_storeu_ps(out + d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + d))));
    for (; d < D; d++) out[d] = _mm512_cvtss_f32(_mm512_cvtph_ps(_mm256_set1_epi16((short)h[d])));
}

static inline void key_rows(const struct ns_prefill *a, int64_t num_keys, int64_t kh, int64_t t, float *k, float *v) {
    prefill_key_rows(a, num_keys, kh, t, k, v, widen_row);
}

static struct ns_task task_of(const struct ns_prefill *a, int64_t t) { return prefill_task_of(a, t, LANES, KEYS); }

/* valid[j]: the task's lanes that see key t = b * 16 + j: those i with num_prefix + r0 + i >= t, and with a
 * window, num_prefix + r0 + i - t < window too. */
static void block_masks(const struct ns_prefill *a, const struct ns_task *k, int64_t b, __mmask16 valid[KEYS]) {
    for (int j = 0; j < KEYS; j++) {
        const int64_t first = b * KEYS + j - a->num_prefix - k->r0;  /* the first lane at or after key t */
        __mmask16 v = b * KEYS + j >= k->num_keys ? 0 : first <= 0 ? (__mmask16)0xffff : (__mmask16)(0xffffu << first);
        if (a->window) {
            const int64_t end = first + a->window;  /* lanes from here on are past key t's window */
            v &= end <= 0 ? 0 : end >= LANES ? (__mmask16)0xffff : (__mmask16)((1u << end) - 1);
        }
        valid[j] = v;
    }
}

/* The online softmax's step over a block's scores: masked scores to -inf, the running max *m raised to the
 * block's, and the factor alpha that rescales what was summed before. A lane that has seen no key yet (a window's
 * start inside the block, or a block before it) keeps m = -inf; its -inf - -inf = NaN becomes exp2_ps's floor
 * (vmaxps returns its second operand for NaN), a weight of ~1e-38 on its l = 0 and ot = 0. */
static inline __m512 new_max(__m512 s[KEYS], const __mmask16 valid[KEYS], __m512 *m) {
    __m512 mx = *m;
    for (int j = 0; j < KEYS; j++) {
        s[j] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid[j], s[j]);
        mx = _mm512_max_ps(mx, s[j]);
    }
    const __m512 alpha = exp2_ps(_mm512_sub_ps(*m, mx));  /* ~0 on the first block, where l and ot are 0 */
    *m = mx;
    return alpha;
}

/* out rows of the task = ot / l. */
static void store_task(const struct ns_prefill *a, const struct ns_task *k, float ot[][LANES], __m512 l) {
    float inv[LANES] __attribute__((aligned(64)));
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
    for (int64_t i = 0; i < k->nr; i++) {
        float *o = a->out + (k->r0 + i) * a->ldo + k->h * a->D;
        for (int64_t d = 0; d < a->D; d++) o[d] = ot[d][i] * inv[i];
    }
}

static void run_task(const struct ns_prefill *a, int64_t t) {
    const struct ns_task k = task_of(a, t);
    const int64_t D = a->D;
    const float c = a->scale * 1.4426950408889634f;     /* log2 e: softmax in base 2 */
    float qt[MAX_D][LANES] __attribute__((aligned(64)));
    float ot[MAX_D][LANES] __attribute__((aligned(64)));
    for (int64_t d = 0; d < D; d++)
        for (int64_t i = 0; i < LANES; i++) {
            qt[d][i] = i < k.nr ? a->q[(k.r0 + i) * a->ldq + k.h * D + d] * c : 0.0f;
            ot[d][i] = 0.0f;
        }
    __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
    for (int64_t b = k.b_first; b * KEYS < k.num_keys; b++) {
        const int64_t at = (k.kh * k.nb_all + b - a->b_lo) * KEYS * D;
        const float *kb = a->kpack + at, *vb = a->vpack + at;
        __mmask16 valid[KEYS];
        block_masks(a, &k, b, valid);
        __m512 s[KEYS];
        for (int j = 0; j < KEYS; j++) s[j] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d++) {
            const __m512 qd = _mm512_load_ps(qt[d]);
            for (int j = 0; j < KEYS; j++) s[j] = _mm512_fmadd_ps(qd, _mm512_set1_ps(kb[d * KEYS + j]), s[j]);
        }
        const __m512 alpha = new_max(s, valid, &m);
        l = _mm512_mul_ps(l, alpha);
        for (int j = 0; j < KEYS; j++) {
            s[j] = _mm512_maskz_mov_ps(valid[j], exp2_ps(_mm512_sub_ps(s[j], m)));
            l = _mm512_add_ps(l, s[j]);
        }
        for (int64_t d = 0; d < D; d++) {
            __m512 o = _mm512_mul_ps(_mm512_load_ps(ot[d]), alpha);
            for (int j = 0; j < KEYS; j++) o = _mm512_fmadd_ps(s[j], _mm512_set1_ps(vb[d * KEYS + j]), o);
            _mm512_store_ps(ot[d], o);
        }
    }
    store_task(a, &k, ot, l);
}
#endif

#if NS_PREFILL_BF16
/* float32 -> bf16, rounded to nearest even (as vcvtneps2bf16; no NaN reaches here). */
static inline uint32_t bf16_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

/* pack_kv for run_task_bf16, per KV head and block of 16 keys: K as [D / 2][16] uint32, key j's (k[2e], k[2e + 1])
 * in bf16 (the pair a vdpbf16ps lane multiplies with a query's q[2e], q[2e + 1]), and V as [D][8] uint32, value d of
 * keys 2p and 2p + 1 (paired with their two probabilities). */
static void pack_kv_bf16(const struct ns_prefill *a, int64_t num_keys, uint32_t *kp, uint32_t *vp) {
    const int64_t D = a->D, nb = (num_keys + KEYS - 1) / KEYS - a->b_lo;
    float k[MAX_D], v[MAX_D];
    for (int64_t kh = 0; kh < a->KH; kh++)
        for (int64_t b = 0; b < nb; b++) {
            uint32_t *kb = kp + (kh * nb + b) * KEYS * D / 2, *vb = vp + (kh * nb + b) * KEYS * D / 2;
            for (int64_t j = 0; j < KEYS; j++) {
                key_rows(a, num_keys, kh, (a->b_lo + b) * KEYS + j, k, v);
                for (int64_t e = 0; e < D / 2; e++)
                    kb[e * KEYS + j] = bf16_bits(k[2 * e]) | bf16_bits(k[2 * e + 1]) << 16;
                for (int64_t d = 0; d < D; d++) {
                    uint32_t *w = vb + d * (KEYS / 2) + j / 2;
                    *w = j % 2 ? (*w & 0xffffu) | bf16_bits(v[d]) << 16 : bf16_bits(v[d]);
                }
            }
        }
}

/* run_task with the products in bf16: 32 multiply-adds a vdpbf16ps where an FMA does 16, sums, softmax and the
 * output in float32. Scores: lane i (query) takes its (q[2e], q[2e + 1]) against key j's pair, D / 2 of them a
 * key; output: lane i takes (p[2p'], p[2p' + 1]), its probabilities of keys 2p' and 2p' + 1, against their value
 * d. D even. */
static void run_task_bf16(const struct ns_prefill *a, int64_t t) {
    const struct ns_task k = task_of(a, t);
    const int64_t D = a->D;
    const float c = a->scale * 1.4426950408889634f;
    uint32_t qt[MAX_D / 2][LANES] __attribute__((aligned(64)));
    float ot[MAX_D][LANES] __attribute__((aligned(64)));
    for (int64_t e = 0; e < D / 2; e++)
        for (int64_t i = 0; i < LANES; i++) {
            const float *qi = a->q + (k.r0 + i) * a->ldq + k.h * D + 2 * e;
            qt[e][i] = i < k.nr ? bf16_bits(qi[0] * c) | bf16_bits(qi[1] * c) << 16 : 0;
        }
    memset(ot, 0, sizeof(float) * (size_t)(D * LANES));
    __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
    for (int64_t b = k.b_first; b * KEYS < k.num_keys; b++) {
        const int64_t at = (k.kh * k.nb_all + b - a->b_lo) * KEYS * D / 2;
        const uint32_t *kb = (const uint32_t *)a->kpack + at, *vb = (const uint32_t *)a->vpack + at;
        __mmask16 valid[KEYS];
        block_masks(a, &k, b, valid);
        __m512 s[KEYS];
        for (int j = 0; j < KEYS; j++) s[j] = _mm512_setzero_ps();
        for (int64_t e = 0; e < D / 2; e++) {
            const __m512bh qe = (__m512bh)_mm512_load_si512((const void *)qt[e]);
            for (int j = 0; j < KEYS; j++)
                s[j] = _mm512_dpbf16_ps(s[j], qe, (__m512bh)_mm512_set1_epi32((int)kb[e * KEYS + j]));
        }
        const __m512 alpha = new_max(s, valid, &m);
        l = _mm512_mul_ps(l, alpha);
        __m512bh p2[KEYS / 2];
        for (int j = 0; j < KEYS; j += 2) {
            const __m512 p0 = _mm512_maskz_mov_ps(valid[j], exp2_ps(_mm512_sub_ps(s[j], m)));
            const __m512 p1 = _mm512_maskz_mov_ps(valid[j + 1], exp2_ps(_mm512_sub_ps(s[j + 1], m)));
            /* the sum takes the probabilities as rounded, so the weights the output uses sum to 1 */
            const __m512i pr = pair_bf16(p0, p1);
            const __m512i hi = _mm512_and_si512(pr, _mm512_set1_epi32((int)0xffff0000u));
            p2[j / 2] = (__m512bh)pr;
            const __m512 p0r = _mm512_castsi512_ps(_mm512_slli_epi32(pr, 16)), p1r = _mm512_castsi512_ps(hi);
            l = _mm512_add_ps(l, _mm512_add_ps(p0r, p1r));
        }
        for (int64_t d = 0; d < D; d++) {
            __m512 o = _mm512_mul_ps(_mm512_load_ps(ot[d]), alpha);
            for (int j = 0; j < KEYS / 2; j++)
                o = _mm512_dpbf16_ps(o, p2[j], (__m512bh)_mm512_set1_epi32((int)vb[d * (KEYS / 2) + j]));
            _mm512_store_ps(ot[d], o);
        }
    }
    store_task(a, &k, ot, l);
}
#endif

/* Takes tasks from *next until none are left, or (a helper) until *lent is 0: its core's owner wants it back. */
static void run_tasks(const void *ctx, atomic_long *next, const atomic_int *lent) {
#if NS_PREFILL
    const struct ns_prefill *a = ctx;
    const int64_t n = num_tasks(a);
    while (!lent || atomic_load(lent)) {
        const int64_t t = atomic_fetch_add(next, 1);
        if (t >= n) break;
#if NS_PREFILL_BF16
        if (a->bf16) { run_task_bf16(a, t); continue; }
#endif
        run_task(a, t);
    }
#else
    (void)ctx; (void)next; (void)lent;
#endif
}

/* out = attention of q's Lq tokens (positions num_prefix .. num_prefix + Lq - 1 of the sequence whose pages are
 * `table`) over the keys at positions up to each one's own (window > 0: its last `window` ones only, and no page
 * before the first query's window is read), split with a lent core when there is enough work.
 * q, out: [Lq, H, D] with heads and D contiguous, rows ldq / ldo floats apart; kv: one layer of the pool,
 * [num_pages, 2, page_size, KH, D]. Returns 0, or -1 when this build or these shapes have no kernel (the caller
 * uses torch's). */
int ns_prefill_attention(const float *q, int64_t ldq, const void *kv, const int64_t *table, int64_t num_prefix,
                         int64_t Lq, float *out, int64_t ldo, int64_t H, int64_t KH, int64_t D, int64_t page_size,
                         float scale, int kv_f16, int bf16, int64_t window) {
    if (!NS_PREFILL)
        return ns_prefill_attention_avx2(q, ldq, kv, table, num_prefix, Lq, out, ldo, H, KH, D, page_size, scale,
                                         kv_f16, bf16, window);
    if (D > MAX_D || KH <= 0 || H % KH || Lq <= 0 || window < 0
            || (bf16 && (!NS_PREFILL_BF16 || D % 2)))
        return -1;
#if NS_PREFILL
    struct ns_prefill a = prefill_args(q, ldq, kv, table, num_prefix, Lq, out, ldo, H, KH, D, page_size, scale, kv_f16,
                                       bf16, window, KEYS);
    const int64_t num_keys = num_prefix + Lq, key_lo = a.key_lo, packed = prefill_packed(&a, KEYS);
    float *kp = aligned_alloc(64, sizeof(float) * (size_t)(2 * packed));
    if (!kp) return -1;
#if NS_PREFILL_BF16
    if (bf16) pack_kv_bf16(&a, num_keys, (uint32_t *)kp, (uint32_t *)kp + packed / 2);
    else
#endif
    prefill_pack_kv(&a, num_keys, kp, kp + packed, KEYS, widen_row);
    a.kpack = kp;
    a.vpack = bf16 ? kp + packed / 2 : kp + packed;
    /* below ~64 x 64 query-key pairs a head, the post costs more than the second core gives */
    ns_run_tasks(run_tasks, &a, num_tasks(&a) > 1 && Lq * (num_keys - key_lo) >= MIN_SPLIT_PAIRS);
    free(kp);
    return 0;
#else
    (void)q; (void)ldq; (void)kv; (void)table; (void)num_prefix; (void)out; (void)ldo; (void)page_size; (void)scale;
    (void)kv_f16; (void)bf16; (void)window;
    return -1;
#endif
}
