/* GGUF's Q5_1 and K-quant blocks (Q4_K, Q5_K, Q6_K) in the file's own layout: row dequantization and the GEMM
 * y = x @ W^T with float32 activations, for cpu_kernels.c's ns_dequant_rows and ns_linear_local.
 *
 * Layouts (llama.cpp's ggml-common.h; gguf/quants.py dequantizes the same way), w: a weight, q: its quant:
 *   Q5_1 (32 w, 24 bytes):  { fp16 d, m; uint8 qh[4]; uint8 qs[16]; }          w = d * q + m, q 0..31
 *     q[j] = nibble j % 16 of qs (low nibbles for j < 16, high ones after) | bit j of qh as bit 4
 *   Q4_K (256 w, 144 bytes): { fp16 d, dmin; uint8 scales[12]; uint8 qs[128]; } w = (d * sc) * q - (dmin * mn)
 *     8 sub-blocks of 32 with 6-bit sc and mn packed in scales; sub-block 2i / 2i + 1: the low / high nibbles
 *     of qs[32i .. 32i + 32)
 *   Q5_K (256 w, 176 bytes): { fp16 d, dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128]; } Q4_K's, with bit s
 *     of qh[l] as bit 4 of sub-block s's quant l
 *   Q6_K (256 w, 210 bytes): { uint8 ql[128]; uint8 qh[64]; int8 scales[16]; fp16 d; } w = (d * sc) * (q - 32),
 *     16 sub-blocks of 16
 * Each block is unpacked to int8 quants (AVX2 shifts and masks, 32 a vector; plain C without AVX2) and a float
 * scale s and offset o per 16 weights: w = s * q + o, product and sum rounded apart, is gguf's numpy rounding
 * (Q6_K's o is -0.0, which leaves every product as it was), so dequantization is bit for bit gguf's.
 * GEMM, as cpu_kernels.c does for Q4_0/Q4_1/Q8_0: one activation row (batch-1 decode, AVX2) is rounded to int16
 * per 32 and multiplied with the int8 quants by madd; more rows (or no AVX2) take each weight row dequantized
 * to float32 in L1 against every activation row (AVX-512, AVX2 or scalar dot products): the float32 product with
 * the file's exact weights, only the order of the sums differs. No R16 / VNNI path yet (block_quant.repack leaves
 * these types as they are).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "prefetch.h"
#include "simd512.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define NS_KQ_AVX2 1  /* on AVX-512 machines too: the unpacking and the one-row path are AVX2 code */
#else
#define NS_KQ_AVX2 0
#endif

enum { KQ_Q5_1 = 7, KQ_Q4_K = 12, KQ_Q5_K = 13, KQ_Q6_K = 14 };  /* ggml type ids */
#define MAX_BLOCK 256  /* weights in the largest block */
#define KQ_TILE 4      /* activation rows a pass over a dequantized weight row */
#define KQ_PREFETCH_ROWS 4

float ns_fp16_to_fp32(uint16_t h);  /* cpu_kernels.c */

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if NS_KQ_AVX2
    return _cvtsh_ss(h);
#else
    return ns_fp16_to_fp32(h);
#endif
}

/* Whether `type` is one of this file's (then block_weights and block_bytes give its block's size). */
int ns_kq_type(int type) {
    return type == KQ_Q5_1 || type == KQ_Q4_K || type == KQ_Q5_K || type == KQ_Q6_K;
}

static int64_t block_weights(int type) { return type == KQ_Q5_1 ? 32 : 256; }

static int64_t block_bytes(int type) {
    return type == KQ_Q5_1 ? 24 : type == KQ_Q4_K ? 144 : type == KQ_Q5_K ? 176 : 210;
}

/* Q4_K / Q5_K's 12 bytes of packed 6-bit values as out[0..8) the 8 sub-blocks' scales, out[8..16) their mins
 * (llama.cpp's unpacking with 32-bit masks: the same values as get_scale_min_k4). */
static inline void k4_scales(const uint8_t *packed, uint8_t *out) {
    uint32_t u[4];
    memcpy(u, packed, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
    const uint32_t mins_lo = u[1] & 0x3f3f3f3f;
    u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
    u[2] = mins_lo;
    u[0] &= 0x3f3f3f3f;
    memcpy(out, u, 16);
}

/* Per 16 weights of one block: scale s and offset o, w = s * q + o. */
static inline void block_scales(int type, const uint8_t *blk, float *s, float *o) {
    if (type == KQ_Q5_1) {
        s[0] = s[1] = half_at(blk);
        o[0] = o[1] = half_at(blk + 2);
    } else if (type == KQ_Q4_K || type == KQ_Q5_K) {
        const float d = half_at(blk), dmin = half_at(blk + 2);
        uint8_t sm[16];
        k4_scales(blk + 4, sm);
        for (int j = 0; j < 8; j++) {
            s[2 * j] = s[2 * j + 1] = d * (float)sm[j];
            o[2 * j] = o[2 * j + 1] = -(dmin * (float)sm[8 + j]);  /* s q + o == s q - dmin mn, as gguf rounds it */
        }
    } else {  /* Q6_K */
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = half_at(blk + 208);
        for (int j = 0; j < 16; j++) {
            s[j] = d * (float)sc[j];
            o[j] = -0.0f;
        }
    }
}

#if NS_KQ_AVX2
/* Byte j of the result: 0xff where bit j of `bits` is set, else 0. */
static inline __m256i bits_to_bytes(uint32_t bits) {
    const __m256i shuf = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf);  /* byte j: byte j / 8 of bits */
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, sel), sel);
}

/* One block's quants as int8, 32 a vector in weight order: q[0 .. weights / 32). */
static inline __attribute__((always_inline)) void unpack_q(int type, const uint8_t *blk, __m256i *q) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), bit4 = _mm256_set1_epi8(0x10);
    if (type == KQ_Q5_1) {
        uint32_t qh;
        memcpy(&qh, blk + 4, 4);
        const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 8));
        const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), m4);
        q[0] = _mm256_or_si256(nib, _mm256_and_si256(bits_to_bytes(qh), bit4));
    } else if (type == KQ_Q4_K || type == KQ_Q5_K) {
        const uint8_t *qs = blk + (type == KQ_Q4_K ? 16 : 48);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));  /* Q5_K only */
        for (int i = 0; i < 4; i++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));
            q[2 * i] = _mm256_and_si256(v, m4);
            q[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if (type == KQ_Q5_K) {
                const __m256i b0 = _mm256_set1_epi8((char)(1 << (2 * i))), b1 = _mm256_set1_epi8((char)(2 << (2 * i)));
                q[2 * i] = _mm256_or_si256(q[2 * i], _mm256_and_si256(
                    _mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), bit4));
                q[2 * i + 1] = _mm256_or_si256(q[2 * i + 1], _mm256_and_si256(
                    _mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), bit4));
            }
        }
    } else {  /* Q6_K: bits 4-5 of each quant from qh, moved there by 16-bit shifts (the mask drops what crosses) */
        const __m256i m30 = _mm256_set1_epi8(0x30), c32 = _mm256_set1_epi8(32);
        for (int h = 0; h < 2; h++) {
            const __m256i la = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
            const __m256i lb = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            q[4 * h] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(la, m4),
                                                       _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30)), c32);
            q[4 * h + 1] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(lb, m4),
                                                           _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30)), c32);
            q[4 * h + 2] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(la, 4), m4),
                                                           _mm256_and_si256(hb, m30)), c32);
            q[4 * h + 3] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lb, 4), m4),
                                                           _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30)), c32);
        }
    }
}

/* 32 weights from their quants: out[j] = s * q[j] + o, with (s, o) = (s0, o0) for j < 16, else (s1, o1); the
 * product and the sum rounded separately, as gguf's numpy rounds them. */
static inline __attribute__((always_inline)) void store_chunk(__m256i q, float s0, float s1, float o0, float o1,
                                                              float *out) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
#if NS_AVX512  /* 16 at a time: half the conversions */
    const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_mul_ps(f0, _mm512_set1_ps(s0)), _mm512_set1_ps(o0)));
    _mm512_storeu_ps(out + 16, _mm512_add_ps(_mm512_mul_ps(f1, _mm512_set1_ps(s1)), _mm512_set1_ps(o1)));
    return;
#endif
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int j = 0; j < 4; j++) {
        const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[j]));
        const __m256 p = _mm256_mul_ps(f, _mm256_set1_ps(j < 2 ? s0 : s1));
        _mm256_storeu_ps(out + 8 * j, _mm256_add_ps(p, _mm256_set1_ps(j < 2 ? o0 : o1)));
    }
}
#endif

#if !NS_KQ_AVX2
/* One block as quants q (int8, the scalar path's unpacking). */
static void unpack_scalar(int type, const uint8_t *blk, int8_t *restrict q) {
    if (type == KQ_Q5_1) {
        uint32_t qh;
        memcpy(&qh, blk + 4, 4);
        const uint8_t *qs = blk + 8;
        for (int j = 0; j < 16; j++) {
            q[j] = (int8_t)((qs[j] & 0x0f) | (((qh >> j) & 1) << 4));
            q[j + 16] = (int8_t)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
        }
    } else if (type == KQ_Q4_K || type == KQ_Q5_K) {
        const uint8_t *qh = blk + 16, *qs = blk + (type == KQ_Q4_K ? 16 : 48);
        for (int i = 0; i < 4; i++)  /* 64 weights: sub-blocks 2i and 2i + 1 */
            for (int l = 0; l < 32; l++) {
                const int h = type == KQ_Q5_K ? qh[l] >> (2 * i) : 0;
                q[64 * i + l] = (int8_t)((qs[32 * i + l] & 0x0f) | ((h & 1) << 4));
                q[64 * i + 32 + l] = (int8_t)((qs[32 * i + l] >> 4) | ((h & 2) << 3));
            }
    } else {  /* Q6_K */
        for (int h = 0; h < 2; h++) {  /* 128 weights: ql[64h ..], qh[32h ..] */
            const uint8_t *l4 = blk + 64 * h, *h2 = blk + 128 + 32 * h;
            int8_t *qq = q + 128 * h;
            for (int l = 0; l < 32; l++) {
                qq[l] = (int8_t)(((l4[l] & 0x0f) | ((h2[l] & 3) << 4)) - 32);
                qq[l + 32] = (int8_t)(((l4[l + 32] & 0x0f) | (((h2[l] >> 2) & 3) << 4)) - 32);
                qq[l + 64] = (int8_t)(((l4[l] >> 4) | (((h2[l] >> 4) & 3) << 4)) - 32);
                qq[l + 96] = (int8_t)(((l4[l + 32] >> 4) | (((h2[l] >> 6) & 3) << 4)) - 32);
            }
        }
    }
}
#endif

/* out[0..K) = one row's weights, bit for bit gguf's dequantize. */
static inline __attribute__((always_inline)) void dequant_row(int type, const uint8_t *row, float *restrict out,
                                                              int64_t K) {
    const int64_t bw = block_weights(type), bb = block_bytes(type);
    float s[MAX_BLOCK / 16], o[MAX_BLOCK / 16];
    for (int64_t b = 0; b < K / bw; b++) {
        const uint8_t *blk = row + b * bb;
        float *ob = out + b * bw;
        block_scales(type, blk, s, o);
#if NS_KQ_AVX2
        __m256i q[MAX_BLOCK / 32];
        unpack_q(type, blk, q);
        for (int c = 0; c < bw / 32; c++)
            store_chunk(q[c], s[2 * c], s[2 * c + 1], o[2 * c], o[2 * c + 1], ob + 32 * c);
#else
        int8_t q[MAX_BLOCK];
        unpack_scalar(type, blk, q);
        for (int64_t j = 0; j < bw; j++) {
            const float p = s[j / 16] * (float)q[j];  /* rounded, then the sum rounded: no contraction */
            ob[j] = p + o[j / 16];
        }
#endif
    }
}

/* A constant type per instance (the callers' switches): no per-block branches on it. */
#define KQ_SWITCH(type, CALL) \
    switch (type) { \
        case KQ_Q5_1: CALL(KQ_Q5_1); break; \
        case KQ_Q4_K: CALL(KQ_Q4_K); break; \
        case KQ_Q5_K: CALL(KQ_Q5_K); break; \
        default: CALL(KQ_Q6_K); break; \
    }

/* out[i] = row rows[i] of w (GGUF blocks), dequantized: out [n_rows, K]. rows == NULL: rows 0..n_rows-1. */
void ns_kq_dequant_rows(int type, const uint8_t *w, int64_t K, const int64_t *rows, int64_t n_rows, float *out) {
    const size_t row_bytes = (size_t)(K / block_weights(type) * block_bytes(type));
#define KQ_DEQUANT(T) \
    for (int64_t i = 0; i < n_rows; i++) dequant_row(T, w + (size_t)(rows ? rows[i] : i) * row_bytes, out + i * K, K)
    KQ_SWITCH(type, KQ_DEQUANT)
#undef KQ_DEQUANT
}

/* y[i * ldy] = dot(w, x + i * K) for MT rows i: the weight vector is loaded once for all of them. */
static inline __attribute__((always_inline)) void dot_tile(const int MT, const float *w, const float *x, int64_t K,
                                                           float *y, int64_t ldy) {
#if NS_AVX512
    __m512 acc[KQ_TILE];
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {  /* K % 32 == 0 */
        const __m512 v = _mm512_loadu_ps(w + k);
        for (int i = 0; i < MT; i++) acc[i] = _mm512_fmadd_ps(v, _mm512_loadu_ps(x + i * K + k), acc[i]);
    }
    for (int i = 0; i < MT; i++) y[i * ldy] = _mm512_reduce_add_ps(acc[i]);
#elif NS_KQ_AVX2
    __m256 acc[2 * KQ_TILE];  /* two chains a row: one row alone would wait on the FMA latency */
    for (int i = 0; i < 2 * MT; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __m256 v0 = _mm256_loadu_ps(w + k), v1 = _mm256_loadu_ps(w + k + 8);
        for (int i = 0; i < MT; i++) {
            acc[2 * i] = _mm256_fmadd_ps(v0, _mm256_loadu_ps(x + i * K + k), acc[2 * i]);
            acc[2 * i + 1] = _mm256_fmadd_ps(v1, _mm256_loadu_ps(x + i * K + k + 8), acc[2 * i + 1]);
        }
    }
    for (int i = 0; i < MT; i++) {
        const __m256 a = _mm256_add_ps(acc[2 * i], acc[2 * i + 1]);
        __m128 t = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        t = _mm_add_ps(t, _mm_movehl_ps(t, t));
        t = _mm_add_ss(t, _mm_movehdup_ps(t));
        y[i * ldy] = _mm_cvtss_f32(t);
    }
#else
    for (int i = 0; i < MT; i++) {
        float sum = 0.0f;
        for (int64_t k = 0; k < K; k++) sum += w[k] * x[i * K + k];
        y[i * ldy] = sum;
    }
#endif
}

#if NS_KQ_AVX2
/* One activation row (batch-1 decode) rounded to int16 per block of 32, as cpu_kernels.c's one-row path does
 * (relative error <= 2^-16 of the block's largest value): the weights' int8 quants then multiply it with madd,
 * about half the vector work of widening every weight to float. xq: the int16 values, each block's even
 * positions, then its odd ones; dx[b]: 32-block b's scale,
 * dx16[g]: the same per 16 weights (Q6_K's scales are per 16); sx[b]: the sum of x over 32-block b (times a
 * block's offset). */
static void quantize_x16(const float *x, int64_t K, int16_t *xq, float *dx, float *dx16, float *sx) {
    for (int64_t b = 0; b < K / 32; b++) {
        const float *xb = x + b * 32;
        float amax = 0.0f, sum = 0.0f;
        for (int j = 0; j < 32; j++) { amax = fmaxf(amax, fabsf(xb[j])); sum += xb[j]; }
        const float d = amax / 32767.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < 16; j++) {  /* even positions first, then odd ones: see dot_row_i16 */
            xq[b * 32 + j] = (int16_t)lrintf(xb[2 * j] * inv);
            xq[b * 32 + 16 + j] = (int16_t)lrintf(xb[2 * j + 1] * inv);
        }
        dx[b] = dx16[2 * b] = dx16[2 * b + 1] = d;
        sx[b] = sum;
    }
}

static inline float hsum8(__m256 a) {
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    return _mm_cvtss_f32(t);
}

/* Lane i of v in every lane. */
#define KQ_LANE(v, i) _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(i))

/* One weight row against the int16 activation row. The block's scales times the activations' ones are
 * computed 8 at a time, and the offsets' sum(o * sum(x)) a block in one FMA. */
static inline __attribute__((always_inline)) float dot_row_i16(int type, const uint8_t *row, int64_t K,
                                                               const int16_t *xq, const float *dx, const float *dx16,
                                                               const float *sx) {
    const int64_t bw = block_weights(type), bb = block_bytes(type);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, offs = a0;  /* two chains (even and odd 32-chunks); the offsets */
    float m0 = 0.0f;  /* Q5_1's offsets */
    __m256i q[MAX_BLOCK / 32];
    /* Chunk c's 32 quants as 16-bit lanes: the low bytes are its even positions, the high bytes its odd ones,
     * which 16-bit shifts or masks widen in place (no cross-lane shuffles), against xq's even / odd halves. The
     * sums' lanes 0-3 then hold positions 0-15, lanes 4-7 positions 16-31 (Q6_K's two scales). */
    const __m256i lo8 = _mm256_set1_epi16(0x00ff);
#define KQ_EVEN(v) (type == KQ_Q6_K ? _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8) : _mm256_and_si256(v, lo8))
#define KQ_ODD(v) (type == KQ_Q6_K ? _mm256_srai_epi16(v, 8) : _mm256_srli_epi16(v, 8))
#define KQ_DOT(c) _mm256_cvtepi32_ps(_mm256_add_epi32( \
        _mm256_madd_epi16(KQ_EVEN(q[c]), _mm256_loadu_si256((const __m256i *)(xq + k + 32 * (c)))), \
        _mm256_madd_epi16(KQ_ODD(q[c]), _mm256_loadu_si256((const __m256i *)(xq + k + 32 * (c) + 16)))))
    for (int64_t b = 0; b < K / bw; b++) {
        const uint8_t *blk = row + b * bb;
        const int64_t k = b * bw;
        unpack_q(type, blk, q);
        if (type == KQ_Q5_1) {
            a0 = _mm256_fmadd_ps(KQ_DOT(0), _mm256_set1_ps(half_at(blk) * dx[b]), a0);
            m0 += half_at(blk + 2) * sx[b];
        } else if (type == KQ_Q4_K || type == KQ_Q5_K) {
            uint8_t sm[16];
            k4_scales(blk + 4, sm);
            const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sm)));
            const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sm + 8))));
            const __m256 sd = _mm256_mul_ps(_mm256_mul_ps(sc, _mm256_set1_ps(half_at(blk))),
                                            _mm256_loadu_ps(dx + k / 32));
            offs = _mm256_fnmadd_ps(_mm256_mul_ps(mn, _mm256_set1_ps(half_at(blk + 2))), _mm256_loadu_ps(sx + k / 32),
                                    offs);
            for (int c = 0; c < 8; c += 2) {
                a0 = _mm256_fmadd_ps(KQ_DOT(c), KQ_LANE(sd, c), a0);
                a1 = _mm256_fmadd_ps(KQ_DOT(c + 1), KQ_LANE(sd, c + 1), a1);
            }
        } else {  /* Q6_K: a scale per 16 weights, no offset */
            const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192));
            const __m256 d = _mm256_set1_ps(half_at(blk + 208));
            const __m256 sd[2] = {
                _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d),
                              _mm256_loadu_ps(dx16 + k / 16)),
                _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d),
                              _mm256_loadu_ps(dx16 + k / 16 + 8))};
            for (int c = 0; c < 8; c += 2) {  /* lanes 0-3: scale 2c's, 4-7: 2c + 1's */
                const __m256 v = sd[c / 4];
                const int g = 2 * (c % 4);
                a0 = _mm256_fmadd_ps(KQ_DOT(c), _mm256_permutevar8x32_ps(
                    v, _mm256_setr_epi32(g, g, g, g, g + 1, g + 1, g + 1, g + 1)), a0);
                a1 = _mm256_fmadd_ps(KQ_DOT(c + 1), _mm256_permutevar8x32_ps(
                    v, _mm256_setr_epi32(g + 2, g + 2, g + 2, g + 2, g + 3, g + 3, g + 3, g + 3)), a1);
            }
        }
    }
#undef KQ_DOT
#undef KQ_ODD
#undef KQ_EVEN
    return hsum8(_mm256_add_ps(a0, a1)) + hsum8(offs) + m0;
}
#endif

/* y [M, ldy] (columns n_begin..n_end written) = x [M, K] @ W^T, W in `type`'s blocks. Returns 0, or -1 when out of
 * memory. Each weight row is read from memory once per call whatever M is: dequantized into L1 for every
 * activation row (float32 products with the file's exact weights), or, for one row with AVX2, multiplied as int8
 * quants with the int16-rounded activations. */
int ns_kq_linear(int type, const uint8_t *w, const float *x, float *y, int64_t M, int64_t K, int64_t ldy,
                 int64_t n_begin, int64_t n_end) {
    const size_t row_bytes = (size_t)(K / block_weights(type) * block_bytes(type));
#define KQ_PREFETCH(n) do { \
    if ((n) + KQ_PREFETCH_ROWS < n_end) \
        prefetch_weights(w + (size_t)((n) + KQ_PREFETCH_ROWS) * row_bytes, (int64_t)row_bytes); \
} while (0)
#if NS_KQ_AVX2
    if (M == 1) {
        int16_t *xq = aligned_alloc(64, sizeof(int16_t) * (size_t)((K + 31) / 32 * 32));
        float *dx = malloc(sizeof(float) * (size_t)(K / 32 * 4 + 4)), *dx16 = dx + K / 32 + 1, *sx = dx16 + K / 16 + 1;
        if (!xq || !dx) { free(xq); free(dx); return -1; }
        quantize_x16(x, K, xq, dx, dx16, sx);
#define KQ_ROWS_I16(T) \
        for (int64_t n = n_begin; n < n_end; n++) { \
            KQ_PREFETCH(n); \
            y[n] = dot_row_i16(T, w + (size_t)n * row_bytes, K, xq, dx, dx16, sx); \
        }
        KQ_SWITCH(type, KQ_ROWS_I16)
#undef KQ_ROWS_I16
        free(xq); free(dx);
        return 0;
    }
#endif
    float *row = aligned_alloc(64, sizeof(float) * (size_t)((K + 15) / 16 * 16));
    if (!row) return -1;
#define KQ_ROWS(T) \
    for (int64_t n = n_begin; n < n_end; n++) { \
        KQ_PREFETCH(n); \
        dequant_row(T, w + (size_t)n * row_bytes, row, K); \
        for (int64_t i0 = 0; i0 < M; i0 += KQ_TILE) { \
            const float *xt = x + i0 * K; \
            float *yt = y + i0 * ldy + n; \
            switch (M - i0 >= KQ_TILE ? KQ_TILE : (int)(M - i0)) {  /* constant tile sizes unroll fully */ \
                case 4: dot_tile(4, row, xt, K, yt, ldy); break; \
                case 3: dot_tile(3, row, xt, K, yt, ldy); break; \
                case 2: dot_tile(2, row, xt, K, yt, ldy); break; \
                default: dot_tile(1, row, xt, K, yt, ldy); break; \
            } \
        } \
    }
    KQ_SWITCH(type, KQ_ROWS)
#undef KQ_ROWS
#undef KQ_PREFETCH
    free(row);
    return 0;
}
