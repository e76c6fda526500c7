/* CPU kernels for nodeserve: GEMM over GGUF weight blocks with float32 activations, block dequantization, and
 * decode attention over the paged KV pool.
 *
 * Built on the host that runs it (nodeserve/kernels/native.py compiles this file with -march=native), so the
 * AVX2 paths below are taken on AVX2 and AVX-512 machines and the scalar ones elsewhere. Every function is
 * single-threaded and reentrant: each device worker owns one core and calls them from its own thread, with
 * the GIL released by ctypes.
 *
 * Weight layout: GGUF's own, row-major, each row K/32 blocks (ggml-common.h):
 *   Q4_0: { fp16 d; uint8 qs[16]; }          w[j] = d * (q[j] - 8)
 *   Q4_1: { fp16 d; fp16 m; uint8 qs[16]; }  w[j] = d * q[j] + m
 *   Q8_0: { fp16 d; int8 qs[32]; }           w[j] = d * q[j]
 * (Q5_1 and the K-quants Q4_K, Q5_K, Q6_K: kquant.c, which the two entry points below hand them to.)
 * 4-bit blocks keep weights 0..15 in the low nibbles of qs[0..15] and 16..31 in the high nibbles.
 * Activations stay float32: each block is dequantized in registers (d * q + m, with m = -8 d for Q4_0) and
 * multiplied with float32 x, so the result is the float32 product with the file's exact weights.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define NS_AVX2 1
#else
#define NS_AVX2 0
#endif
#include "decode_attn.h"
#include "prefetch.h"
#include "simd512.h"

enum { NS_Q4_0 = 2, NS_Q4_1 = 3, NS_Q8_0 = 8 };  /* ggml type ids */
#define NS_R16 0x100  /* type flag: the weights are repacked in 16-row groups for the VNNI kernels (vnni_gemm.c) */
int ns_linear_r16(int type, const uint8_t *wr, const float *x, float *y, int64_t M, int64_t K, int64_t ldy,
                  int64_t n_begin, int64_t n_end);
void ns_dequant_rows_r16(int type, const uint8_t *wr, int64_t K, const int64_t *rows, int64_t n_rows, float *out);
int ns_kq_type(int type);  /* kquant.c: Q5_1, Q4_K, Q5_K, Q6_K in their own layout */
void ns_kq_dequant_rows(int type, const uint8_t *w, int64_t K, const int64_t *rows, int64_t n_rows, float *out);
int ns_kq_linear(int type, const uint8_t *w, const float *x, float *y, int64_t M, int64_t K, int64_t ldy,
                 int64_t n_begin, int64_t n_end);
int ns_linear(int type, const uint8_t *w, const float *x, float *y, int64_t M, int64_t K, int64_t ldy,
              int64_t n_begin, int64_t n_end);  /* lend.c: splits with a lent core, then ns_linear_local */
int ns_paged_decode_attention(const float *q, const void *kv, const int64_t *block_tables, int64_t max_pages,
                              const int64_t *seq_lens, float *out, int64_t B, int64_t H, int64_t KH, int64_t D,
                              int64_t page_size, float scale, int kv_f16,
                              int64_t window);  /* lend.c: likewise, split by sequences */
#define QK 32
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 8
#endif
#define MAX_TILE 8  /* activation rows per pass over a weight row: 8 accumulators + 4 weight vectors fit 16 ymm */

/* Which cache the software prefetches fill, per machine: L1 (prefetcht0) or L2 (prefetcht1). One Zen 5 core read
 * scattered pages fastest into L1 (decode attention 21-22 GB/s, into L2 slower); one Zen 4 VM core's L1 miss
 * buffers held it to ~9 GB/s of its 27, where into L2 it read 20 (16 x 1,024 tokens: 2.9 -> 1.3 ms a layer), and
 * its GEMVs gained too. kernels/tuning.py times both on each machine and sets them here, once, before any call. */
int ns_pages_prefetch_l2 = 1, ns_weights_prefetch_l2 = 1;

void ns_set_prefetch_levels(int pages_l2, int weights_l2) {
    ns_pages_prefetch_l2 = pages_l2;
    ns_weights_prefetch_l2 = weights_l2;
}

static float fp16_to_fp32(uint16_t h) {
#if NS_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  /* subnormal: renormalise */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

float ns_fp16_to_fp32(uint16_t h) { return fp16_to_fp32(h); }  /* for vnni_gemm.c's row dequantization */

static size_t block_bytes(int type) {
    return type == NS_Q4_0 ? 18 : type == NS_Q4_1 ? 20 : 34;
}

/* One block's scale d, offset m and its 32 unsigned quants. */
static void block_scalars(int type, const uint8_t *blk, float *d, float *m) {
    uint16_t h[2];
    memcpy(h, blk, 4);
    *d = fp16_to_fp32(h[0]);
    *m = type == NS_Q4_1 ? fp16_to_fp32(h[1]) : type == NS_Q4_0 ? -8.0f * *d : 0.0f;
}

static const uint8_t *block_quants(int type, const uint8_t *blk) {
    return blk + (type == NS_Q4_1 ? 4 : 2);
}

/* ---------- dequantization ---------- */

static void dequant_row(int type, const uint8_t *row, float *out, int64_t K) {
    const size_t bb = block_bytes(type);
    for (int64_t b = 0; b < K / QK; b++) {
        const uint8_t *blk = row + b * bb, *qs = block_quants(type, blk);
        float d, m;
        block_scalars(type, blk, &d, &m);
        float *o = out + b * QK;
#if NS_AVX2
        const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
        const __m128i v = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0f);
        const __m128i lo = type == NS_Q8_0 ? v : _mm_and_si128(v, mask);
        const __m128i hi = type == NS_Q8_0 ? _mm_loadu_si128((const __m128i *)(qs + 16))
                                           : _mm_and_si128(_mm_srli_epi16(v, 4), mask);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int j = 0; j < 4; j++) {
            const __m256i w = type == NS_Q8_0 ? _mm256_cvtepi8_epi32(parts[j]) : _mm256_cvtepu8_epi32(parts[j]);
            /* d * q + m rounded twice, as gguf's dequantize does: the dense path's exact weights */
            _mm256_storeu_ps(o + 8 * j, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(w), vd), vm));
        }
        continue;
#endif
        if (type == NS_Q8_0) {
            for (int j = 0; j < QK; j++) o[j] = d * (float)(int8_t)qs[j];
        } else {
            for (int j = 0; j < QK / 2; j++) {
                o[j] = d * (float)(qs[j] & 0x0f) + m;
                o[j + QK / 2] = d * (float)(qs[j] >> 4) + m;
            }
        }
    }
}

/* out[i] = row rows[i] of w, dequantized: out [n_rows, K]. rows == NULL: every row 0..n_rows-1. */
void ns_dequant_rows(int type, const uint8_t *w, int64_t K, const int64_t *rows, int64_t n_rows, float *out) {
    if (type & NS_R16) {
        ns_dequant_rows_r16(type & 0xff, w, K, rows, n_rows, out);
        return;
    }
    if (ns_kq_type(type)) {
        ns_kq_dequant_rows(type, w, K, rows, n_rows, out);
        return;
    }
    const size_t row_bytes = (size_t)(K / QK) * block_bytes(type);
    for (int64_t i = 0; i < n_rows; i++) {
        const int64_t r = rows ? rows[i] : i;
        dequant_row(type, w + (size_t)r * row_bytes, out + i * K, K);
    }
}

/* ---------- GEMM: y[M, N] = x[M, K] @ W[N, K]^T over rows [n_begin, n_end) of W ---------- */

#if NS_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* A block's 32 weights as four float vectors w[0..3], in the order permute_x() puts x in. The quants are
 * widened with 32-bit shifts and masks, not byte shuffles (the shuffle port is what limited a cvtepu8
 * version): element e of w[j] is byte 4 * (e % 4) + j of the 16-byte half e / 4 for 4-bit types (low nibbles
 * in the first half, high nibbles in the second), byte 4 * e + j for Q8_0. */
static inline __attribute__((always_inline)) void dequant_block(int type, const uint8_t *blk, __m256 w[4]) {
    float d, m;
    block_scalars(type, blk, &d, &m);
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    const uint8_t *qs = block_quants(type, blk);
    if (type == NS_Q8_0) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)qs);
        w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24)), vd);
        w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 24)), vd);
        w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 8), 24)), vd);
        w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(v, 24)), vd);
    } else {
        const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
        const __m256i nib = _mm256_blend_epi32(v, _mm256_srli_epi32(v, 4), 0xf0), mask = _mm256_set1_epi32(0x0f);
        w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(nib, mask)), vd, vm);
        w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(nib, 8), mask)), vd, vm);
        w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(nib, 16), mask)), vd, vm);
        w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(nib, 24), mask)), vd, vm);
    }
}

/* x [M, K] -> xp [M, K] with each block's 32 values in dequant_block's order: xp[j * 8 + e] = x[src(j, e)]. */
static void permute_x(int type, const float *x, float *xp, int64_t M, int64_t K) {
    for (int64_t i = 0; i < M * K; i += QK)
        for (int j = 0; j < 4; j++)
            for (int e = 0; e < 8; e++)
                xp[i + j * 8 + e] = x[i + (type == NS_Q8_0 ? 4 * e + j : 16 * (e / 4) + 4 * (e % 4) + j)];
}

/* One weight row against MT activation rows: the block is dequantized once for all of them. One accumulator per
 * row: with MT = 8, eight independent FMA chains cover the FMA latency. */
static inline __attribute__((always_inline)) void dot_rows(
        int type, const int MT, const uint8_t *wrow, const float *xp, int64_t K, float *y, int64_t ldy) {
    const size_t bb = block_bytes(type);
    const int64_t nb = K / QK;
    __m256 acc[MAX_TILE], w[4];
    for (int i = 0; i < MT; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        dequant_block(type, wrow + b * bb, w);
        for (int i = 0; i < MT; i++) {
            const float *xb = xp + i * K + b * QK;
            acc[i] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), acc[i]);
            acc[i] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), acc[i]);
            acc[i] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), acc[i]);
            acc[i] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), acc[i]);
        }
    }
    for (int i = 0; i < MT; i++) y[i * ldy] = hsum8(acc[i]);
}

/* One activation row (M = 1, batch-1 decode), quantized to int16 per 32-block: the weights are widened to int16
 * (one zero-extending load and a mask or shift) and multiplied in pairs by madd, about half the vector work of
 * widening them to float, and that work is what batch-1 decode is bound by on one core. An int16 activation keeps 15 bits per block (relative
 * error <= 2^-16 of the block's largest value), ~250x finer than llama.cpp's int8 activations.
 * xq: int16 values; dx[b]: block b's scale; sx[b] = sum(x_b). */
static void quantize_x16(const float *x, int64_t K, int16_t *xq, float *dx, float *sx) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f, sum = 0.0f;
        for (int j = 0; j < QK; j++) { amax = fmaxf(amax, fabsf(xb[j])); sum += xb[j]; }
        const float d = amax / 32767.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < QK; j++) xq[b * QK + j] = (int16_t)lrintf(xb[j] * inv);
        dx[b] = d;
        sx[b] = sum;
    }
}

/* Block b of one weight row times the int16 activations: 8 int32 partial sums. */
static inline __attribute__((always_inline)) __m256i block_dot_i16(int type, const uint8_t *qs, const int16_t *xb) {
    __m256i we, wo;  /* weights 0..15 and 16..31 as int16: one widening load each, or one for both */
    if (type == NS_Q8_0) {
        we = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)qs));
        wo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qs + 16)));
    } else {
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)qs));
        we = _mm256_and_si256(v, _mm256_set1_epi16(0x000f));
        wo = _mm256_srli_epi16(v, 4);
    }
    return _mm256_add_epi32(_mm256_madd_epi16(we, _mm256_loadu_si256((const __m256i *)xb)),
                            _mm256_madd_epi16(wo, _mm256_loadu_si256((const __m256i *)(xb + 16))));
}

/* Weight rows r0 and r1 against one int16 activation row, interleaved: two rows' independent chains keep
 * the vector units busy while the next blocks load, and the activation loads are shared. */
static inline __attribute__((always_inline)) void dot_rows2_i16(
        int type, const uint8_t *r0, const uint8_t *r1, const int16_t *xq, const float *dx, const float *sx,
        int64_t nb, float *y0, float *y1) {
    const size_t bb = block_bytes(type);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    __m128 m0 = _mm_setzero_ps(), m1 = m0;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *k0 = r0 + b * bb, *k1 = r1 + b * bb;
        /* d and m (Q4_1) of both rows' blocks: one widening load and one conversion each, [d, m, ., .] */
        uint32_t h0, h1;
        memcpy(&h0, k0, 4);
        memcpy(&h1, k1, 4);
        const __m128 dm0 = _mm_cvtph_ps(_mm_cvtsi32_si128((int)h0)), dm1 = _mm_cvtph_ps(_mm_cvtsi32_si128((int)h1));
        const __m128 vdx = _mm_load_ss(dx + b);
        const __m256i p0 = block_dot_i16(type, block_quants(type, k0), xq + b * QK);
        const __m256i p1 = block_dot_i16(type, block_quants(type, k1), xq + b * QK);
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_broadcastss_ps(_mm_mul_ss(dm0, vdx)), a0);
        a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_broadcastss_ps(_mm_mul_ss(dm1, vdx)), a1);
        if (type == NS_Q4_1) {  /* + m * sum(x_b), in lane 0 */
            const __m128 vsx = _mm_load_ss(sx + b);
            m0 = _mm_fmadd_ss(_mm_movehdup_ps(dm0), vsx, m0);
            m1 = _mm_fmadd_ss(_mm_movehdup_ps(dm1), vsx, m1);
        } else if (type == NS_Q4_0) {  /* m = -8 d */
            const __m128 vsx = _mm_load_ss(sx + b);
            m0 = _mm_fmadd_ss(_mm_mul_ss(dm0, _mm_set_ss(-8.0f)), vsx, m0);
            m1 = _mm_fmadd_ss(_mm_mul_ss(dm1, _mm_set_ss(-8.0f)), vsx, m1);
        }
    }
    *y0 = hsum8(a0) + _mm_cvtss_f32(m0);
    *y1 = hsum8(a1) + _mm_cvtss_f32(m1);
}

/* y [M, ldy] (columns n_begin..n_end written), x [M, K] contiguous rows, K % 32 == 0. Returns 0, or -1 when
 * out of memory. The weight row stays in L1 while every tile of activation rows passes over it, so weights
 * are read from memory once per call whatever M is. */
struct x16 { int16_t *q; float *d, *s; };

static inline __attribute__((always_inline)) void linear_rows(
        int type, const uint8_t *w, const float *xp, const struct x16 *x16, float *y, int64_t M, int64_t K,
        int64_t ldy, int64_t n_begin, int64_t n_end) {
    const int64_t nb = K / QK;
    const size_t row_bytes = (size_t)nb * block_bytes(type);
    if (x16) {  /* one activation row: two weight rows at a time */
        int64_t n = n_begin;
        for (; n + 1 < n_end; n += 2) {
            const uint8_t *wrow = w + (size_t)n * row_bytes;
            /* The hardware prefetcher alone leaves a GEMV well short of the core's read bandwidth: ask for
             * the rows PREFETCH_ROWS ahead while these compute. */
            if (n + PREFETCH_ROWS + 1 < n_end) prefetch_weights(wrow + PREFETCH_ROWS * row_bytes, 2 * (int64_t)row_bytes);
            dot_rows2_i16(type, wrow, wrow + row_bytes, x16->q, x16->d, x16->s, nb, y + n, y + n + 1);
        }
        if (n < n_end) {
            float unused;
            const uint8_t *wrow = w + (size_t)n * row_bytes;
            dot_rows2_i16(type, wrow, wrow, x16->q, x16->d, x16->s, nb, y + n, &unused);
        }
        return;
    }
    for (int64_t n = n_begin; n < n_end; n++) {
        const uint8_t *wrow = w + (size_t)n * row_bytes;
        if (n + PREFETCH_ROWS < n_end) prefetch_weights(wrow + PREFETCH_ROWS * row_bytes, (int64_t)row_bytes);
        for (int64_t i0 = 0; i0 < M; i0 += MAX_TILE) {
            const float *xt = xp + i0 * K;
            float *yt = y + i0 * ldy + n;
            switch (M - i0 >= MAX_TILE ? MAX_TILE : (int)(M - i0)) {  /* constant tile sizes unroll fully */
                case 8: dot_rows(type, 8, wrow, xt, K, yt, ldy); break;
                case 7: dot_rows(type, 7, wrow, xt, K, yt, ldy); break;
                case 6: dot_rows(type, 6, wrow, xt, K, yt, ldy); break;
                case 5: dot_rows(type, 5, wrow, xt, K, yt, ldy); break;
                case 4: dot_rows(type, 4, wrow, xt, K, yt, ldy); break;
                case 3: dot_rows(type, 3, wrow, xt, K, yt, ldy); break;
                case 2: dot_rows(type, 2, wrow, xt, K, yt, ldy); break;
                default: dot_rows(type, 1, wrow, xt, K, yt, ldy); break;
            }
        }
    }
}
#endif

/* ns_linear (lend.c) calls this for its rows, and for the half a lent core's helper thread takes. */
int ns_linear_local(int type, const uint8_t *w, const float *x, float *y, int64_t M, int64_t K, int64_t ldy,
                    int64_t n_begin, int64_t n_end) {
    if (type & NS_R16) return ns_linear_r16(type & ~NS_R16, w, x, y, M, K, ldy, n_begin, n_end);
    if (ns_kq_type(type)) return ns_kq_linear(type, w, x, y, M, K, ldy, n_begin, n_end);
    const int64_t nb = K / QK;
    const size_t row_bytes = (size_t)nb * block_bytes(type);
#if NS_AVX2
    float *xp = malloc(sizeof(float) * (size_t)(M * K > 0 ? M * K : 1));
    if (!xp) return -1;
    struct x16 q16 = {NULL, NULL, NULL}, *x16 = NULL;
    if (M == 1) {
        q16.q = malloc(sizeof(int16_t) * (size_t)K);
        q16.d = malloc(sizeof(float) * (size_t)(nb + 1));
        q16.s = malloc(sizeof(float) * (size_t)(nb + 1));
        if (!q16.q || !q16.d || !q16.s) { free(q16.q); free(q16.d); free(q16.s); free(xp); return -1; }
        quantize_x16(x, K, q16.q, q16.d, q16.s);
        x16 = &q16;
    } else {
        permute_x(type, x, xp, M, K);
    }
    switch (type) {  /* a constant type per instance: no per-block branches on it */
        case NS_Q4_0: linear_rows(NS_Q4_0, w, xp, x16, y, M, K, ldy, n_begin, n_end); break;
        case NS_Q4_1: linear_rows(NS_Q4_1, w, xp, x16, y, M, K, ldy, n_begin, n_end); break;
        default: linear_rows(NS_Q8_0, w, xp, x16, y, M, K, ldy, n_begin, n_end); break;
    }
    free(q16.q); free(q16.d); free(q16.s);
    free(xp);
#else
    float *tmp = malloc(sizeof(float) * (size_t)K);
    if (!tmp) return -1;
    for (int64_t n = n_begin; n < n_end; n++) {
        dequant_row(type, w + (size_t)n * row_bytes, tmp, K);
        for (int64_t i = 0; i < M; i++) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += tmp[k] * x[i * K + k];
            y[i * ldy + n] = s;
        }
    }
    free(tmp);
#endif
    return 0;
}

/* ---------- decode attention over the paged pool (float32) ---------- */

#if NS_AVX2
/* exp(x) for x <= 0 (softmax arguments after subtracting the max): Cephes' expf polynomial, ~1 ulp. */
static inline __m256 exp256(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    x = _mm256_max_ps(x, lo);
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

/* p[0..n) = exp(p - mx) in place (mx >= every p); returns their sum. */
static float softmax_numerators_max(float *p, int64_t n, float mx) {
    float sum = 0.0f;
    int64_t t = 0;
#if NS_AVX2
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + t), vmx));
        _mm256_storeu_ps(p + t, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    sum = hsum8(vsum);
#endif
    for (; t < n; t++) { p[t] = expf(p[t] - mx); sum += p[t]; }
    return sum;
}

/* p[0..n) = exp(p - max(p)) in place; returns their sum. */
static float softmax_numerators(float *p, int64_t n) {
    float mx = -INFINITY;
    for (int64_t t = 0; t < n; t++) mx = p[t] > mx ? p[t] : mx;
    return softmax_numerators_max(p, n, mx);
}

/* KV pools hold float32, or float16 (kv_f16: half the bytes a token). F16C converts, so float16 pools are read
 * and written by AVX2 builds only (the entry points return -1 elsewhere and callers use torch). */
static inline float kv_at(const void *kv, int64_t i, const int f16) {
#if NS_AVX2
    if (f16) return _cvtsh_ss(((const uint16_t *)kv)[i]);
#endif
    (void)f16;
    return ((const float *)kv)[i];
}

#if NS_AVX2
static inline __attribute__((always_inline)) __m256 kv_load8(const void *kv, int64_t i, const int f16) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)kv + i)))
               : _mm256_loadu_ps((const float *)kv + i);
}
#endif

static inline float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#if NS_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    s = hsum8(acc);
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float a, const float *x, float *y, int64_t n) {
    int64_t i = 0;
#if NS_AVX2
    const __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += a * x[i];
}

#if NS_AVX2
/* [sum(a[0]), ..., sum(a[7])]: eight horizontal sums in 6 hadds, 2 permutes and 1 add. */
static inline __m256 hsum8x8(const __m256 a[8]) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Scores of one query head (pre-scaled, in D8 registers) against n keys token_stride apart: out[0..n). Eight
 * keys at a time accumulate in eight registers and one transpose-reduce gives their eight scores. */
static inline __attribute__((always_inline)) void page_scores(
        const int D8, const int f16, const __m256 *vq, const void *kv, int64_t k, int64_t n, int64_t token_stride,
        float *out) {
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        __m256 acc[8];
        for (int j = 0; j < 8; j++) {
            const int64_t kt = k + (t + j) * token_stride;
            acc[j] = _mm256_mul_ps(vq[0], kv_load8(kv, kt, f16));
            for (int c = 1; c < D8; c++) acc[j] = _mm256_fmadd_ps(vq[c], kv_load8(kv, kt + 8 * c, f16), acc[j]);
        }
        _mm256_storeu_ps(out + t, hsum8x8(acc));
    }
    for (; t < n; t++) {
        const int64_t kt = k + t * token_stride;
        __m256 acc = _mm256_mul_ps(vq[0], kv_load8(kv, kt, f16));
        for (int c = 1; c < D8; c++) acc = _mm256_fmadd_ps(vq[c], kv_load8(kv, kt + 8 * c, f16), acc);
        out[t] = hsum8(acc);
    }
}

/* Pages are scattered, so the hardware prefetcher cannot follow: while page ip computes, each head asks for a
 * share of the lines of a page ahead (decode_attn.h). A whole page asked for at once overflows the miss queue and
 * most requests are dropped: a decode step of 16 x 1,024 tokens took 57 ms so, 41 ms with the requests spread (one
 * core, Zen 5, into L1). */
void ns_prefetch_page_share(const void *kv, ns_seq_pages seq, ns_seq_pages next, int asked, int64_t ip,
                            int64_t page_bytes, int64_t from, int64_t share) {
    /* In 4-byte words, both bounds tested each time: a tighter loop (one bound, precomputed) issued the same
     * requests faster and decode attention at 16 x 1,024 tokens took 4-12 % longer (one Zen 5 core, into L1). */
    const int64_t page_words = page_bytes / 4;
    for (int64_t a = ip || asked ? PAGES_AHEAD : 1; a <= PAGES_AHEAD; a++) {
        const int64_t j = ip + a;
        int64_t p;
        if (j < seq.num_pages) p = seq.table[j];
        else if (j - seq.num_pages < next.num_pages) p = next.table[j - seq.num_pages];
        else break;
        const char *page = (const char *)((const float *)kv + p * page_words);
        if (ns_pages_prefetch_l2)
            for (int64_t off = from; off < from + share && off < page_words * 4; off += 64)
                __builtin_prefetch(page + off, 0, 2);
        else
            for (int64_t off = from; off < from + share && off < page_words * 4; off += 64)
                __builtin_prefetch(page + off, 0, 3);
    }
}

/* Every query head (H of them, G per KV head) of R rows of one sequence (a verify step's, or one decode), for
 * head_dim 8 * D8, row r over keys first[r] .. len[r] - 1, page by page with an online softmax (running max m,
 * running sum l, output rescaled when the max grows): each page's K and V are read from memory once, in address
 * order, and stay in L1 while every head of every row reads its part; each row's arithmetic is the one it would
 * have alone, bit for bit. Nothing before a row's key first is read (a sliding window: those slots may be freed
 * and hold anything). q, out [R, H, D]; p: page_size floats of scratch; m, l: R H floats each. */
static inline __attribute__((always_inline)) void attend_rows(
        const int D8, const int f16, const float *q, int64_t R, int64_t H, int64_t G, const void *kv,
        const int64_t *table, const int64_t *first, const int64_t *len, int64_t page_size, int64_t page_stride,
        int64_t token_stride, float scale, float *p, float *m, float *l, float *out, ns_seq_pages next, int asked) {
    const int64_t page_bytes = page_stride * (f16 ? 2 : 4), D = 8 * D8;
    int64_t lo_key = first[0], hi_key = len[0];  /* the keys any row reads */
    for (int64_t r = 1; r < R; r++) {
        lo_key = first[r] < lo_key ? first[r] : lo_key;
        hi_key = len[r] > hi_key ? len[r] : hi_key;
    }
    const ns_seq_pages seq = ns_read_pages(table, lo_key, hi_key, page_size);
    for (int64_t g = 0; g < R * H; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    memset(out, 0, sizeof(float) * (size_t)(R * H * D));
    const int64_t fp = lo_key / page_size;  /* the first page read: the prefetch counts from it */
    for (int64_t t0 = fp * page_size; t0 < hi_key; t0 += page_size) {
        const int64_t ip = t0 / page_size, share = (page_bytes / 64 + H - 1) / H * 64;
        int prefetched = 0;
        for (int64_t r = 0; r < R; r++) {
            if (t0 >= len[r] || t0 + page_size <= first[r]) continue;  /* not one of row r's pages */
            const int64_t lo = t0 < first[r] ? first[r] - t0 : 0;  /* the page's first key read */
            const int64_t page = table[ip] * page_stride + lo * token_stride;  /* in elements */
            const int64_t n = (len[r] - t0 < page_size ? len[r] - t0 : page_size) - lo;
            const float *qr = q + r * H * D;
            float *outr = out + r * H * D, *mr = m + r * H, *lr = l + r * H;
            for (int64_t g = 0; g < H; g++) {  /* head g reads KV head g / G */
                if (!prefetched)  /* once a page, spread over the first row's heads */
                    ns_prefetch_page_share(kv, seq, next, asked, ip - fp, page_bytes, g * share, share);
                const int64_t k = page + (g / G) * D, v = k + page_size * token_stride;
                __m256 vq[16], acc[16];
                for (int c = 0; c < D8; c++)
                    vq[c] = _mm256_mul_ps(_mm256_loadu_ps(qr + g * D + 8 * c), _mm256_set1_ps(scale));
                page_scores(D8, f16, vq, kv, k, n, token_stride, p);
                float mx = mr[g];
                for (int64_t t = 0; t < n; t++) mx = p[t] > mx ? p[t] : mx;
                const float corr = expf(mr[g] - mx);  /* 0 on the first page (m = -inf) */
                const float psum = softmax_numerators_max(p, n, mx);
                lr[g] = lr[g] * corr + psum;
                mr[g] = mx;
                float *o = outr + g * D;
                const __m256 vc = _mm256_set1_ps(corr);
                for (int c = 0; c < D8; c++) acc[c] = _mm256_mul_ps(_mm256_loadu_ps(o + 8 * c), vc);
                int64_t vt = v;
                for (int64_t t = 0; t < n; t++, vt += token_stride) {
                    const __m256 w = _mm256_set1_ps(p[t]);
                    for (int c = 0; c < D8; c++) acc[c] = _mm256_fmadd_ps(w, kv_load8(kv, vt + 8 * c, f16), acc[c]);
                }
                for (int c = 0; c < D8; c++) _mm256_storeu_ps(o + 8 * c, acc[c]);
            }
            prefetched = 1;
        }
    }
    for (int64_t g = 0; g < R * H; g++) {
        const __m256 inv = _mm256_set1_ps(1.0f / l[g]);
        float *o = out + g * D;
        for (int c = 0; c < D8; c++) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(o + 8 * c), inv));
    }
}
#endif

/* Any head_dim, plainly, over keys first .. len - 1 (kv at element offset kh * D: the head's KV head).
 * row: D floats of scratch. */
static void attend_head_any(const float *q, const void *kv, int64_t kh, const int64_t *table, int64_t first,
                            int64_t len, int64_t page_size, int64_t page_stride, int64_t token_stride, int64_t D,
                            float scale, float *p, float *row, float *out, int f16) {
    for (int64_t t = first; t < len; t++) {
        const int64_t k = table[t / page_size] * page_stride + (t % page_size) * token_stride + kh * D;
        for (int64_t d = 0; d < D; d++) row[d] = kv_at(kv, k + d, f16);
        p[t - first] = dot(q, row, D) * scale;
    }
    const float inv = 1.0f / softmax_numerators(p, len - first);
    memset(out, 0, sizeof(float) * (size_t)D);
    for (int64_t t = first; t < len; t++) {
        const int64_t v = table[t / page_size] * page_stride + (page_size + t % page_size) * token_stride + kh * D;
        for (int64_t d = 0; d < D; d++) row[d] = kv_at(kv, v + d, f16);
        axpy(p[t - first] * inv, row, out, D);
    }
}

#define MAX_ROWS_READ_TOGETHER 16  /* a verify step's rows of one sequence attended in one pass over its pages */

/* One query token per row, K/V read where they lie in the pool: no gather, no padding.
 *   q [B, H, D]; kv [num_pages, 2, page_size, KH, D] (one layer, K at [:, 0], V at [:, 1]), float32 or, with
 *   kv_f16, float16;
 *   block_tables [B, max_pages]; seq_lens [B]; out [B, H, D];
 *   window: each query sees its last `window` positions (its own included), 0 all of them; the pages before
 *   the window are not read.
 * Flash-decoding's shape on one core: per sequence, page by page, an online softmax for every head, so each
 * K and V byte is read from memory once. Consecutive rows with the same page table (a verify step's rows of one
 * sequence, model_runner.verify_rows) are one sequence: its pages are read once for all of them.
 * Returns 0, or -1 when out of memory or (a float16 pool) this build has no F16C. */
int ns_paged_decode_attention_local(const float *q, const void *kv, const int64_t *block_tables,
                                    int64_t max_pages, const int64_t *seq_lens, float *out, int64_t B, int64_t H,
                                    int64_t KH, int64_t D, int64_t page_size, float scale, int kv_f16,
                                    int64_t window) {
    if (kv_f16 && !NS_AVX2) return -1;
    const int64_t G = H / KH, token_stride = KH * D, page_stride = 2 * page_size * token_stride;
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    /* scores (max_len), then the rows' running max and sum (2 R H), then one K or V row (D) */
    const int64_t ml_at = max_len + page_size + 8, row_at = ml_at + 2 * MAX_ROWS_READ_TOGETHER * H;
    float *p = malloc(sizeof(float) * (size_t)(row_at + D));
    if (!p) return -1;
    int64_t first[MAX_ROWS_READ_TOGETHER];
#define FIRST(b) (window > 0 && seq_lens[b] > window ? seq_lens[b] - window : 0)
    int asked = 0;  /* whether the sequence before asked for this one's first pages */
    for (int64_t b = 0, R; b < B; b += R) {
        const int64_t *table = block_tables + b * max_pages;
        for (R = 1; R < MAX_ROWS_READ_TOGETHER && b + R < B &&
                    !memcmp(table, table + R * max_pages, sizeof(int64_t) * (size_t)max_pages); R++) {}
        for (int64_t r = 0; r < R; r++) first[r] = FIRST(b + r);
        const float *qb = q + b * H * D;
        float *ob = out + b * H * D;
        const ns_seq_pages next = b + R < B ? ns_read_pages(table + R * max_pages, FIRST(b + R), seq_lens[b + R],
                                                            page_size)
                                            : (ns_seq_pages){NULL, 0};
        const int asks_next = ns_read_pages(table, first[0], seq_lens[b + R - 1], page_size).num_pages >= PAGES_AHEAD;
        if (ns_decode_attend_rows512(qb, R, kv, table, first, seq_lens + b, ob, H, KH, D, page_size, scale,
                                     p + ml_at, kv_f16, next, asked) == 0) {
            asked = asks_next;
            continue;
        }
#if NS_AVX2
        if (D == 64 || D == 128) {
            float *m = p + ml_at, *l = m + R * H;
#define NS_ATTEND(D8, f16) attend_rows(D8, f16, qb, R, H, G, kv, table, first, seq_lens + b, page_size, page_stride, \
                                       token_stride, scale, p, m, l, ob, next, asked)
            if (D == 64) { if (kv_f16) NS_ATTEND(8, 1); else NS_ATTEND(8, 0); }  /* constants: each one compiles */
            else { if (kv_f16) NS_ATTEND(16, 1); else NS_ATTEND(16, 0); }
#undef NS_ATTEND
            asked = asks_next;
            continue;
        }
#endif
        for (int64_t r = 0; r < R; r++)
            for (int64_t h = 0; h < H; h++)
                attend_head_any(qb + (r * H + h) * D, kv, h / G, table, first[r], seq_lens[b + r], page_size,
                                page_stride, token_stride, D, scale, p, p + row_at, ob + (r * H + h) * D, kv_f16);
    }
#undef FIRST
    free(p);
    return 0;
}

/* ---------- the model's pointwise ops (float32), one call each instead of 4-10 torch ops ---------- */

static float sum_squares(const float *x, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#if NS_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) { const __m256 v = _mm256_loadu_ps(x + i); acc = _mm256_fmadd_ps(v, v, acc); }
    s = hsum8(acc);
#endif
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

static void scale_mul(const float *x, float r, const float *w, float *out, int64_t n) {
    int64_t i = 0;
#if NS_AVX2
    const __m256 vr = _mm256_set1_ps(r);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), vr)));
#endif
    for (; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* out[t] = w * (x[t] / sqrt(mean(x[t]^2) + eps)): x [T, H] rows ldx apart, out [T, H] contiguous. */
void ns_rms_norm(const float *x, int64_t ldx, const float *w, float *out, int64_t T, int64_t H, float eps) {
    for (int64_t t = 0; t < T; t++) {
        const float r = 1.0f / sqrtf(sum_squares(x + t * ldx, H) / (float)H + eps);
        scale_mul(x + t * ldx, r, w, out + t * H, H);
    }
}

/* In place, both [T, H] contiguous: res += x, then x = rms_norm(res). */
void ns_add_rms_norm(float *x, float *res, const float *w, int64_t T, int64_t H, float eps) {
    for (int64_t i = 0; i < T * H; i++) res[i] += x[i];
    ns_rms_norm(res, H, w, x, T, H, eps);
}

/* out [T, I] = silu(gu[:, :I]) * gu[:, I:], gu [T, 2I] contiguous. */
void ns_silu_and_mul(const float *gu, float *out, int64_t T, int64_t I) {
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
#if NS_AVX512
        /* twice the width of the AVX2 loop below: a 2,048-token prompt's 30 layers took 38 ms in it on a Zen 5
         * core, compute-bound (0.4 ns a value in cache or not) */
        const __m512 one16 = _mm512_set1_ps(1.0f), minus_log2e = _mm512_set1_ps(-1.4426950408889634f);
        for (; i + 16 <= I; i += 16) {
            const __m512 vg = _mm512_loadu_ps(g + i);
            const __m512 e = exp2_ps(_mm512_mul_ps(_mm512_abs_ps(vg), minus_log2e));  /* exp(-|g|) <= 1 */
            const __m512 r = _mm512_div_ps(one16, _mm512_add_ps(one16, e));
            const __mmask16 neg = _mm512_cmp_ps_mask(vg, _mm512_setzero_ps(), _CMP_LT_OQ);
            const __m512 sig = _mm512_mask_mul_ps(r, neg, e, r);  /* r for g >= 0, e * r for g < 0 */
            _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_mul_ps(vg, sig), _mm512_loadu_ps(u + i)));
        }
#endif
#if NS_AVX2
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        for (; i + 8 <= I; i += 8) {
            const __m256 vg = _mm256_loadu_ps(g + i);
            const __m256 e = exp256(_mm256_or_ps(vg, sign));  /* exp(-|g|) <= 1: no overflow */
            const __m256 r = _mm256_div_ps(one, _mm256_add_ps(one, e));
            /* sigmoid(g) = 1 / (1 + exp(-g)): r for g >= 0, e * r for g < 0 */
            const __m256 sig = _mm256_blendv_ps(r, _mm256_mul_ps(e, r), vg);
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(vg, sig), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Rotate-half RoPE in place on q [T, H, D] and k [T, KH, D] (rows ldq / ldk apart, heads contiguous within a
 * row). cos_sin [max_pos, D]: cos of position p's D/2 angles, then their sin. */
static void rope_rows(float *x, int64_t ld, int64_t T, int64_t heads, int64_t D, const int64_t *pos,
                      const float *cos_sin) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_sin + pos[t] * D, *s = c + half;
        for (int64_t h = 0; h < heads; h++) {
            float *a = x + t * ld + h * D, *b = a + half;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = a[i], x2 = b[i];
                a[i] = x1 * c[i] - x2 * s[i];
                b[i] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

void ns_rope(float *q, int64_t ldq, float *k, int64_t ldk, const int64_t *pos, const float *cos_sin, int64_t T,
             int64_t H, int64_t KH, int64_t D) {
    rope_rows(q, ldq, T, H, D, pos, cos_sin);
    rope_rows(k, ldk, T, KH, D, pos, cos_sin);
}

/* Scatter T tokens' K and V ([T, KH * D] rows ldk / ldv apart) into one layer of the pool [num_pages, 2,
 * page_size, KH, D] (float32, or float16 with kv_f16, rounded to nearest) at flat slots page * page_size +
 * offset. Returns 0, or -1 for a float16 pool in a build without F16C. */
int ns_write_kv(void *kv, const float *k, int64_t ldk, const float *v, int64_t ldv, const int64_t *slots,
                int64_t T, int64_t KH, int64_t D, int64_t page_size, int kv_f16) {
    const int64_t row = KH * D;
    if (kv_f16 && !NS_AVX2) return -1;
    for (int64_t t = 0; t < T; t++) {
        const int64_t dst = (slots[t] / page_size) * 2 * page_size * row + (slots[t] % page_size) * row;
        if (!kv_f16) {
            memcpy((float *)kv + dst, k + t * ldk, sizeof(float) * (size_t)row);
            memcpy((float *)kv + dst + page_size * row, v + t * ldv, sizeof(float) * (size_t)row);
            continue;
        }
#if NS_AVX2
        for (int side = 0; side < 2; side++) {
            const float *src = side ? v + t * ldv : k + t * ldk;
            uint16_t *out = (uint16_t *)kv + dst + side * page_size * row;
            int64_t i = 0;
            for (; i + 8 <= row; i += 8)
                _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
            for (; i < row; i++) out[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
        }
#endif
    }
    return 0;
}

/* ---------- one decoder layer for a decode-only step: the Llama layer of model/llama.py in one call ---------- */

/* A layer's weights and shapes, filled once at load (model/native_decoder.py mirrors this struct). */
struct ns_layer {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps;
    const float *input_norm, *post_norm, *qkv_bias;  /* qkv_bias may be NULL */
    const uint8_t *qkv, *o, *gate_up, *down;
    int32_t qkv_type, o_type, gate_up_type, down_type;
    int64_t window;  /* attention's sliding window (0: none), as ns_paged_decode_attention takes it */
    /* What Qwen3 and Gemma 3 add (model/registry.py), NULL / 0 where a family has none: RMSNorm over each head's
     * q and k before RoPE; norms of attention's and the MLP's outputs before their residual adds (post_norm is
     * then the norm before the MLP); this layer's RoPE table when it is not the step's (Gemma's local layers);
     * the gated MLP's activation, 0 SiLU or 1 GELU (tanh). */
    const float *q_norm, *k_norm, *attn_out_norm, *mlp_out_norm, *cos_sin;
    int64_t gelu;
};

/* One decode step's rows and where their KV lives, filled once per step. */
struct ns_step {
    int64_t num_rows, max_pages, page_size;
    const int64_t *positions, *slots, *block_tables, *seq_lens;
    const float *cos_sin;
    float scale;
    int64_t kv_f16;  /* the pool's dtype: float32 (0) or float16 (1) */
    void *group;     /* a tensor-parallel group (allreduce.c) whose ranks hold shards of the layer, or NULL */
    int64_t rank;    /* this shard's rank in group */
};

/* out [T, I] = gelu_tanh(gu[:, :I]) * gu[:, I:] (GeGLU: torch's gelu(approximate="tanh") formula, in float32
 * with tanhf; decode rows only, a few thousand values a layer). */
static void gelu_tanh_and_mul(const float *gu, float *out, int64_t T, int64_t I) {
    const float k0 = 0.7978845608028654f, k1 = 0.044715f;  /* sqrt(2 / pi) */
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        for (int64_t i = 0; i < I; i++) {
            const float v = g[i];
            out[t * I + i] = 0.5f * v * (1.0f + tanhf(k0 * (v + k1 * v * v * v))) * u[i];
        }
    }
}

int ns_group_allreduce(void *g, int64_t rank, float *buf, int64_t n);  /* allreduce.c */
void ns_group_abort(void *g);

/* x [T, hidden], the residual stream, in place: x += attn(norm(x)); x += mlp(norm(x)), for T rows that each
 * decode one token; kv is this layer's float32 pool [num_pages, 2, page_size, KH, D]. The same kernels, in the
 * same order, as the per-op path (LlamaModel.forward with NativeOps and the paged attention): one call per
 * layer instead of ~50 Python-level ops.
 *
 * With S->group, L is this rank's shard (Megatron): its query / KV heads and its intermediate columns, with the
 * matching input columns of o and down, so each of those two products is a partial sum that is all-reduced
 * over the group before it joins the residual stream (which every rank holds whole). Returns 0, or -1 when out
 * of memory or the all-reduce failed (the group was aborted: a peer failed). */
int ns_decode_layer(const struct ns_layer *L, const struct ns_step *S, float *x, void *kv) {
    const int64_t T = S->num_rows, H = L->hidden, D = L->head_dim, NH = L->num_heads, KH = L->num_kv_heads;
    const int64_t q_size = NH * D, kv_size = KH * D, n_qkv = q_size + 2 * kv_size, I = L->intermediate;
    float *buf = malloc(sizeof(float) * (size_t)(T * (H + n_qkv + q_size + q_size + 2 * I + I + H)));
    if (!buf) {
        if (S->group) ns_group_abort(S->group);  /* this rank never reaches the reduce: its peers must not wait */
        return -1;
    }
    float *h = buf, *qkv = h + T * H, *q = qkv + T * n_qkv, *attn = q + T * q_size, *gu = attn + T * q_size;
    float *act = gu + T * 2 * I, *y = act + T * I;
    int err = 0;
    ns_rms_norm(x, H, L->input_norm, h, T, H, L->eps);
    err |= ns_linear(L->qkv_type, L->qkv, h, qkv, T, H, n_qkv, 0, n_qkv);
    if (L->qkv_bias)
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < n_qkv; j++) qkv[t * n_qkv + j] += L->qkv_bias[j];
    if (L->q_norm)  /* per head, in place: each row's heads are contiguous */
        for (int64_t t = 0; t < T; t++) {
            ns_rms_norm(qkv + t * n_qkv, D, L->q_norm, qkv + t * n_qkv, NH, D, L->eps);
            ns_rms_norm(qkv + t * n_qkv + q_size, D, L->k_norm, qkv + t * n_qkv + q_size, KH, D, L->eps);
        }
    ns_rope(qkv, n_qkv, qkv + q_size, n_qkv, S->positions, L->cos_sin ? L->cos_sin : S->cos_sin, T, NH, KH, D);
    err |= ns_write_kv(kv, qkv + q_size, n_qkv, qkv + q_size + kv_size, n_qkv, S->slots, T, KH, D, S->page_size,
                       (int)S->kv_f16);
    for (int64_t t = 0; t < T; t++) memcpy(q + t * q_size, qkv + t * n_qkv, sizeof(float) * (size_t)q_size);
    err |= ns_paged_decode_attention(q, kv, S->block_tables, S->max_pages, S->seq_lens, attn, T, NH, KH, D,
                                     S->page_size, S->scale, (int)S->kv_f16, L->window);
    err |= ns_linear(L->o_type, L->o, attn, y, T, q_size, H, 0, H);
    if (S->group && ns_group_allreduce(S->group, S->rank, y, T * H)) goto failed;
    if (L->attn_out_norm) ns_rms_norm(y, H, L->attn_out_norm, y, T, H, L->eps);
    ns_add_rms_norm(y, x, L->post_norm, T, H, L->eps);  /* x += o; y = norm(x) */
    err |= ns_linear(L->gate_up_type, L->gate_up, y, gu, T, H, 2 * I, 0, 2 * I);
    if (L->gelu) gelu_tanh_and_mul(gu, act, T, I);
    else ns_silu_and_mul(gu, act, T, I);
    err |= ns_linear(L->down_type, L->down, act, y, T, I, H, 0, H);
    if (S->group && ns_group_allreduce(S->group, S->rank, y, T * H)) goto failed;
    if (L->mlp_out_norm) ns_rms_norm(y, H, L->mlp_out_norm, y, T, H, L->eps);
    for (int64_t i = 0; i < T * H; i++) x[i] += y[i];
    free(buf);
    return err ? -1 : 0;
failed:
    free(buf);
    return -1;
}

/* Every layer of a decode step in one call: layer i's K/V at kv + i * kv_layer_bytes (one pool allocation). One
   call per step instead of one per layer: on a tensor-parallel rank, each return to Python is a wait for the GIL,
   which the other ranks then wait for at the next all-reduce. */
int ns_decode_layers(const struct ns_layer *layers, int64_t num_layers, const struct ns_step *S, float *x, char *kv,
                     int64_t kv_layer_bytes) {
    for (int64_t i = 0; i < num_layers; i++)
        if (ns_decode_layer(&layers[i], S, x, kv + i * kv_layer_bytes)) return -1;
    return 0;
}

/* For the build check: which paths this binary takes. */
int ns_isa(void) { return NS_AVX2 ? 2 : 0; }
