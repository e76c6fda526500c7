/* AVX-512 helpers shared by the attention and bf16 kernels (prefill_attn.c, decode_attn512.c, bf16_gemm.c).
 * Included, not compiled alone; native.py's build key covers headers too. */
#ifndef NS_SIMD512_H
#define NS_SIMD512_H

#if defined(__AVX512F__)
#include <immintrin.h>
#define NS_AVX512 1

/* 2^x, |relative error| ~1e-7 (float32's own): exp by a degree-7 Taylor polynomial on the fraction, then scalef. */
static inline __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));  /* -inf (a masked score) too: its weight is zeroed by the mask */
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 g = _mm512_mul_ps(_mm512_sub_ps(x, n), _mm512_set1_ps(0.6931471805599453f));  /* |g| <= 0.35 */
    __m512 p = _mm512_set1_ps(1.0f / 5040);  /* e^g by Taylor to degree 7: error < 6e-9 */
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#if defined(__AVX512BF16__)
/* (a, b) -> one vector whose lane i holds the bf16 pair (a[i], b[i]), a in the low half, rounded to nearest even:
 * the two values vdpbf16ps multiplies, in one lane, by the pair in the same lane of its other operand. */
static inline __m512i pair_bf16(__m512 a, __m512 b) {
    /* cvtne2ps puts a in words 0..15 and b in 16..31; word 2i <- word i, 2i + 1 <- word 16 + i */
    const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(inter, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}
#endif
#else
#define NS_AVX512 0
#endif

#endif
