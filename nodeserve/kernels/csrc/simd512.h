/* AVX-512 helpers shared by the attention kernels (prefill_attn.c, decode_attn512.c). Included, not compiled
 * alone; native.py's build key covers headers too. */
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
#else
#define NS_AVX512 0
#endif

#endif
