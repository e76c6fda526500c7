/* What the two prefill attention kernels share (prefill_attn.c: AVX-512, 16 query tokens a task and 16 keys a
 * block; prefill_attn_avx2.c: AVX2, 8 and 8): their arguments, which query tokens and keys a task covers, and K/V
 * gathered from the pages into the packed blocks the tasks read. `lanes` and `keys` are each kernel's constants
 * (the functions inline), `widen` its float16 -> float32 row copy. */
#ifndef NS_PREFILL_ATTN_H
#define NS_PREFILL_ATTN_H

#include <stdint.h>
#include <string.h>

#define NS_PREFILL_MAX_D 256

/* The arguments of ns_prefill_attention, shared by the threads that run its tasks. */
struct ns_prefill {
    const float *q;           /* [Lq, H, D], rows ldq floats apart */
    const void *kv;           /* [num_pages, 2, page_size, KH, D]: one layer of the pool, float32 or float16 */
    int kv_f16;
    const int64_t *table;     /* the sequence's pages */
    float *out;               /* [Lq, H, D], rows ldo floats apart */
    const float *kpack, *vpack;  /* pack_kv's (prefill_attn.c's pack_kv_bf16's: uint32 bf16 pairs) */
    int bf16;                 /* products in bf16 (vdpbf16ps), sums in float32: prefill_attn.c's run_task_bf16 */
    int64_t ldq, ldo, num_prefix, Lq, H, KH, D, page_size;
    float scale;
    int64_t window;           /* each query sees its last `window` positions, its own included; 0: all */
    /* [key_lo, num_prefix + Lq) is KV that some query sees: key_lo = the first query's window start (0 without
     * one). Keys before it are never read (freed pages may hold NaN); packing starts at block b_lo = key_lo / keys,
     * with the keys of that block before key_lo packed as zeros. */
    int64_t key_lo, b_lo;
};

/* Task t: query tokens r0 .. r0 + nr - 1 (nr <= lanes) of head h, reading KV head kh's packed blocks b_first ..
 * (num_keys - 1) / keys (absolute block numbers; packed from b_lo, nb_all of them per KV head). */
struct ns_task {
    int64_t h, kh, r0, nr, num_keys, nb_all, b_first;
};

typedef void (*ns_widen_fn)(const void *kv, int64_t at, int f16, int64_t D, float *out);

static inline struct ns_prefill prefill_args(const float *q, int64_t ldq, const void *kv, const int64_t *table,
                                             int64_t num_prefix, int64_t Lq, float *out, int64_t ldo, int64_t H,
                                             int64_t KH, int64_t D, int64_t page_size, float scale, int kv_f16,
                                             int bf16, int64_t window, int64_t keys) {
    const int64_t key_lo = window && num_prefix >= window ? num_prefix - window + 1 : 0;
    return (struct ns_prefill){.q = q, .kv = kv, .table = table, .out = out, .ldq = ldq, .ldo = ldo,
                               .num_prefix = num_prefix, .Lq = Lq, .H = H, .KH = KH, .D = D,
                               .page_size = page_size, .scale = scale, .kv_f16 = kv_f16, .bf16 = bf16,
                               .window = window, .key_lo = key_lo, .b_lo = key_lo / keys};
}

/* Floats of K (and as many of V) packed: every block from b_lo to the last key's, per KV head. */
static inline int64_t prefill_packed(const struct ns_prefill *a, int64_t keys) {
    return ((a->num_prefix + a->Lq + keys - 1) / keys - a->b_lo) * keys * a->KH * a->D;
}

static inline int64_t prefill_num_tasks(const struct ns_prefill *a, int64_t lanes) {
    return (a->Lq + lanes - 1) / lanes * a->H;
}

/* Tasks are numbered longest first: the last query tokens see the most keys. */
static inline struct ns_task prefill_task_of(const struct ns_prefill *a, int64_t t, int64_t lanes, int64_t keys) {
    const int64_t nrb = (a->Lq + lanes - 1) / lanes, rb = nrb - 1 - t / a->H, h = t % a->H, r0 = rb * lanes;
    const int64_t nr = a->Lq - r0 < lanes ? a->Lq - r0 : lanes;
    const int64_t first_key = a->window && a->num_prefix + r0 >= a->window ? a->num_prefix + r0 - a->window + 1 : 0;
    return (struct ns_task){.h = h, .kh = h / (a->H / a->KH), .r0 = r0, .nr = nr,
                            .num_keys = a->num_prefix + r0 + nr,  /* the last token of the task sees them all */
                            .nb_all = (a->num_prefix + a->Lq + keys - 1) / keys - a->b_lo,
                            .b_first = first_key / keys};  /* the first token's window starts there */
}

/* k, v = key t's K and V rows of KV head kh, as float32; zeros past num_keys (the last block's padding) and
 * before key_lo (outside every query's window: 0 * NaN would be NaN, so they must not even be loaded). */
static inline void prefill_key_rows(const struct ns_prefill *a, int64_t num_keys, int64_t kh, int64_t t, float *k,
                                    float *v, ns_widen_fn widen) {
    const int64_t D = a->D, ps = a->page_size, token_stride = a->KH * D, page_stride = 2 * ps * token_stride;
    if (t >= num_keys || t < a->key_lo) {
        memset(k, 0, sizeof(float) * (size_t)D);
        memset(v, 0, sizeof(float) * (size_t)D);
        return;
    }
    const int64_t at = a->table[t / ps] * page_stride + (t % ps) * token_stride + kh * D;
    widen(a->kv, at, a->kv_f16, D, k);
    widen(a->kv, at + ps * token_stride, a->kv_f16, D, v);
}

/* K and V of the sequence's keys in blocks b_lo .. (num_keys - 1) / keys, packed for the tasks: per KV head and
 * block of `keys` keys, [D][keys] (the keys' value d side by side), so a task's multiply-adds broadcast from one
 * base at constant offsets. Past num_keys and before key_lo: zeros (masked). Shared by the H / KH heads and every
 * task. */
static inline void prefill_pack_kv(const struct ns_prefill *a, int64_t num_keys, float *kp, float *vp, int64_t keys,
                                   ns_widen_fn widen) {
    const int64_t D = a->D, nb = (num_keys + keys - 1) / keys - a->b_lo;
    float k[NS_PREFILL_MAX_D], v[NS_PREFILL_MAX_D];
    for (int64_t kh = 0; kh < a->KH; kh++)
        for (int64_t b = 0; b < nb; b++) {
            float *kb = kp + (kh * nb + b) * keys * D, *vb = vp + (kh * nb + b) * keys * D;
            for (int64_t j = 0; j < keys; j++) {
                prefill_key_rows(a, num_keys, kh, (a->b_lo + b) * keys + j, k, v, widen);
                for (int64_t d = 0; d < D; d++) {
                    kb[d * keys + j] = k[d];
                    vb[d * keys + j] = v[d];
                }
            }
        }
}

#endif
