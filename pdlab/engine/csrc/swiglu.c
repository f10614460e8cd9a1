/* SwiGLU's activation in one pass: out = silu(gate) * up, from the fused gate/up projection's output
   (pdlab.engine.fused_linear). transformers runs SiLU and the product as two passes and a temporary over
   rows that the fused projection leaves strided; this reads each row once and writes the product.

   silu(x) = x / (1 + exp(-x)), exp by vec_math.h's polynomial, as in the attention kernels (about 1 ulp from
   torch's SLEEF exp: results agree to float rounding, not bit for bit).

   x: rows of [gate (width floats) | up (width floats)] at row_stride; out: rows of width floats, contiguous. */

#include "vec_math.h"

void pdlab_swiglu(const float *x, long rows, long width, long row_stride, float *out) {
    for (long r = 0; r < rows; r++) {
        const float *g = x + r * row_stride, *u = g + width;
        float *o = out + r * width;
        long i = 0;
        for (; i + 16 <= width; i += 16) {
            const vec16 gv = load16(g + i);
            store16(o + i, gv / (1.0f + exp16(-gv)) * load16(u + i));
        }
        for (; i < width; i++) o[i] = g[i] / (1.0f + exp1(-g[i])) * u[i];
    }
}
