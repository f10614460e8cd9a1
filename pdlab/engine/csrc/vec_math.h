/* Shared by pdlab's CPU kernels: sixteen-float vectors (GCC/Clang vector extension: AVX-512, two AVX
   registers or NEON, generic code elsewhere) and exp by a Cephes-style polynomial (about 1.4 ulp; SLEEF's
   expf_u10 that torch uses is within 1), written so that it vectorises.

   Portable by rule: C11 (built with -std=c11) plus the x86 intrinsics headers. The one extension is the
   vector_size attribute (GCC >= 4.7, every Clang) with its arithmetic, comparisons and subscripts; no
   __builtin_* (GCC 11, the compiler of Ubuntu 22.04 and RHEL 8/9, lacks __builtin_shufflevector, and a kernel
   that does not build silently costs a run its speed). Three paths, chosen by what -march enables: AVX-512,
   AVX2 with FMA (x86-64-v3: most AMD Zen servers and laptops) and plain C (libm's expf). */

#ifndef PDLAB_VEC_MATH_H
#define PDLAB_VEC_MATH_H

#include <math.h>
#include <string.h>
#if defined(__SSE__)
#include <immintrin.h>
#define PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#else
#define PREFETCH(p) ((void)(p))
#endif

typedef float vec16 __attribute__((vector_size(64)));
typedef int ivec16 __attribute__((vector_size(64)));

static inline vec16 load16(const float *p) { vec16 x; memcpy(&x, p, sizeof x); return x; }
static inline void store16(float *p, vec16 x) { memcpy(p, &x, sizeof x); }
static inline vec16 splat16(float f) { return (vec16){f, f, f, f, f, f, f, f, f, f, f, f, f, f, f, f}; }
static inline vec16 select16(ivec16 mask, vec16 a, vec16 b) { /* mask ? a : b lane by lane (C has no vector ?:) */
    return (vec16)((mask & (ivec16)a) | (~mask & (ivec16)b));
}

/* exp(x) on sixteen lanes, x clamped to [-87, 88] (no infinities, no denormals): x = n ln2 + r with
   |r| <= ln2 / 2 (ln2 in two parts, Cody-Waite), e^r by Cephes' polynomial, times 2^n. About 1.4 ulp from
   the exact value. The kernels are built with associative float math, which would be free to undo
   Cody-Waite's split: the AVX-512 path computes through fused multiply-add intrinsics, which the compiler
   does not rewrite, and the generic one keeps r in memory between the two steps. */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_C1 0.693359375f
#define EXP_C2 -2.12194440e-4f /* ln2 = C1 + C2 */
/* e^r = 1 + r + r^2 (P0 r^5 + P1 r^4 + P2 r^3 + P3 r^2 + P4 r + P5), |r| <= ln2 / 2 (Cephes' expf) */
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f
#if defined(__AVX512F__)
/* AVX-512: round to nearest and scale by 2^n in one instruction each (about 17 operations, against 24) */
static inline vec16 exp16(vec16 x) {
    const __m512 v = _mm512_min_ps(_mm512_max_ps((__m512)x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_C1), v);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_C2), r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(EXP_P0), r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
    return (vec16)_mm512_scalef_ps(_mm512_add_ps(p, _mm512_set1_ps(1.0f)), n);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2: the same steps on two eight-lane halves, rounding by roundps and 2^n built in the exponent bits */
static inline __m256 exp8_avx2(__m256 x) {
    const __m256 v = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_C1), v);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_C2), r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(EXP_P0), r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
static inline vec16 exp16(vec16 x) {
    float a[16];
    memcpy(a, &x, sizeof a);
    _mm256_storeu_ps(a, exp8_avx2(_mm256_loadu_ps(a)));
    _mm256_storeu_ps(a + 8, exp8_avx2(_mm256_loadu_ps(a + 8)));
    memcpy(&x, a, sizeof x);
    return x;
}
#else
/* plain C: libm's expf per lane (within 1 ulp), on the same clamped range */
static inline vec16 exp16(vec16 x) {
    float a[16];
    memcpy(a, &x, sizeof a);
    for (int j = 0; j < 16; j++) a[j] = expf(a[j] < -87.0f ? -87.0f : (a[j] > 88.0f ? 88.0f : a[j]));
    memcpy(&x, a, sizeof x);
    return x;
}
#endif

static inline float exp1(float x) { return exp16(splat16(x))[0]; }

/* Largest of n floats (n >= 1). */
static inline float max_of(const float *s, int n) {
    float mx = -INFINITY;
    int i = 0;
    if (n >= 16) {
        vec16 m16 = load16(s);
        for (i = 16; i + 16 <= n; i += 16) { vec16 x = load16(s + i); m16 = select16(x > m16, x, m16); }
        for (int j = 0; j < 16; j++) mx = m16[j] > mx ? m16[j] : mx;
    }
    for (; i < n; i++) mx = s[i] > mx ? s[i] : mx;
    return mx;
}

/* s[i] = exp(s[i] - mx) for i < n; returns their sum (a softmax row's numerators and denominator). */
static inline float exp_sum(float *s, int n, float mx) {
    vec16 sum16 = splat16(0.0f);
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        vec16 e = exp16(load16(s + i) - mx);
        store16(s + i, e);
        sum16 += e;
    }
    float sum = 0.0f;
    for (int j = 0; j < 16; j++) sum += sum16[j];
    if (i < n) { /* the last n % 16 in one vector (a lane's exp costs as much as sixteen) */
        float tail[16];
        const int m = n - i;
        for (int j = 0; j < 16; j++) tail[j] = j < m ? s[i + j] - mx : -87.0f;
        const vec16 e = exp16(load16(tail));
        for (int j = 0; j < m; j++) { s[i + j] = e[j]; sum += e[j]; }
    }
    return sum;
}

#endif
