/* Prompt GEMM in bf16 over R16 weights (vnni_gemm.c's 16-row groups), for `model.prompt_activations = "bf16"` on
 * CPUs with AVX512-BF16.
 *
 * Why: the integer kernels scale every 32-weight block by its own fp16 scale, so each block of each row costs a
 * convert and two or three float multiply-adds beside its 16 (int16) or 8 (int8) dot products. A prompt chunk
 * multiplies the same weights by hundreds of rows, so here a group's 16 rows are dequantized once per call into
 * bf16 pairs (d q + m rounded to bf16, for every row of the chunk to share) and the rows are multiplied with
 * vdpbf16ps alone: 32 multiply-adds an instruction, as many as vpdpwssd, with nothing per block. On the Zen 5
 * EPYC one layer's projections at 1,024 rows ran 443 GOP/s against int16's 332 (int8: 487).
 *
 * Precision: the activations and the dequantized weights are rounded to bf16 (8-bit mantissas, to nearest even),
 * the sums are float32. Decode rows never come here (QuantLinear sends only a step's prompt rows), so a decode
 * token never depends on what shares its step.
 */
#include <stdint.h>
#include <stdlib.h>

#include "r16.h"
#include "simd512.h"
#if NS_AVX512 && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define NS_BF16_GEMM 1
#else
#define NS_BF16_GEMM 0
#endif

#define TILE_ROWS 12  /* activation rows a pass over a group's weights: 12 accumulators (16 was slower) */

int ns_bf16_gemm_supported(void) { return NS_BF16_GEMM; }

#if NS_BF16_GEMM
/* A group's 16 rows of K weights, dequantized as GGUF does: wp[e] lane r = row r's weights 2e, 2e + 1 in bf16. */
static void dequant_group(int type, const uint8_t *wg, int64_t nb, __m512i *wp) {
    const int64_t rb = r16_block_bytes(type), qo = quant_offset(type);
    const __m512i byte = _mm512_set1_epi32(0xff);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = wg + b * rb;
        const __m512 vd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)o));
        __m512i *out = wp + b * (QK / 2);
        if (type == R_Q8_0) {
            for (int j = 0; j < 8; j++) {  /* vector j: lane r's bytes are its weights 4j .. 4j + 3, signed */
                const __m512i v = _mm512_loadu_si512((const void *)(o + qo + 64 * j));
                __m512 w[4];
                for (int t = 0; t < 4; t++) {
                    const __m512i q = _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * t), 24);  /* byte t, signed */
                    w[t] = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(q));
                }
                out[2 * j] = pair_bf16(w[0], w[1]);
                out[2 * j + 1] = pair_bf16(w[2], w[3]);
            }
            continue;
        }
        const __m512 vm = type == R_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + 32)))
                                         : _mm512_mul_ps(vd, _mm512_set1_ps(-8.0f));
        for (int j = 0; j < 4; j++) {  /* lane r's low nibbles: weights 4j .. 4j + 3; high: 16 + 4j .. */
            const __m512i v = _mm512_loadu_si512((const void *)(o + qo + 64 * j));
            for (int h = 0; h < 2; h++) {
                const __m512i q = _mm512_and_si512(h ? _mm512_srli_epi32(v, 4) : v, _mm512_set1_epi8(0x0f));
                __m512 w[4];
                for (int t = 0; t < 4; t++) {
                    const __m512i qt = _mm512_and_si512(_mm512_srli_epi32(q, 8 * t), byte);
                    w[t] = _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(qt), vm);
                }
                out[8 * h + 2 * j] = pair_bf16(w[0], w[1]);
                out[8 * h + 2 * j + 1] = pair_bf16(w[2], w[3]);
            }
        }
    }
}

/* y[i0 .. i0 + mt, lo .. lo + 16) (lanes past `keep` not stored) from xb rows (bf16 pairs, ke a row). */
static inline __attribute__((always_inline)) void tile(const int mt, const __m512i *wp, const uint32_t *xb,
                                                       int64_t ke, float *y, int64_t ldy, __mmask16 keep) {
    __m512 acc[TILE_ROWS];
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t e = 0; e < ke; e++) {
        const __m512bh w = (__m512bh)wp[e];
        for (int i = 0; i < mt; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], w, (__m512bh)_mm512_set1_epi32((int)xb[i * ke + e]));
    }
    for (int i = 0; i < mt; i++) _mm512_mask_storeu_ps(y + i * ldy, keep, acc[i]);
}
#endif

/* y [M, ldy] columns n_begin..n_end (n_begin a multiple of 16) = x [M, K] @ W^T, W in R16 of `type` (Q4_0, Q4_1,
 * Q8_0), in bf16 products. Returns 0; -1 when out of memory or this build has no AVX512-BF16. */
int ns_linear_r16_bf16(int type, const uint8_t *wr, const float *x, float *y, int64_t M, int64_t K, int64_t ldy,
                       int64_t n_begin, int64_t n_end) {
#if NS_BF16_GEMM
    const int64_t nb = K / QK, gbytes = nb * r16_block_bytes(type), ke = K / 2;
    uint32_t *xb = aligned_alloc(64, sizeof(uint32_t) * (size_t)(M * ke + 16));
    __m512i *wp = aligned_alloc(64, sizeof(__m512i) * (size_t)(ke > 0 ? ke : 1));
    if (!xb || !wp) { free(xb); free(wp); return -1; }
    /* in memory, bf16 x[2e], x[2e + 1] side by side are the pair vdpbf16ps takes from a broadcast uint32 */
    for (int64_t i = 0; i < M * K; i += QK)
        _mm512_store_si512((void *)(xb + i / 2),
                           (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i)));
    for (int64_t g = n_begin / GROUP; g * GROUP < n_end; g++) {
        dequant_group(type, wr + g * gbytes, nb, wp);
        const int64_t lo = g * GROUP, hi = lo + GROUP < n_end ? lo + GROUP : n_end;
        const __mmask16 keep = (__mmask16)((1u << (hi - lo)) - 1);
        int64_t i0 = 0;
        for (; i0 + TILE_ROWS <= M; i0 += TILE_ROWS)
            tile(TILE_ROWS, wp, xb + i0 * ke, ke, y + i0 * ldy + lo, ldy, keep);
        switch (M - i0) {  /* constant tile sizes unroll fully */
            case 11: tile(11, wp, xb + i0 * ke, ke, y + i0 * ldy + lo, ldy, keep); break;
            case 10: tile(10, wp, xb + i0 * ke, ke, y + i0 * ldy + lo, ldy, keep); break;
            case 9: tile(9, wp, xb + i0 * ke, ke, y + i0 * ldy + lo, ldy, keep); break;
            case 8: tile(8, wp, xb + i0 * ke, ke, y + i0 * ldy + lo, ldy, keep); break;
            case 7: tile(7, wp, xb + i0 * ke, ke, y + i0 * ldy + lo, ldy, keep); break;
            case 6: tile(6, wp, xb + i0 * ke, ke, y + i0 * ldy + lo, ldy, keep); break;
            case 5: tile(5, wp, xb + i0 * ke, ke, y + i0 * ldy + lo, ldy, keep); break;
            case 4: tile(4, wp, xb + i0 * ke, ke, y + i0 * ldy + lo, ldy, keep); break;
            case 3: tile(3, wp, xb + i0 * ke, ke, y + i0 * ldy + lo, ldy, keep); break;
            case 2: tile(2, wp, xb + i0 * ke, ke, y + i0 * ldy + lo, ldy, keep); break;
            case 1: tile(1, wp, xb + i0 * ke, ke, y + i0 * ldy + lo, ldy, keep); break;
            default: break;
        }
    }
    free(xb);
    free(wp);
    return 0;
#else
    (void)type; (void)wr; (void)x; (void)y; (void)M; (void)K; (void)ldy; (void)n_begin; (void)n_end;
    return -1;
#endif
}
