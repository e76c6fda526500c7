/* What decode attention's two kernels share (cpu_kernels.c's AVX2 loop, decode_attn512.c's AVX-512 one): the
 * page prefetch, which runs ahead across a step's sequences. */
#ifndef NS_DECODE_ATTN_H
#define NS_DECODE_ATTN_H

#include <stdint.h>

#include "prefetch.h"

#define PAGES_AHEAD 2  /* pages asked for ahead of the one computing (3 and 4: slower on 32 x 150 tokens, Zen 4) */

/* A sequence's pages as decode attention reads them, from its window's first page on. */
typedef struct {
    const int64_t *table;
    int64_t num_pages;
} ns_seq_pages;

/* The pages keys first .. len - 1 lie on. */
static inline ns_seq_pages ns_read_pages(const int64_t *table, int64_t first, int64_t len, int64_t page_size) {
    const int64_t fp = first / page_size;
    return (ns_seq_pages){table + fp, len > first ? (len - 1) / page_size + 1 - fp : 0};
}

/* While page ip of seq computes, asks for a share (`share` bytes from `from`) of page ip + PAGES_AHEAD, or, past
 * seq's last page, of next's first pages (the step's next sequence: its first pages are then in flight when it
 * starts). At ip 0, pages 1 .. PAGES_AHEAD too unless `asked` (the sequence before asked for them). */
void ns_prefetch_page_share(const void *kv, ns_seq_pages seq, ns_seq_pages next, int asked, int64_t ip,
                            int64_t page_bytes, int64_t from, int64_t share);

/* decode_attn512.c: out [R, H, D] = R query rows of one sequence over keys first[r] .. len[r] - 1 (see there); -1
 * where the build or head size has no AVX-512 kernel. next, asked: for the prefetch. */
int ns_decode_attend_rows512(const float *q, int64_t R, const void *kv, const int64_t *table, const int64_t *first,
                             const int64_t *len, float *out, int64_t H, int64_t KH, int64_t D, int64_t page_size,
                             float scale, float *m_l, int kv_f16, ns_seq_pages next, int asked);

#endif
