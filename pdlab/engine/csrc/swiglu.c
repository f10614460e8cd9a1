/* SwiGLU's activation in one pass: out = silu(gate) * up, from the fused gate/up projection's output
   (pdlab.engine.fused_linear). transformers runs SiLU and the product as two passes and a temporary over
   rows that the fused projection leaves strided; this reads each row once and writes the product.

   silu(x) = x / (1 + exp(-x)), exp by the same Cephes-style polynomial as the attention kernels (about 1 ulp
   from torch's SLEEF exp: results agree to float rounding, not bit for bit).

   x: rows of [gate (width floats) | up (width floats)] at row_stride; out: rows of width floats, contiguous. */

#include <string.h>

typedef float vec16 __attribute__((vector_size(64)));
typedef int ivec16 __attribute__((vector_size(64)));

static inline vec16 splat16(float f) { return (vec16){f, f, f, f, f, f, f, f, f, f, f, f, f, f, f, f}; }
static inline vec16 select16(ivec16 mask, vec16 a, vec16 b) {
    return (vec16)((mask & (ivec16)a) | (~mask & (ivec16)b));
}

/* exp(x) on sixteen lanes for x in [-87, 88] (clamped to it) */
static inline vec16 exp16(vec16 x) {
    x = select16(x < splat16(-87.0f), splat16(-87.0f), x);
    x = select16(x > splat16(88.0f), splat16(88.0f), x);
    vec16 fx = x * 1.44269504088896341f + 0.5f;
    ivec16 n = __builtin_convertvector(fx, ivec16);
    vec16 fn = __builtin_convertvector(n, vec16);
    fn = select16(fn > fx, fn - 1.0f, fn);
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

static inline float silu_mul1(float g, float u) {
    vec16 x = splat16(-g);
    vec16 e = exp16(x);
    return g / (1.0f + e[0]) * u;
}

void pdlab_swiglu(const float *x, long rows, long width, long row_stride, float *out) {
    for (long r = 0; r < rows; r++) {
        const float *g = x + r * row_stride, *u = g + width;
        float *o = out + r * width;
        long i = 0;
        for (; i + 16 <= width; i += 16) {
            vec16 gv, uv;
            memcpy(&gv, g + i, sizeof gv);
            memcpy(&uv, u + i, sizeof uv);
            vec16 res = gv / (1.0f + exp16(-gv)) * uv;
            memcpy(o + i, &res, sizeof res);
        }
        for (; i < width; i++) o[i] = silu_mul1(g[i], u[i]);
    }
}
