/* GEMM over GGUF weight blocks with int16 activations and AVX-512 VNNI integer dot products (vpdpwssd), on
 * weights repacked at load into groups of 16 rows ("R16").
 *
 * Why repack: GGUF keeps each row's blocks together, so a vector holds 32 weights of one row and every block
 * needs its own float scaling per activation row. Interleaving 16 rows puts one output row in each 32-bit lane:
 * a vpdpwssd multiplies 2 weights of 16 rows by the same 2 activations (broadcast), 32 multiply-adds, and a block
 * (32 weights x 16 rows) is 16 of them plus one float scaling for all 16 rows, where the float path needs 64
 * FMAs. The weight bytes stay those of the file (the same quants and fp16 scales, moved), so memory traffic per
 * weight is unchanged.
 *
 * Activations are rounded to int16 per 32-value block (d = amax / 32767), as the AVX2 path's single-row kernel
 * does. int8 (vpdpbusd, llama.cpp's choice) would double the multiply rate, but on SmolLM2 it moved logits by up
 * to 4.3 against the float32 path where int16 moves them by 0.01 (tests/model/test_block_quant.py); the offset
 * term of Q4_0 / Q4_1 (w = d q + m) multiplies the exact float sum of the block.
 *
 * R16 block of 16 rows (one 32-weight block each), by type:
 *   Q4_0: fp16 d[16]; uint8 q[4][16][4]                             288 bytes
 *   Q4_1: fp16 d[16]; fp16 m[16]; uint8 q[4][16][4]                 320 bytes
 *   Q8_0: fp16 d[16]; int8 q[8][16][4]                              544 bytes
 * q[j][r] holds row r's GGUF bytes qs[4j .. 4j + 3]: for 4-bit types their low nibbles are weights 4j .. 4j + 3
 * and their high nibbles weights 16 + 4j .. 16 + 4j + 3; for Q8_0, weights 4j .. 4j + 3. Rows past N (the last
 * group's padding) have d = m = 0. Groups follow each other; within a group, blocks in K order.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define NS_R16 1
#else
#define NS_R16 0
#endif

#include "r16.h"
#define R_ACT8 0x200  /* type flag: int8 activations (group_rows_i8) for Q4_0 / Q4_1; others keep int16 */
#define R_BF16 0x400  /* type flag: bf16 products (bf16_gemm.c), every type */
#define MAX_ROWS 12  /* activation rows per pass over a group (group_rows_wide: 12 int32 + 12 float accumulators) */
#define MAX_NARROW_ROWS 4  /* up to this many, group_rows: four chains a row hide the latency one chain cannot */
#define MAX_WIDE_TWO_CHAINS 8  /* up to this many, group_rows_wide keeps two chains a row (16 + 8 zmm at 8 rows) */
/* group_rows asks for the weights this far ahead of the block it reads: a GEMV reads each byte once, and with the
 * hardware prefetcher alone a batch-1 decode step took 4.4 ms on the AMD EPYC (Zen 5), 3.3-3.5 with 8 or 16 KB
 * ahead (1-2 KB: no better; bench/kernels.py's step rows). */
#define PREFETCH_BYTES 8192

int ns_r256_supported(void);  /* r16_avx2.c: 1 its AVX2 kernels, 2 its 256-bit VNNI ones */
int ns_linear_r256(int type, const uint8_t *wr, const float *x, float *y, int64_t M, int64_t K, int64_t ldy,
                   int64_t n_begin, int64_t n_end);
#define R_256 0x1800  /* type flags asking for r16_avx2.c's kernels: R_AVX2 | R_AVXVNNI */

/* The R16 kernels this build has, a bit each: 1 this file's (AVX-512 VNNI), 2 r16_avx2.c's AVX2 ones (vpmaddwd /
 * vpmaddubsw), 4 its 256-bit VNNI ones (AVX-VNNI, or AVX-512 VL + VNNI). Zero: R16 weights are not served. */
int ns_r16_supported(void) { return NS_R16 | ns_r256_supported() << 1; }

static int64_t gguf_block_bytes(int type) { return type == R_Q4_0 ? 18 : type == R_Q4_1 ? 20 : 34; }

/* Bytes of an [N, K] matrix in R16. */
int64_t ns_r16_bytes(int type, int64_t N, int64_t K) {
    return (N + GROUP - 1) / GROUP * (K / QK) * r16_block_bytes(type);
}

/* w: GGUF rows [N, K / 32 blocks] -> out: R16 (ns_r16_bytes bytes). */
void ns_repack_r16(int type, const uint8_t *w, int64_t N, int64_t K, uint8_t *out) {
    const int64_t nb = K / QK, gb = gguf_block_bytes(type), rb = r16_block_bytes(type), qo = quant_offset(type);
    const int nq = type == R_Q8_0 ? 8 : 4;
    const int64_t groups = (N + GROUP - 1) / GROUP;
    memset(out, 0, (size_t)ns_r16_bytes(type, N, K));
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = out + (g * nb + b) * rb;
            for (int r = 0; r < GROUP && g * GROUP + r < N; r++) {
                const uint8_t *blk = w + ((g * GROUP + r) * nb + b) * gb;
                memcpy(o + 2 * r, blk, 2);                                   /* d */
                if (type == R_Q4_1) memcpy(o + 32 + 2 * r, blk + 2, 2);     /* m */
                const uint8_t *qs = blk + (type == R_Q4_1 ? 4 : 2);
                for (int j = 0; j < nq; j++) memcpy(o + qo + (j * GROUP + r) * 4, qs + 4 * j, 4);
            }
        }
}

float ns_fp16_to_fp32(uint16_t h);  /* cpu_kernels.c */

/* out[i] = row rows[i] (all rows when rows == NULL) of an R16 matrix, dequantized as GGUF's dequantize does. */
void ns_dequant_rows_r16(int type, const uint8_t *wr, int64_t K, const int64_t *rows, int64_t n_rows, float *out) {
    const int64_t nb = K / QK, rb = r16_block_bytes(type), qo = quant_offset(type);
    for (int64_t i = 0; i < n_rows; i++) {
        const int64_t n = rows ? rows[i] : i, g = n / GROUP, r = n % GROUP;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *o = wr + (g * nb + b) * rb;
            uint16_t h;
            memcpy(&h, o + 2 * r, 2);
            const float d = ns_fp16_to_fp32(h);
            float m = 0.0f;
            if (type == R_Q4_1) { memcpy(&h, o + 32 + 2 * r, 2); m = ns_fp16_to_fp32(h); }
            if (type == R_Q4_0) m = -8.0f * d;
            float *y = out + i * K + b * QK;
            if (type == R_Q8_0) {
                for (int k = 0; k < QK; k++) y[k] = d * (float)(int8_t)o[qo + ((k / 4) * GROUP + r) * 4 + k % 4];
            } else {
                for (int k = 0; k < 16; k++) {
                    const uint8_t q = o[qo + ((k / 4) * GROUP + r) * 4 + k % 4];
                    y[k] = d * (float)(q & 0x0f) + m;
                    y[k + 16] = d * (float)(q >> 4) + m;
                }
            }
        }
    }
}

#if NS_R16
/* Word t (0..15) of a block's int16 activations pairs with weight vector t of group_rows: it holds x[k], x[k + 2]
 * for k = pair_k(type, t), the two weights a vpdpwssd lane multiplies (bytes 0 and 2, or 1 and 3, of a lane). */
static int pair_k(int type, int t) {
    if (type == R_Q8_0) return 4 * (t / 2) + t % 2;              /* vector j = t / 2 holds weights 4j .. 4j + 3 */
    return 4 * (t / 4) + (t % 4 >= 2 ? 16 : 0) + t % 2;         /* low nibbles 4j .., high nibbles 16 + 4j .. */
}

/* x [M, K] -> per 32-block: xq int16 in pair_k order (round to nearest, d = amax / 32767: 15 bits, as the AVX2
 * path's single-row kernel), dx = d, sx = the block's float sum (for the offset term of 4-bit types). */
static void quantize_rows(int type, const float *x, int64_t M, int64_t K, int16_t *xq, float *dx, float *sx) {
    const int64_t nb = K / QK;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    int32_t idx[QK];
    for (int t = 0; t < 16; t++) { idx[2 * t] = pair_k(type, t); idx[2 * t + 1] = pair_k(type, t) + 2; }
    const __m512i i0 = _mm512_loadu_si512((const void *)idx), i1 = _mm512_loadu_si512((const void *)(idx + 16));
    for (int64_t i = 0; i < M * nb; i++) {
        const float *xb = x + i * QK;
        const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
        const float d = amax / 32767.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        const __m512 vinv = _mm512_set1_ps(inv);
        const __m512 pa = _mm512_permutex2var_ps(a, i0, b), pb = _mm512_permutex2var_ps(a, i1, b);
        _mm256_storeu_si256((__m256i *)(xq + i * QK), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(pa, vinv))));
        _mm256_storeu_si256((__m256i *)(xq + i * QK + 16),
                            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(pb, vinv))));
        dx[i] = d;
        sx[i] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    }
}

/* One group (16 weight rows) against MT <= MAX_NARROW_ROWS activation rows: f[i] lane r = y[i, 16 g + r]. A
 * block's weights are widened once to 16 vectors of int16 pairs (lane r: two of row r's weights) and shared by the
 * MT rows; each row then takes 16 vpdpwssd, its activation pair broadcast, in four chains so the dot-product
 * latency overlaps. */
static inline __attribute__((always_inline)) void group_rows(
        int type, const int MT, const uint8_t *wg, int64_t nb, const int16_t *xq, const float *dx, const float *sx,
        __m512 f[MAX_ROWS]) {
    const int64_t rb = r16_block_bytes(type), qo = quant_offset(type);
    for (int i = 0; i < MT; i++) f[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = wg + b * rb;
        prefetch_weights(o + PREFETCH_BYTES, rb);
        const __m512 vd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)o));
        __m512i w[16];
        __m512 vm = _mm512_setzero_ps();
        if (type == R_Q8_0) {
            for (int j = 0; j < 8; j++) {
                const __m512i v = _mm512_loadu_si512((const void *)(o + qo + 64 * j));
                w[2 * j] = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8);  /* bytes 0, 2: sign-extended */
                w[2 * j + 1] = _mm512_srai_epi16(v, 8);                    /* bytes 1, 3 */
            }
        } else {
            const __m512i mask = _mm512_set1_epi16(0x000f);
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512((const void *)(o + qo + 64 * j));
                w[4 * j] = _mm512_and_si512(v, mask);                         /* low nibbles of bytes 0, 2 */
                w[4 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 8), mask);  /* of bytes 1, 3 */
                w[4 * j + 2] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);  /* high nibbles of bytes 0, 2 */
                w[4 * j + 3] = _mm512_srli_epi16(v, 12);                         /* of bytes 1, 3 */
            }
            vm = type == R_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + 32)))
                                : _mm512_mul_ps(vd, _mm512_set1_ps(-8.0f));
        }
        for (int i = 0; i < MT; i++) {
            const int32_t *xw = (const int32_t *)(xq + (i * nb + b) * QK);
            __m512i a[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                            _mm512_setzero_si512()};
            for (int t = 0; t < 16; t++) a[t % 4] = _mm512_dpwssd_epi32(a[t % 4], w[t], _mm512_set1_epi32(xw[t]));
            const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(a[0], a[1]), _mm512_add_epi32(a[2], a[3]));
            f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(vd, _mm512_set1_ps(dx[i * nb + b])), f[i]);
            if (type != R_Q8_0) f[i] = _mm512_fmadd_ps(vm, _mm512_set1_ps(sx[i * nb + b]), f[i]);
        }
    }
}

/* group_rows for MT > MAX_NARROW_ROWS rows, the same sums in the same order of float operations (integer sums
 * are exact): each of a block's 16 weight vectors is unpacked and taken by the MT rows in turn, into one int32
 * accumulator per row, so it never holds all 16 (with 8 rows' accumulators those spilled registers); the MT
 * chains, and the next block's (independent of this one's), hide the dot-product latency. 32 rows x (3072 x 576)
 * Q4_1: 0.59 -> 0.49 ms on one core (bench/kernels.py). Up to 8 rows keep two chains a row (5 rows' single chains
 * left vpdpwssd latency-bound: a 5-row step of SmolLM2's projections took 12.7 ms where 4 rows took 8.5, a
 * speculative verify step's usual size; now 9.5; AMD EPYC Zen 4, one core, weights from DRAM) and read ahead as
 * group_rows does. */
static inline __attribute__((always_inline)) void group_rows_wide(
        int type, const int MT, const uint8_t *wg, int64_t nb, const int16_t *xq, const float *dx, const float *sx,
        __m512 f[MAX_ROWS]) {
    const int64_t rb = r16_block_bytes(type), qo = quant_offset(type);
    const int C = MT <= MAX_WIDE_TWO_CHAINS ? 2 : 1;  /* chains a row: with few rows one chain a row is latency-bound */
    const __m512i mask = _mm512_set1_epi16(0x000f);
    for (int i = 0; i < MT; i++) f[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = wg + b * rb;
        prefetch_weights(o + PREFETCH_BYTES, rb);
        __m512i a[2 * MAX_WIDE_TWO_CHAINS > MAX_ROWS ? 2 * MAX_WIDE_TWO_CHAINS : MAX_ROWS];  /* [row][chain] */
        for (int i = 0; i < MT * C; i++) a[i] = _mm512_setzero_si512();
#define NS_DOT(t, wv)                                                                                            \
        for (int i = 0; i < MT; i++)                                                                             \
            a[i * C + (t) % C] = _mm512_dpwssd_epi32(a[i * C + (t) % C], (wv),                                   \
                                                     _mm512_set1_epi32(((const int32_t *)(xq + (i * nb + b) * QK))[t]));
        if (type == R_Q8_0) {
            for (int j = 0; j < 8; j++) {
                const __m512i v = _mm512_loadu_si512((const void *)(o + qo + 64 * j));
                const __m512i w0 = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8);  /* bytes 0, 2: sign-extended */
                NS_DOT(2 * j, w0)
                const __m512i w1 = _mm512_srai_epi16(v, 8);                    /* bytes 1, 3 */
                NS_DOT(2 * j + 1, w1)
            }
        } else {
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512((const void *)(o + qo + 64 * j));
                const __m512i w0 = _mm512_and_si512(v, mask);                         /* low nibbles of bytes 0, 2 */
                NS_DOT(4 * j, w0)
                const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(v, 8), mask);  /* of bytes 1, 3 */
                NS_DOT(4 * j + 1, w1)
                const __m512i w2 = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);  /* high nibbles of bytes 0, 2 */
                NS_DOT(4 * j + 2, w2)
                const __m512i w3 = _mm512_srli_epi16(v, 12);                         /* of bytes 1, 3 */
                NS_DOT(4 * j + 3, w3)
            }
        }
#undef NS_DOT
        const __m512 vd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)o));
        const __m512 vm = type == R_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + 32)))
                                         : _mm512_mul_ps(vd, _mm512_set1_ps(-8.0f));
        for (int i = 0; i < MT; i++) {
            const __m512i sum = C == 2 ? _mm512_add_epi32(a[2 * i], a[2 * i + 1]) : a[i];
            f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(vd, _mm512_set1_ps(dx[i * nb + b])), f[i]);
            if (type != R_Q8_0) f[i] = _mm512_fmadd_ps(vm, _mm512_set1_ps(sx[i * nb + b]), f[i]);
        }
    }
}

/* x [M, K] -> per 32-block: xq int8 in K order (round to nearest, d = amax / 127, as llama.cpp's Q8 formats), dx = d,
 * sx = the block's float sum, cx = -8 d sum(xq) (for group_rows_i8's centring). */
static void quantize_rows_i8(const float *x, int64_t M, int64_t K, int8_t *xq, float *dx, float *sx, float *cx) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t i = 0; i < M * (K / QK); i++) {
        const float *xb = x + i * QK;
        const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
        const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        const __m512 vinv = _mm512_set1_ps(inv);
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, vinv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, vinv));
        _mm_storeu_si128((__m128i *)(xq + i * QK), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(xq + i * QK + 16), _mm512_cvtsepi32_epi8(qb));
        dx[i] = d;
        sx[i] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
        cx[i] = -8.0f * d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    }
}

/* One group (16 weight rows, Q4_0 / Q4_1) against MT rows of int8 activations, for prefill: a vpdpbusd multiplies
 * 4 unsigned nibbles of each of 16 rows by the same 4 activations (one broadcast int32), 64 multiply-adds where
 * vpdpwssd does 32, so a block is 8 of them a row instead of 16. The nibbles need no widening: a 64-byte vector of
 * the R16 block masked with 0x0f holds, in lane r, row r's weights 4j .. 4j + 3 (activations x[4j .. 4j + 3]);
 * shifted right by 4, weights 16 + 4j .. 16 + 4j + 3. Sums of 32 products of at most 15 x 127 fit int32 exactly.
 * The rounding error e of the activations meets the nibbles q (0..15), whose mean 7.5 would multiply sum(e): the
 * sum is taken centred instead, d (sum(q xq) - 8 sum(xq)) dx + (m + 8 d) sum(x) for Q4_1 (Q4_0: m = -8 d), which
 * cut the relative error of a random 576 x 960 product 2.3x (1.26e-2 -> 5.5e-3; int16: 4.8e-5). */
static inline __attribute__((always_inline)) void group_rows_i8(
        int type, const int MT, const uint8_t *wg, int64_t nb, const int8_t *xq, const float *dx, const float *sx,
        const float *cx, __m512 f[MAX_ROWS]) {
    const int64_t rb = r16_block_bytes(type), qo = quant_offset(type);
    const __m512i mask = _mm512_set1_epi8(0x0f);
    const int C = MT <= MAX_WIDE_TWO_CHAINS ? 2 : 1;  /* chains a row, as group_rows_wide (the sums are exact) */
    for (int i = 0; i < MT; i++) f[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = wg + b * rb;
        prefetch_weights(o + PREFETCH_BYTES, rb);  /* a decode row (decode_activations = "int8") is a GEMV */
        __m512i a[2 * MAX_WIDE_TWO_CHAINS > MAX_ROWS ? 2 * MAX_WIDE_TWO_CHAINS : MAX_ROWS];  /* [row][chain] */
        for (int i = 0; i < MT * C; i++) a[i] = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            const __m512i v = _mm512_loadu_si512((const void *)(o + qo + 64 * j));
            const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
            for (int i = 0; i < MT; i++) {
                const int32_t *xw = (const int32_t *)(xq + (i * nb + b) * QK);
                a[i * C] = _mm512_dpbusd_epi32(a[i * C], lo, _mm512_set1_epi32(xw[j]));
                a[i * C + C - 1] = _mm512_dpbusd_epi32(a[i * C + C - 1], hi, _mm512_set1_epi32(xw[4 + j]));
            }
        }
        const __m512 vd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)o));
        for (int i = 0; i < MT; i++) {
            const __m512i sum = C == 2 ? _mm512_add_epi32(a[2 * i], a[2 * i + 1]) : a[i];
            const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(dx[i * nb + b]),
                                             _mm512_set1_ps(cx[i * nb + b]));
            f[i] = _mm512_fmadd_ps(vd, t, f[i]);
        }
        if (type == R_Q4_1) {
            const __m512 vm = _mm512_fmadd_ps(vd, _mm512_set1_ps(8.0f),
                                              _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + 32))));
            for (int i = 0; i < MT; i++) f[i] = _mm512_fmadd_ps(vm, _mm512_set1_ps(sx[i * nb + b]), f[i]);
        }
    }
}

/* y [M, ldy] columns n_begin..n_end from xq: int16 activations (group_rows / group_rows_wide), or int8 when act8
 * (group_rows_i8, Q4_0 / Q4_1 only; cx its centring terms). act8 is a constant at each call: one path compiles. */
static inline __attribute__((always_inline)) void linear_groups(
        int type, const int act8, const uint8_t *wr, const void *xq, const float *dx, const float *sx,
        const float *cx, float *y, int64_t M, int64_t K, int64_t ldy, int64_t n_begin, int64_t n_end) {
    const int64_t nb = K / QK, gbytes = nb * r16_block_bytes(type);
    const int64_t mc = l2_chunk_rows(K, act8 ? 1 : (int64_t)sizeof(int16_t), MAX_ROWS);  /* r16.h */
    __m512 f[MAX_ROWS];
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
        const int64_t m1 = M - m0 > mc ? m0 + mc : M;
        for (int64_t g = n_begin / GROUP; g * GROUP < n_end; g++) {
            const uint8_t *wg = wr + g * gbytes;
            /* the next group's first blocks while this one computes: the hardware prefetcher alone lags a GEMV */
            if ((g + 1) * GROUP < n_end)
                prefetch_weights(wg + gbytes, gbytes < 4096 ? gbytes : 4096);
            const int64_t lo = g * GROUP, hi = lo + GROUP < n_end ? lo + GROUP : n_end;
            const __mmask16 keep = (__mmask16)((1u << (hi - lo)) - 1);
            for (int64_t i0 = m0; i0 < m1; i0 += MAX_ROWS) {
                const int64_t mt = m1 - i0 >= MAX_ROWS ? MAX_ROWS : m1 - i0;
                const int16_t *x16 = (const int16_t *)xq + i0 * K;
                const int8_t *x8 = (const int8_t *)xq + i0 * K;
                const float *dt = dx + i0 * nb, *st = sx + i0 * nb, *ct = act8 ? cx + i0 * nb : NULL;
#define NS_TILE(n)                                                                                                   \
                if (act8) group_rows_i8(type, n, wg, nb, x8, dt, st, ct, f);                                         \
                else if (n > MAX_NARROW_ROWS) group_rows_wide(type, n, wg, nb, x16, dt, st, f);                      \
                else group_rows(type, n, wg, nb, x16, dt, st, f);                                                    \
                break;
                switch (mt) {  /* constant tile sizes unroll fully */
                    case 12: NS_TILE(12)
                    case 11: NS_TILE(11)
                    case 10: NS_TILE(10)
                    case 9: NS_TILE(9)
                    case 8: NS_TILE(8)
                    case 7: NS_TILE(7)
                    case 6: NS_TILE(6)
                    case 5: NS_TILE(5)
                    case 4: NS_TILE(4)
                    case 3: NS_TILE(3)
                    case 2: NS_TILE(2)
                    default: NS_TILE(1)
                }
#undef NS_TILE
                for (int64_t i = 0; i < mt; i++) _mm512_mask_storeu_ps(y + (i0 + i) * ldy + lo, keep, f[i]);
            }
        }
    }
}
#endif

/* y [M, ldy] columns n_begin..n_end (n_begin a multiple of 16) = x [M, K] @ W^T, W in R16 (with R_BF16, in bf16:
 * bf16_gemm.c; without AVX-512 VNNI, or with R_AVX2 / R_AVXVNNI, on 256-bit registers: r16_avx2.c). Returns 0; -1
 * when out of memory or this build lacks the kernel (callers only pass R16 weights when ns_r16_supported(), and
 * R_BF16 when ns_bf16_gemm_supported()). */
int ns_linear_r16_bf16(int type, const uint8_t *wr, const float *x, float *y, int64_t M, int64_t K, int64_t ldy,
                       int64_t n_begin, int64_t n_end);  /* bf16_gemm.c */

int ns_linear_r16(int type, const uint8_t *wr, const float *x, float *y, int64_t M, int64_t K, int64_t ldy,
                  int64_t n_begin, int64_t n_end) {
    if (type & R_BF16) return ns_linear_r16_bf16(type & 0xff, wr, x, y, M, K, ldy, n_begin, n_end);
    if (!NS_R16 || (type & R_256)) return ns_linear_r256(type, wr, x, y, M, K, ldy, n_begin, n_end);
#if NS_R16
    const int64_t nb = K / QK;
    if ((type & R_ACT8) && ((type & 0xff) == R_Q4_0 || (type & 0xff) == R_Q4_1)) {
        int8_t *xq = malloc((size_t)(M * K > 0 ? M * K : 1));
        float *dsc = malloc(sizeof(float) * (size_t)(3 * M * nb + 1));  /* dx, sx, cx */
        if (!xq || !dsc) { free(xq); free(dsc); return -1; }
        float *dx = dsc, *sx = dsc + M * nb, *cx = dsc + 2 * M * nb;
        quantize_rows_i8(x, M, K, xq, dx, sx, cx);
        if ((type & 0xff) == R_Q4_0) linear_groups(R_Q4_0, 1, wr, xq, dx, sx, cx, y, M, K, ldy, n_begin, n_end);
        else linear_groups(R_Q4_1, 1, wr, xq, dx, sx, cx, y, M, K, ldy, n_begin, n_end);
        free(xq); free(dsc);
        return 0;
    }
    type &= 0xff;
    int16_t *xq = malloc(sizeof(int16_t) * (size_t)(M * K > 0 ? M * K : 1));
    float *dx = malloc(sizeof(float) * (size_t)(M * nb + 1)), *sx = malloc(sizeof(float) * (size_t)(M * nb + 1));
    if (!xq || !dx || !sx) { free(xq); free(dx); free(sx); return -1; }
    quantize_rows(type, x, M, K, xq, dx, sx);
    switch (type) {
        case R_Q4_0: linear_groups(R_Q4_0, 0, wr, xq, dx, sx, NULL, y, M, K, ldy, n_begin, n_end); break;
        case R_Q4_1: linear_groups(R_Q4_1, 0, wr, xq, dx, sx, NULL, y, M, K, ldy, n_begin, n_end); break;
        default: linear_groups(R_Q8_0, 0, wr, xq, dx, sx, NULL, y, M, K, ldy, n_begin, n_end); break;
    }
    free(xq); free(dx); free(sx);
    return 0;
#else
    (void)type; (void)wr; (void)x; (void)y; (void)M; (void)K; (void)ldy; (void)n_begin; (void)n_end;
    return -1;
#endif
}
