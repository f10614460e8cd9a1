/* Shared by pdlab's CPU kernels: sixteen-float vectors (GCC/Clang vector extension: AVX-512, two AVX
   registers or NEON, generic code elsewhere) and exp by a Cephes-style polynomial (about 1 ulp, like SLEEF's
   expf_u10 that torch uses), written so that it vectorises. */

#ifndef PDLAB_VEC_MATH_H
#define PDLAB_VEC_MATH_H

#include <math.h>
#include <string.h>

typedef float vec16 __attribute__((vector_size(64)));
typedef int ivec16 __attribute__((vector_size(64)));

static inline vec16 load16(const float *p) { vec16 x; memcpy(&x, p, sizeof x); return x; }
static inline void store16(float *p, vec16 x) { memcpy(p, &x, sizeof x); }
static inline vec16 splat16(float f) { return (vec16){f, f, f, f, f, f, f, f, f, f, f, f, f, f, f, f}; }
static inline vec16 select16(ivec16 mask, vec16 a, vec16 b) { /* mask ? a : b lane by lane (C has no vector ?:) */
    return (vec16)((mask & (ivec16)a) | (~mask & (ivec16)b));
}

/* exp(x) on sixteen lanes, x clamped to [-87, 88] (no infinities, no denormals) */
static inline vec16 exp16(vec16 x) {
    x = select16(x < splat16(-87.0f), splat16(-87.0f), x);
    x = select16(x > splat16(88.0f), splat16(88.0f), x);
    vec16 fx = x * 1.44269504088896341f + 0.5f;
    ivec16 n = __builtin_convertvector(fx, ivec16);
    vec16 fn = __builtin_convertvector(n, vec16);
    fn = select16(fn > fx, fn - 1.0f, fn); /* floor: truncation rounds negatives up */
    x = x - fn * 0.693359375f + fn * 2.12194440e-4f;
    vec16 z = x * x;
    vec16 y = ((((1.9875691500e-4f * x + 1.3981999507e-3f) * x + 8.3334519073e-3f) * x + 4.1665795894e-2f) * x
               + 1.6666665459e-1f) * x + 5.0000001201e-1f;
    y = y * z + x + 1.0f;
    ivec16 e = (__builtin_convertvector(fn, ivec16) + 127) << 23;
    vec16 p;
    memcpy(&p, &e, sizeof p);
    return y * p;
}

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
    for (; i < n; i++) { s[i] = exp1(s[i] - mx); sum += s[i]; }
    return sum;
}

#endif
