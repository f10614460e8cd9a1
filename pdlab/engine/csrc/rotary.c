/* Rotary position embedding of queries or keys in one pass (pdlab.engine.cpu_kernel, pdlab.engine.model).

   transformers computes x * cos + rotate_half(x) * sin in five ops, each a pass over the activations and a
   temporary; this is the same arithmetic in one pass. Built without associative math and with
   -ffp-contract=off, so every product and sum is rounded as torch rounds them: the result is the same bits
   (tests/test_cpu_kernel.py), and pdlab's parity with transformers is untouched.

   x: element (t, h, d) at t * t_stride + h * h_stride + d; cos, sin: [tokens, head_dim] contiguous;
   out: [tokens, heads, head_dim] contiguous. */

void pdlab_rotary(const float *x, long t_stride, long h_stride, int tokens, int heads, int head_dim,
                  const float *cos, const float *sin, float *out) {
    const int half = head_dim / 2;
    for (int t = 0; t < tokens; t++) {
        const float *c = cos + (long)t * head_dim, *s = sin + (long)t * head_dim;
        for (int h = 0; h < heads; h++) {
            const float *xi = x + t * t_stride + h * h_stride;
            float *o = out + ((long)t * heads + h) * head_dim;
            for (int d = 0; d < half; d++) {
                float a = xi[d] * c[d];
                float b = -xi[d + half] * s[d];
                o[d] = a + b;
            }
            for (int d = half; d < head_dim; d++) {
                float a = xi[d] * c[d];
                float b = xi[d - half] * s[d];
                o[d] = a + b;
            }
        }
    }
}
