/* The software prefetches' cache level: L1 (prefetcht0) or L2 (prefetcht1), per machine. kernels/tuning.py times
 * both and sets them through ns_set_prefetch_levels (cpu_kernels.c), once, before any call. Included, not compiled
 * alone. */
#ifndef NS_PREFETCH_H
#define NS_PREFETCH_H

#include <stdint.h>

extern int ns_pages_prefetch_l2;    /* decode attention's KV pages */
extern int ns_weights_prefetch_l2;  /* the GEMMs' weight rows */

/* Asks for the cache lines of the weights [p, p + bytes) ahead of their use. */
static inline __attribute__((always_inline)) void prefetch_weights(const void *p, int64_t bytes) {
    const char *c = (const char *)p;
    if (ns_weights_prefetch_l2)
        for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 2);
    else
        for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

#endif
