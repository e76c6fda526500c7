/* The R16 weight layout's constants (vnni_gemm.c's header comment describes it), shared by the GEMMs that read
 * it (vnni_gemm.c, r16_avx2.c, bf16_gemm.c). Included, not compiled alone; native.py's build key covers headers too. */
#ifndef NS_R16_H
#define NS_R16_H

#include <stdint.h>

#include "prefetch.h"

enum { R_Q4_0 = 2, R_Q4_1 = 3, R_Q8_0 = 8 };
#define QK 32     /* weights a block */
#define GROUP 16  /* rows a group */

/* Bytes of one R16 block (32 weights of each of 16 rows). */
static inline int64_t r16_block_bytes(int type) { return type == R_Q4_0 ? 288 : type == R_Q4_1 ? 320 : 544; }

/* Where an R16 block's quants start (after its fp16 d, and m for Q4_1). */
static inline int64_t quant_offset(int type) { return type == R_Q4_1 ? 64 : 32; }

/* Every group of 16 outputs passes over all of a call's activation rows: a prompt chunk's (512 x 1,536 int16:
 * 1.5 MiB) outgrow L2 and came from L3 once a group. The integer GEMMs take the rows in chunks of this many
 * activation bytes instead, the weights read once a chunk. */
#define ROWS_L2_BYTES (192 * 1024)

/* Rows a chunk (activations of value_bytes each, K a row): a multiple of the tile, so each row's tile, and its
 * sums, are the same as without chunks. */
static inline int64_t l2_chunk_rows(int64_t K, int64_t value_bytes, int64_t tile) {
    const int64_t rows = ROWS_L2_BYTES / (value_bytes * K) / tile * tile;
    return rows > tile ? rows : tile;
}

#endif
