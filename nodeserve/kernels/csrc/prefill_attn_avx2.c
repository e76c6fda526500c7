/* prefill_attn.c's attention for AVX2 CPUs (AVX2, FMA, F16C: x86-64-v3): same arguments, same semantics (a chunk
 * after num_prefix cached tokens, causal, optional sliding window, K/V read in place from float32 or float16 pages,
 * no page before the first query's window read), float32 products only (bf16 products need AVX512-BF16: refused).
 *
 * Why: without it an AVX2 machine gathers the pages per call and runs torch's SDPA on one core; this one reads the
 * pages in place and splits its tasks with a lent core (lend.c), as the AVX-512 kernel does.
 *
 * Layout: the AVX-512 kernel's, halved. Lanes are query tokens: a task is 8 consecutive query tokens of one head,
 * its Q transposed to qt[d] (one ymm); a block is 8 keys, whose scores are 8 ymm s[j] (key j for the 8 tokens), so
 * 8 accumulators and the Q vector fit the 16 ymm registers, each FMA broadcasts one packed K (or V) value, and the
 * online softmax's max and sum over keys are vertical. Softmax in base 2; AVX2 has no scalef, so 2^x = a polynomial
 * for the fraction times 2^n built in the exponent bits, x clamped to [-126, 127] first so 2^n stays a normal
 * float (masked lanes' -inf become 2^-126, then zeroed by the mask).
 *
 * Tasks by an atomic counter, longest first, each computed whole by one thread: the output does not depend on the
 * split with a lent core.
 *
 * Built whenever the compiler targets AVX2 + FMA + F16C, AVX-512 builds included: prefill_attn.c calls it where it
 * has no AVX-512, and NODESERVE_KERNELS=avx2 (native.avx2_only) calls ns_prefill_attention_avx2 directly.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "prefill_attn.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define NS_PREFILL_AVX2 1
#else
#define NS_PREFILL_AVX2 0
#endif

#define LANES 8     /* query tokens per task, one per lane */
#define KEYS 8      /* keys per block: 8 score vectors */
#define MAX_D NS_PREFILL_MAX_D
#define MIN_SPLIT_PAIRS 4096

int ns_prefill_avx2_supported(void) { return NS_PREFILL_AVX2; }

typedef void (*ns_tasks_fn)(const void *ctx, atomic_long *next, const atomic_int *lent);
void ns_run_tasks(ns_tasks_fn fn, const void *ctx, int split_ok);  /* lend.c */

#if NS_PREFILL_AVX2
static int64_t num_tasks(const struct ns_prefill *a) { return prefill_num_tasks(a, LANES); }

/* 2^x, |relative error| ~1e-7: degree-7 Taylor polynomial for e^(frac * ln 2), times 2^n put in the exponent. */
static inline __m256 exp2_ps8(__m256 x) {
    /* vmaxps returns its second operand for NaN: a lane with no key yet (-inf - -inf) gets 2^-126 too */
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
    x = _mm256_min_ps(x, _mm256_set1_ps(127.0f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 g = _mm256_mul_ps(_mm256_sub_ps(x, n), _mm256_set1_ps(0.6931471805599453f));  /* |g| <= 0.35 */
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static void widen_row(const void *kv, int64_t at, int f16, int64_t D, float *out) {
    if (!f16) {
        memcpy(out, (const float *)kv + at, sizeof(float) * (size_t)D);
        return;
    }
    const uint16_t *h = (const uint16_t *)kv + at;
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(out + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + d))));
    for (; d < D; d++) out[d] = _cvtsh_ss(h[d]);
}

static struct ns_task task_of(const struct ns_prefill *a, int64_t t) { return prefill_task_of(a, t, LANES, KEYS); }

/* valid[j]: all-ones in the lanes that see key b * 8 + j (prefill_attn.c's block_masks, as vectors: AVX2 has no
 * mask registers). Lane i sees key t when first <= i < first + window, first = t - num_prefix - r0. */
static void block_masks(const struct ns_prefill *a, const struct ns_task *k, int64_t b, __m256 valid[KEYS]) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int j = 0; j < KEYS; j++) {
        const int64_t t = b * KEYS + j, first = t - a->num_prefix - k->r0;
        if (t >= k->num_keys || first >= LANES || (a->window && first + a->window <= 0)) {
            valid[j] = _mm256_setzero_ps();
            continue;
        }
        /* lane > first - 1, and with a window lane < end: both clamped into int range first */
        const int lo = first < 0 ? -1 : (int)first - 1;
        __m256i v = _mm256_cmpgt_epi32(lane, _mm256_set1_epi32(lo));
        if (a->window) {
            const int64_t end = first + a->window;
            v = _mm256_and_si256(v, _mm256_cmpgt_epi32(_mm256_set1_epi32(end > LANES ? LANES : (int)end), lane));
        }
        valid[j] = _mm256_castsi256_ps(v);
    }
}

static void store_task(const struct ns_prefill *a, const struct ns_task *k, float ot[][LANES], __m256 l) {
    float inv[LANES] __attribute__((aligned(32)));
    _mm256_store_ps(inv, _mm256_div_ps(_mm256_set1_ps(1.0f), l));
    for (int64_t i = 0; i < k->nr; i++) {
        float *o = a->out + (k->r0 + i) * a->ldo + k->h * a->D;
        for (int64_t d = 0; d < a->D; d++) o[d] = ot[d][i] * inv[i];
    }
}

static void run_task(const struct ns_prefill *a, int64_t t) {
    const struct ns_task k = task_of(a, t);
    const int64_t D = a->D;
    const float c = a->scale * 1.4426950408889634f;     /* log2 e: softmax in base 2 */
    float qt[MAX_D][LANES] __attribute__((aligned(32)));
    float ot[MAX_D][LANES] __attribute__((aligned(32)));
    for (int64_t d = 0; d < D; d++)
        for (int64_t i = 0; i < LANES; i++) {
            qt[d][i] = i < k.nr ? a->q[(k.r0 + i) * a->ldq + k.h * D + d] * c : 0.0f;
            ot[d][i] = 0.0f;
        }
    const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
    __m256 m = neg_inf, l = _mm256_setzero_ps();
    for (int64_t b = k.b_first; b * KEYS < k.num_keys; b++) {
        const int64_t at = (k.kh * k.nb_all + b - a->b_lo) * KEYS * D;
        const float *kb = a->kpack + at, *vb = a->vpack + at;
        __m256 valid[KEYS];
        block_masks(a, &k, b, valid);
        __m256 s[KEYS];
        for (int j = 0; j < KEYS; j++) s[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d++) {
            const __m256 qd = _mm256_load_ps(qt[d]);
            for (int j = 0; j < KEYS; j++) s[j] = _mm256_fmadd_ps(qd, _mm256_broadcast_ss(kb + d * KEYS + j), s[j]);
        }
        /* online softmax step: masked scores to -inf, the running max raised, alpha rescales the sums so far */
        __m256 mx = m;
        for (int j = 0; j < KEYS; j++) {
            s[j] = _mm256_blendv_ps(neg_inf, s[j], valid[j]);
            mx = _mm256_max_ps(mx, s[j]);
        }
        const __m256 alpha = exp2_ps8(_mm256_sub_ps(m, mx));
        m = mx;
        l = _mm256_mul_ps(l, alpha);
        for (int j = 0; j < KEYS; j++) {
            s[j] = _mm256_and_ps(valid[j], exp2_ps8(_mm256_sub_ps(s[j], m)));
            l = _mm256_add_ps(l, s[j]);
        }
        for (int64_t d = 0; d < D; d++) {
            __m256 o = _mm256_mul_ps(_mm256_load_ps(ot[d]), alpha);
            for (int j = 0; j < KEYS; j++) o = _mm256_fmadd_ps(s[j], _mm256_broadcast_ss(vb + d * KEYS + j), o);
            _mm256_store_ps(ot[d], o);
        }
    }
    store_task(a, &k, ot, l);
}
#endif

static void run_tasks(const void *ctx, atomic_long *next, const atomic_int *lent) {
#if NS_PREFILL_AVX2
    const struct ns_prefill *a = ctx;
    const int64_t n = num_tasks(a);
    while (!lent || atomic_load(lent)) {
        const int64_t t = atomic_fetch_add(next, 1);
        if (t >= n) break;
        run_task(a, t);
    }
#else
    (void)ctx; (void)next; (void)lent;
#endif
}

/* ns_prefill_attention (prefill_attn.c) with AVX2: the same arguments; -1 where this build has no AVX2 + FMA +
 * F16C, for bf16 products, or for shapes it does not take (the caller uses torch's). */
int ns_prefill_attention_avx2(const float *q, int64_t ldq, const void *kv, const int64_t *table, int64_t num_prefix,
                              int64_t Lq, float *out, int64_t ldo, int64_t H, int64_t KH, int64_t D,
                              int64_t page_size, float scale, int kv_f16, int bf16, int64_t window) {
    if (!NS_PREFILL_AVX2 || bf16 || D > MAX_D || KH <= 0 || H % KH || Lq <= 0 || window < 0)
        return -1;
#if NS_PREFILL_AVX2
    struct ns_prefill a = prefill_args(q, ldq, kv, table, num_prefix, Lq, out, ldo, H, KH, D, page_size, scale, kv_f16,
                                       0, window, KEYS);
    const int64_t num_keys = num_prefix + Lq, key_lo = a.key_lo, packed = prefill_packed(&a, KEYS);
    float *kp = aligned_alloc(32, sizeof(float) * (size_t)(2 * packed));
    if (!kp) return -1;
    prefill_pack_kv(&a, num_keys, kp, kp + packed, KEYS, widen_row);
    a.kpack = kp;
    a.vpack = kp + packed;
    ns_run_tasks(run_tasks, &a, num_tasks(&a) > 1 && Lq * (num_keys - key_lo) >= MIN_SPLIT_PAIRS);
    free(kp);
    return 0;
#else
    (void)q; (void)ldq; (void)kv; (void)table; (void)num_prefix; (void)out; (void)ldo; (void)page_size; (void)scale;
    (void)kv_f16; (void)window;
    return -1;
#endif
}
