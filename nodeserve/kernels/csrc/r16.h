/* The R16 weight layout's constants (vnni_gemm.c's header comment describes it), shared by the GEMMs that read
 * it (vnni_gemm.c, bf16_gemm.c). Included, not compiled alone; native.py's build key covers headers too. */
#ifndef NS_R16_H
#define NS_R16_H

#include <stdint.h>

enum { R_Q4_0 = 2, R_Q4_1 = 3, R_Q8_0 = 8 };
#define QK 32     /* weights a block */
#define GROUP 16  /* rows a group */

/* Bytes of one R16 block (32 weights of each of 16 rows). */
static inline int64_t r16_block_bytes(int type) { return type == R_Q4_0 ? 288 : type == R_Q4_1 ? 320 : 544; }

/* Where an R16 block's quants start (after its fp16 d, and m for Q4_1). */
static inline int64_t quant_offset(int type) { return type == R_Q4_1 ? 64 : 32; }

/* Whether the weight prefetches fill L2 (prefetcht1) or L1 (prefetcht0): set per machine (ns_set_prefetch_levels in
 * cpu_kernels.c, from kernels/tuning.py's timing of both). */
extern int ns_weights_prefetch_l2;

/* Asks for the cache lines of [p, p + bytes) ahead of their use. */
static inline __attribute__((always_inline)) void prefetch_weights(const uint8_t *p, int64_t bytes) {
    if (ns_weights_prefetch_l2)
        for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
    else
        for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

#endif
