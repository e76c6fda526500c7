/* The R16 integer GEMM (vnni_gemm.c's 16-row groups, the same bytes) on 256-bit registers, for CPUs without
 * AVX-512 VNNI: AVX2 (Zen 2/3, Haswell..Skylake client) through vpmaddwd / vpmaddubsw, and AVX-VNNI (Alder Lake
 * and later clients, Sierra Forest) through the VEX vpdpwssd / vpdpbusd. The same integer sums as vnni_gemm.c
 * and the same float operations on them, lane by lane, so a result differs from the AVX-512 kernel's by at most
 * the order of a block's float sum (the offset term's), and repacking at load is shared.
 *
 * A 64-byte vector of an R16 block is two 32-byte halves, rows 0..7 and 8..15: each half is one ymm with row r's
 * four bytes in lane r, as in the 512-bit kernel. A tile of up to MAX_ROWS_256 activation rows takes both halves in
 * one pass over a group's blocks, one activation broadcast for both: 8 int32 accumulators and 2 weight vectors in
 * registers (the float accumulators, touched once a block, may live in L1). Tiles of 6 rows a pass per half (a
 * broadcast per vpmaddwd) were 7-8 % slower on prompt rows (x86-64-v3 build on Zen 4: 48-49 -> 52 GMAC/s int16,
 * 70-71 -> 76 int8, one layer's projections at 256 rows) and on 3-row verify steps (10.4 -> 9.2 ms a step),
 * measured while the accumulators still spilled (NS_KEEP below); again without spills (2026-11-30, all of
 * SmolLM2's layer projections, one core, alternated twice): 6-10 % slower at 8, 32 and 512 rows, int16 and int8
 * (512 rows 800 -> 849 ms int16, 538 -> 574 ms int8).
 *
 * int16 activations (decode, and prompt rows by default): vpmaddwd multiplies 2 int16 weights of 8 rows by the
 * same 2 activations and adds the pair: vpdpwssd without its accumulate, so one vpaddd more (AVX-VNNI: one
 * vpdpwssd). int8 activations (ACT8, Q4_0 / Q4_1 prompt rows): vpmaddubsw multiplies the unsigned nibbles by
 * int8 activations into int16 pair sums, at most 2 x 15 x 127 = 3,810, so a block's 8 of them (4 vectors of low
 * and of high nibbles) add in int16 without overflow (30,480 < 32,767) and one vpmaddwd by ones turns each lane's
 * pair of words into its int32 sum: exactly vpdpbusd's (AVX-VNNI: vpdpbusd itself). Q8_0 keeps int16, as in
 * vnni_gemm.c (its signed weights would need llama.cpp's sign trick, and the two kernels would then differ).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define NS_R256 1
#else
#define NS_R256 0
#endif
/* 256-bit dot-product instructions: AVX-VNNI's VEX encoding, or the same instructions EVEX-encoded on AVX-512
 * VL + VNNI (so an AVX-512 machine runs and tests this path too) */
#if NS_R256 && defined(__AVXVNNI__)
#define NS_VNNI256 1
#define DPWSSD256(a, w, x) _mm256_dpwssd_avx_epi32((a), (w), (x))
#define DPBUSD256(a, w, x) _mm256_dpbusd_avx_epi32((a), (w), (x))
#elif NS_R256 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define NS_VNNI256 1
#define DPWSSD256(a, w, x) _mm256_dpwssd_epi32((a), (w), (x))
#define DPBUSD256(a, w, x) _mm256_dpbusd_epi32((a), (w), (x))
#else
#define NS_VNNI256 0
#endif

#include "r16.h"
/* An accumulator kept as one running sum. Integer adds reassociate, and GCC (12, -O3) turned each block's chains of
 * vpaddd / vpaddw into trees of products held on the stack: with 16 ymm registers, half the accumulators spilled.
 * With the chains pinned (an empty asm on each partial sum) they stay in registers: 51 -> 68 GMAC/s int16 and 74 ->
 * 100 int8 (x86-64-v3 build on the EPYC Zen 4, SmolLM2-135M's projections, one core), the same sums bit for bit. */
#define NS_KEEP(v) __asm__("" : "+x"(v))
#define R_ACT8 0x200     /* int8 activations for Q4_0 / Q4_1 (vnni_gemm.c) */
#define R_AVX2 0x800     /* the vpmaddwd / vpmaddubsw kernels below, whatever else the build has */
#define R_AVXVNNI 0x1000 /* the 256-bit vpdpwssd / vpdpbusd kernels below */
#define MAX_ROWS_256 4   /* activation rows a pass, both halves: 8 int32 accumulators + 2 weight vectors */
#define PREFETCH_BYTES_256 8192  /* as vnni_gemm.c's PREFETCH_BYTES: a GEMV reads each weight byte once */

/* Which of these kernels the build has: 1 the AVX2 ones, 2 the 256-bit VNNI ones (ns_r16_supported adds them). */
int ns_r256_supported(void) { return (NS_R256 ? 1 : 0) | (NS_VNNI256 ? 2 : 0); }

#if NS_R256
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* The sum of 32 floats in the order GCC's _mm512_reduce_add_ps(a + b) takes (vnni_gemm.c's sx), so the offset
 * term matches the 512-bit kernel's bit for bit where both are built by GCC. */
static inline float sum32(const float *xb) {
    const __m256 lo = _mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 16));     /* a[0:8] + b[0:8] */
    const __m256 hi = _mm256_add_ps(_mm256_loadu_ps(xb + 8), _mm256_loadu_ps(xb + 24)); /* a[8:16] + b[8:16] */
    const __m256 t3 = _mm256_add_ps(hi, lo);
    const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_movehdup_ps(t8));
}

/* A block's amax and its 32 values / d rounded to nearest (even), in K order (q[j]: x[8j .. 8j + 7]): what both
 * quantizers start from. */
static inline float block_round(const float *xb, float scale, __m256i q[4]) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) { v[j] = _mm256_loadu_ps(xb + 8 * j); m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j])); }
    const float d = hmax8(m) / scale, inv = d > 0.0f ? 1.0f / d : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int j = 0; j < 4; j++) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], vinv));
    return d;
}

/* vnni_gemm.c's quantize_rows on AVX2: int16 in its pair_k order (saturated as vpmovsdw), dx = d, sx = the block
 * sum. Word t holds x[k], x[k + 2]: Q4_0 / Q4_1 take x 0 2 1 3 16 18 17 19 4 6 5 7 20 22 21 23, then the same from
 * 8 and 24; Q8_0 x 0 2 1 3 4 6 5 7 ... in fours. vpackssdw interleaves its two sources by 128-bit lane, so a pack of
 * the right eighths and one byte shuffle (Q8_0: a qword permute between them) give each half. */
static void quantize_rows256(int type, const float *x, int64_t M, int64_t K, int16_t *xq, float *dx, float *sx) {
    const __m256i swap = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15,
                                          0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
    __m256i q[4];
    for (int64_t i = 0; i < M * (K / QK); i++) {
        const float *xb = x + i * QK;
        dx[i] = block_round(xb, 32767.0f, q);
        __m256i lo, hi;
        if (type == R_Q8_0) {
            lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xd8);  /* x 0..15 */
            hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xd8);  /* x 16..31 */
        } else {
            lo = _mm256_packs_epi32(q[0], q[2]);  /* x 0..3 16..19 | 4..7 20..23 */
            hi = _mm256_packs_epi32(q[1], q[3]);  /* x 8..11 24..27 | 12..15 28..31 */
        }
        _mm256_storeu_si256((__m256i *)(xq + i * QK), _mm256_shuffle_epi8(lo, swap));
        _mm256_storeu_si256((__m256i *)(xq + i * QK + 16), _mm256_shuffle_epi8(hi, swap));
        sx[i] = sum32(xb);
    }
}

/* vnni_gemm.c's quantize_rows_i8 on AVX2: int8 in K order (saturated), dx, sx, cx = -8 d sum(xq). */
static void quantize_rows_i8_256(const float *x, int64_t M, int64_t K, int8_t *xq, float *dx, float *sx, float *cx) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), ones8 = _mm256_set1_epi8(1);
    __m256i q[4];
    for (int64_t i = 0; i < M * (K / QK); i++) {
        const float *xb = x + i * QK;
        const float d = block_round(xb, 127.0f, q);
        /* two saturating packs clamp to int8 as vpmovsdb does; dwords of x 0..3 8..11 16..19 24..27 | 4..7 ... */
        const __m256i b = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
        _mm256_storeu_si256((__m256i *)(xq + i * QK), b);
        const __m256i s4 = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, b), _mm256_set1_epi16(1));
        const __m128i s2 = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
        const __m128i s1 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, _MM_SHUFFLE(1, 0, 3, 2)));
        const int32_t s = _mm_cvtsi128_si32(_mm_add_epi32(s1, _mm_shuffle_epi32(s1, _MM_SHUFFLE(2, 3, 0, 1))));
        dx[i] = d;
        sx[i] = sum32(xb);
        cx[i] = -8.0f * d * (float)s;
    }
}

/* Halves h0 .. h0 + NH - 1 (rows 8h .. 8h + 7 each) of one group against MT rows of int16 activations: f[NH i + k]
 * lane r = y[i, 16 g + 8 (h0 + k) + r]. Each weight vector is unpacked once and taken by the MT rows in turn (one
 * activation broadcast for both halves). With vnni and few rows a row keeps C chains (vpdpwssd's latency), which
 * integer sums make order-free. The float operations are vnni_gemm.c's group_rows', in its order. */
static inline __attribute__((always_inline)) void half_rows(
        int type, const int vnni, const int MT, const int NH, const uint8_t *wg, int h0, int64_t nb,
        const int16_t *xq, const float *dx, const float *sx, __m256 f[2 * MAX_ROWS_256]) {
    const int C = vnni && MT * NH < 4 ? 4 / (MT * NH) : 1;
    const int64_t rb = r16_block_bytes(type), qo = quant_offset(type) + 32 * h0;
    const __m256i mask = _mm256_set1_epi16(0x000f);
    for (int i = 0; i < MT * NH; i++) f[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = wg + b * rb;
        if (h0 == 0)
            prefetch_weights(o + PREFETCH_BYTES_256, rb);
        __m256i a[4 * MAX_ROWS_256];  /* [row][half][chain] */
        for (int i = 0; i < MT * NH * C; i++) a[i] = _mm256_setzero_si256();
#if NS_VNNI256
#define NS_MAC(acc, wv, xv) (vnni ? DPWSSD256((acc), (wv), (xv)) : _mm256_add_epi32((acc), _mm256_madd_epi16((wv), (xv))))
#else
#define NS_MAC(acc, wv, xv) _mm256_add_epi32((acc), _mm256_madd_epi16((wv), (xv)))
#endif
#define NS_DOT256(t, wv)                                                                                         \
        for (int i = 0; i < MT; i++) {                                                                           \
            const __m256i xv = _mm256_set1_epi32(((const int32_t *)(xq + (i * nb + b) * QK))[t]);                \
            for (int k = 0; k < NH; k++) {                                                                       \
                __m256i *acc = &a[(i * NH + k) * C + (t) % C];                                                   \
                *acc = NS_MAC(*acc, (wv)[k], xv);                                                                \
                NS_KEEP(*acc);                                                                                   \
            }                                                                                                    \
        }
        if (type == R_Q8_0) {
            for (int j = 0; j < 8; j++) {
                __m256i w0[2], w1[2];
                for (int k = 0; k < NH; k++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(o + qo + 64 * j + 32 * k));
                    w0[k] = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8);  /* bytes 0, 2: sign-extended */
                    w1[k] = _mm256_srai_epi16(v, 8);                        /* bytes 1, 3 */
                }
                NS_DOT256(2 * j, w0)
                NS_DOT256(2 * j + 1, w1)
            }
        } else {
            for (int j = 0; j < 4; j++) {
                __m256i v[2], w[2];
                for (int k = 0; k < NH; k++) v[k] = _mm256_loadu_si256((const __m256i *)(o + qo + 64 * j + 32 * k));
                for (int k = 0; k < NH; k++) w[k] = _mm256_and_si256(v[k], mask);  /* low nibbles of bytes 0, 2 */
                NS_DOT256(4 * j, w)
                for (int k = 0; k < NH; k++) w[k] = _mm256_and_si256(_mm256_srli_epi16(v[k], 8), mask);  /* 1, 3 */
                NS_DOT256(4 * j + 1, w)
                for (int k = 0; k < NH; k++) w[k] = _mm256_and_si256(_mm256_srli_epi16(v[k], 4), mask);  /* high: 0, 2 */
                NS_DOT256(4 * j + 2, w)
                for (int k = 0; k < NH; k++) w[k] = _mm256_srli_epi16(v[k], 12);                       /* 1, 3 */
                NS_DOT256(4 * j + 3, w)
            }
        }
#undef NS_DOT256
#undef NS_MAC
        for (int k = 0; k < NH; k++) {
            const int h = h0 + k;
            const __m256 vd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 16 * h)));
            const __m256 vm = type == R_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 32 + 16 * h)))
                                             : _mm256_mul_ps(vd, _mm256_set1_ps(-8.0f));
            for (int i = 0; i < MT; i++) {
                const __m256i *ac = &a[(i * NH + k) * C];
                __m256i sum = ac[0];
                if (C == 4) sum = _mm256_add_epi32(_mm256_add_epi32(ac[0], ac[1]), _mm256_add_epi32(ac[2], ac[3]));
                else for (int c = 1; c < C; c++) sum = _mm256_add_epi32(sum, ac[c]);
                __m256 *fi = &f[i * NH + k];
                *fi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(vd, _mm256_set1_ps(dx[i * nb + b])), *fi);
                if (type != R_Q8_0) *fi = _mm256_fmadd_ps(vm, _mm256_set1_ps(sx[i * nb + b]), *fi);
            }
        }
    }
}

/* Halves h0 .. h0 + NH - 1 of one group (Q4_0 / Q4_1) against MT rows of int8 activations: vnni_gemm.c's
 * group_rows_i8, its int32 sums through vpmaddubsw + vpaddw + one vpmaddwd by ones (or vpdpbusd), its float
 * operations in its order. */
static inline __attribute__((always_inline)) void half_rows_i8(
        int type, const int vnni, const int MT, const int NH, const uint8_t *wg, int h0, int64_t nb,
        const int8_t *xq, const float *dx, const float *sx, const float *cx, __m256 f[2 * MAX_ROWS_256]) {
    const int C = vnni && MT * NH < 4 ? 2 : 1;
    const int64_t rb = r16_block_bytes(type), qo = quant_offset(type) + 32 * h0;
    const __m256i mask = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int i = 0; i < MT * NH; i++) f[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = wg + b * rb;
        if (h0 == 0)
            prefetch_weights(o + PREFETCH_BYTES_256, rb);
        __m256i a[4 * MAX_ROWS_256];  /* [row][half][chain]; vnni: int32 sums, else int16 pair sums */
        for (int i = 0; i < MT * NH * C; i++) a[i] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            __m256i lo[2], hi[2];
            for (int k = 0; k < NH; k++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(o + qo + 64 * j + 32 * k));
                lo[k] = _mm256_and_si256(v, mask);
                hi[k] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            }
            for (int i = 0; i < MT; i++) {
                const int32_t *xw = (const int32_t *)(xq + (i * nb + b) * QK);
                const __m256i xl = _mm256_set1_epi32(xw[j]), xh = _mm256_set1_epi32(xw[4 + j]);
                for (int k = 0; k < NH; k++) {
                    __m256i *ac = &a[(i * NH + k) * C];
#if NS_VNNI256
                    if (vnni) {
                        ac[0] = DPBUSD256(ac[0], lo[k], xl);
                        ac[C - 1] = DPBUSD256(ac[C - 1], hi[k], xh);
                        continue;
                    }
#endif
                    ac[0] = _mm256_add_epi16(ac[0], _mm256_add_epi16(_mm256_maddubs_epi16(lo[k], xl),
                                                                      _mm256_maddubs_epi16(hi[k], xh)));
                    NS_KEEP(ac[0]);
                }
            }
        }
        for (int k = 0; k < NH; k++) {
            const int h = h0 + k;
            const __m256 vd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 16 * h)));
            for (int i = 0; i < MT; i++) {
                const __m256i *ac = &a[(i * NH + k) * C];
                __m256i sum;
                if (vnni) sum = C == 2 ? _mm256_add_epi32(ac[0], ac[1]) : ac[0];
                else sum = _mm256_madd_epi16(ac[0], ones);
                const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(dx[i * nb + b]),
                                                 _mm256_set1_ps(cx[i * nb + b]));
                f[i * NH + k] = _mm256_fmadd_ps(vd, t, f[i * NH + k]);
            }
            if (type == R_Q4_1) {
                const __m256 vm = _mm256_fmadd_ps(vd, _mm256_set1_ps(8.0f),
                                                  _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 32 + 16 * h))));
                for (int i = 0; i < MT; i++) f[i * NH + k] = _mm256_fmadd_ps(vm, _mm256_set1_ps(sx[i * nb + b]), f[i * NH + k]);
            }
        }
    }
}

/* Rows mt of a tile, halves h0 .. h0 + NH - 1 of group g, stored (columns past n_end never written). */
static inline __attribute__((always_inline)) void store_halves(const __m256 *f, int mt, int NH, int64_t col0,
                                                               int64_t n_end, float *y, int64_t ldy) {
    for (int k = 0; k < NH; k++) {
        const int64_t lo = col0 + 8 * k, n = n_end - lo < 8 ? n_end - lo : 8;
        if (n <= 0) break;
        const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        for (int i = 0; i < mt; i++) {
            if (n == 8) _mm256_storeu_ps(y + i * ldy + lo, f[i * NH + k]);
            else _mm256_maskstore_ps(y + i * ldy + lo, keep, f[i * NH + k]);
        }
    }
}

/* y [M, ldy] columns n_begin..n_end: vnni_gemm.c's linear_groups on half groups. type, vnni and act8 are
 * constants at each call: one path compiles. */
static inline __attribute__((always_inline)) void linear_groups256(
        int type, const int vnni, const int act8, const uint8_t *wr, const void *xq, const float *dx,
        const float *sx, const float *cx, float *y, int64_t M, int64_t K, int64_t ldy, int64_t n_begin,
        int64_t n_end) {
    const int64_t nb = K / QK, gbytes = nb * r16_block_bytes(type);
    const int64_t mc = l2_chunk_rows(K, act8 ? 1 : (int64_t)sizeof(int16_t), MAX_ROWS_256);  /* r16.h */
    __m256 f[2 * MAX_ROWS_256];
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
        const int64_t m1 = M - m0 > mc ? m0 + mc : M;
        for (int64_t g = n_begin / GROUP; g * GROUP < n_end; g++) {
            const uint8_t *wg = wr + g * gbytes;
            if ((g + 1) * GROUP < n_end)
                prefetch_weights(wg + gbytes, gbytes < 4096 ? gbytes : 4096);
            for (int64_t i0 = m0; i0 < m1; i0 += MAX_ROWS_256) {
                const int64_t mt = m1 - i0 >= MAX_ROWS_256 ? MAX_ROWS_256 : m1 - i0;
                const int16_t *x16 = (const int16_t *)xq + i0 * K;
                const int8_t *x8 = (const int8_t *)xq + i0 * K;
                const float *dt = dx + i0 * nb, *st = sx + i0 * nb, *ct = act8 ? cx + i0 * nb : NULL;
                float *yt = y + i0 * ldy;
#define NS_PASS(n, nh, h)                                                                                            \
                if (act8) half_rows_i8(type, vnni, n, nh, wg, h, nb, x8, dt, st, ct, f);                             \
                else half_rows(type, vnni, n, nh, wg, h, nb, x16, dt, st, f);                                        \
                store_halves(f, n, nh, g * GROUP + 8 * (h), n_end, yt, ldy);
#define NS_TILE256(n)                                                                                                \
                NS_PASS(n, 2, 0)                                                                                     \
                break;
                switch (mt) {  /* constant tile sizes unroll fully */
                    case 4: NS_TILE256(4)
                    case 3: NS_TILE256(3)
                    case 2: NS_TILE256(2)
                    default: NS_TILE256(1)
                }
#undef NS_TILE256
#undef NS_PASS
            }
        }
    }
}

/* One instance per (type, vnni, act8): constant arguments, branch-free inner loops. */
static void linear_all256(int type, int vnni, int act8, const uint8_t *wr, const void *xq, const float *dx,
                          const float *sx, const float *cx, float *y, int64_t M, int64_t K, int64_t ldy,
                          int64_t n_begin, int64_t n_end) {
#define NS_CASE(t, v, a)                                                                                         \
    if (type == (t) && vnni == (v) && act8 == (a)) {                                                             \
        linear_groups256(t, v, a, wr, xq, dx, sx, cx, y, M, K, ldy, n_begin, n_end);                             \
        return;                                                                                                  \
    }
    NS_CASE(R_Q4_0, 0, 0) NS_CASE(R_Q4_1, 0, 0) NS_CASE(R_Q8_0, 0, 0) NS_CASE(R_Q4_0, 0, 1) NS_CASE(R_Q4_1, 0, 1)
#if NS_VNNI256
    NS_CASE(R_Q4_0, 1, 0) NS_CASE(R_Q4_1, 1, 0) NS_CASE(R_Q8_0, 1, 0) NS_CASE(R_Q4_0, 1, 1) NS_CASE(R_Q4_1, 1, 1)
#endif
#undef NS_CASE
}
#endif

/* vnni_gemm.c's ns_linear_r16 on 256-bit registers (it hands R16 weights here when the build has no AVX-512 VNNI,
 * or the type asks for R_AVX2 / R_AVXVNNI). type: the ggml type with R_ACT8 and the flags above. Returns 0; -1
 * when out of memory or when this build lacks the kernel asked for. */
int ns_linear_r256(int type, const uint8_t *wr, const float *x, float *y, int64_t M, int64_t K, int64_t ldy,
                   int64_t n_begin, int64_t n_end) {
#if NS_R256
    int vnni = NS_VNNI256;
    if (type & R_AVX2) vnni = 0;
    else if ((type & R_AVXVNNI) && !NS_VNNI256) return -1;
    const int base = type & 0xff, act8 = (type & R_ACT8) && (base == R_Q4_0 || base == R_Q4_1);
    const int64_t nb = K / QK;
    void *xq = malloc((act8 ? 1 : sizeof(int16_t)) * (size_t)(M * K > 0 ? M * K : 1));
    float *dsc = malloc(sizeof(float) * (size_t)(3 * M * nb + 1));  /* dx, sx, cx */
    if (!xq || !dsc) { free(xq); free(dsc); return -1; }
    float *dx = dsc, *sx = dsc + M * nb, *cx = dsc + 2 * M * nb;
    if (act8) quantize_rows_i8_256(x, M, K, xq, dx, sx, cx);
    else quantize_rows256(base, x, M, K, xq, dx, sx);
    linear_all256(base, vnni, act8, wr, xq, dx, sx, cx, y, M, K, ldy, n_begin, n_end);
    free(xq); free(dsc);
    return 0;
#else
    (void)type; (void)wr; (void)x; (void)y; (void)M; (void)K; (void)ldy; (void)n_begin; (void)n_end;
    return -1;
#endif
}
