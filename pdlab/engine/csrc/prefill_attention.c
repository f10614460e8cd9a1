/* Causal prefill attention of one request over its own chunk (no earlier context), pdlab.engine.cpu_kernel.

   The common prefill: a prompt's first chunk attends to itself, causally. For each K/V head, K is transposed
   once into scratch ([head_dim][n16], keys contiguous, n padded to whole vectors with zeros) so that scores
   for sixteen keys are one vector: a block of ROWS query rows (the query heads sharing the K/V head, ROWS /
   groups positions each) is scored against every key up to its last position with broadcast multiply-adds,
   thirty-two keys per pass (each broadcast serves two vectors), softmaxed row by row (keys past a row's
   position masked), and multiplied with V, whose rows are contiguous over head_dim, thirty-two floats per
   pass. Each K column and V row loaded serves all ROWS rows; no work is done above the causal diagonal
   beyond the block's own last rows and the last vector's padding.

   Built like decode_attention.c (associative float math, -march=native); exp and softmax helpers from vec_math.h.

   Layouts (float32): element (t, head, d) of q / k / v / out at t * row_stride + head * head_stride + d;
   scratch: (head_dim + ROWS) * n16 floats, n16 = n rounded up to a multiple of 16. */

#include "vec_math.h"

#ifndef ROWS
#define ROWS 8 /* query rows per block: accumulators in registers */
#endif
#define MAX_DIM 256

/* One block of `rows` query rows (row r: query head qh[r], position pos[r]) against keys [0, keys). */
static inline __attribute__((always_inline)) void block(
        const float *q, long q_row, long q_head, const float *kt, int n, const float *v, long v_row,
        float *out, long o_row, long o_head, const int *qh, const int *pos, int rows, int keys, float scale,
        float *s, const int head_dim) {
    float qv[ROWS][MAX_DIM];
    for (int r = 0; r < rows; r++)
        for (int d = 0; d < head_dim; d++) qv[r][d] = q[pos[r] * q_row + qh[r] * q_head + d] * scale;
    int t = 0;
    for (; t + 32 <= keys; t += 32) { /* scores, thirty-two keys at a time: each broadcast serves two vectors */
        vec16 acc[ROWS][2];
        for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = splat16(0.0f);
        for (int d = 0; d < head_dim; d++) {
            const vec16 k0 = load16(kt + (long)d * n + t), k1 = load16(kt + (long)d * n + t + 16);
            for (int r = 0; r < ROWS; r++) {
                const vec16 b = splat16(qv[r][d]);
                acc[r][0] += b * k0;
                acc[r][1] += b * k1;
            }
        }
        for (int r = 0; r < rows; r++) {
            store16(s + (long)r * n + t, acc[r][0]);
            store16(s + (long)r * n + t + 16, acc[r][1]);
        }
    }
    for (; t < keys; t += 16) { /* then sixteen: past `keys`, K^T's zeroed padding columns (n is padded to 16) */
        vec16 acc[ROWS];
        for (int r = 0; r < ROWS; r++) acc[r] = splat16(0.0f);
        for (int d = 0; d < head_dim; d++) {
            vec16 kv = load16(kt + (long)d * n + t);
            for (int r = 0; r < ROWS; r++) acc[r] += splat16(qv[r][d]) * kv;
        }
        for (int r = 0; r < rows; r++) store16(s + (long)r * n + t, acc[r]);
    }
    float inv[ROWS];
    for (int r = 0; r < rows; r++) { /* softmax over keys [0, pos + 1) */
        float *sr = s + (long)r * n;
        const int m = pos[r] + 1;
        const float sum = exp_sum(sr, m, max_of(sr, m));
        int i = m;
        for (; i < keys; i++) sr[i] = 0.0f; /* past this row's position */
        inv[r] = 1.0f / sum;
    }
    int c = 0;
    for (; c + 32 <= head_dim; c += 32) { /* P @ V, 32 floats of head_dim per pass */
        vec16 acc[ROWS][2];
        for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = splat16(0.0f);
        for (int i = 0; i < keys; i++) {
            const vec16 x0 = load16(v + (long)i * v_row + c), x1 = load16(v + (long)i * v_row + c + 16);
            for (int r = 0; r < ROWS; r++) {
                const vec16 b = splat16(s[(long)r * n + i]);
                acc[r][0] += b * x0;
                acc[r][1] += b * x1;
            }
        }
        for (int r = 0; r < rows; r++) {
            store16(out + pos[r] * o_row + qh[r] * o_head + c, acc[r][0] * inv[r]);
            store16(out + pos[r] * o_row + qh[r] * o_head + c + 16, acc[r][1] * inv[r]);
        }
    }
    for (; c < head_dim; c += 16) { /* then 16 */
        vec16 acc[ROWS];
        for (int r = 0; r < ROWS; r++) acc[r] = splat16(0.0f);
        for (int i = 0; i < keys; i++) {
            const vec16 x = load16(v + (long)i * v_row + c);
            for (int r = 0; r < ROWS; r++) acc[r] += splat16(s[(long)r * n + i]) * x;
        }
        for (int r = 0; r < rows; r++) store16(out + pos[r] * o_row + qh[r] * o_head + c, acc[r] * inv[r]);
    }
}

int pdlab_prefill_attention(const float *q, long q_row, long q_head, const float *k, long k_row, long k_head,
                            const float *v, long v_row, long v_head, int n, int heads, int kv_heads, int head_dim,
                            float scale, float *out, long o_row, long o_head, float *scratch) {
    const int groups = heads / kv_heads;
    if (head_dim % 16 || head_dim > MAX_DIM || groups * kv_heads != heads || groups > ROWS) return -1;
    const int n16 = (n + 15) / 16 * 16; /* K^T and score rows padded to whole vectors */
    float *kt = scratch, *s = scratch + (long)head_dim * n16;
    const int per = ROWS / groups; /* positions per block */
    for (int h = 0; h < kv_heads; h++) {
        for (int t = 0; t < n; t++) /* K^T of this head: keys contiguous */
            for (int d = 0; d < head_dim; d++) kt[(long)d * n16 + t] = k[t * k_row + h * k_head + d];
        for (int d = 0; d < head_dim; d++)
            for (int t = n; t < n16; t++) kt[(long)d * n16 + t] = 0.0f;
        const float *vh = v + (long)h * v_head;
        for (int p0 = 0; p0 < n; p0 += per) {
            int qh[ROWS] = {0}, pos[ROWS] = {0}, rows = 0;
            for (int p = p0; p < p0 + per && p < n; p++)
                for (int g = 0; g < groups; g++) {
                    qh[rows] = h * groups + g;
                    pos[rows] = p;
                    rows++;
                }
            for (int r = rows; r < ROWS; r++) { qh[r] = qh[0]; pos[r] = pos[0]; } /* padding rows: not stored */
            const int keys = (p0 + per < n ? p0 + per : n);
#define BLOCK(D) block(q, q_row, q_head, kt, n16, vh, v_row, out, o_row, o_head, qh, pos, rows, keys, scale, s, D)
            switch (head_dim) { /* common sizes get constant loop bounds */
                case 32: BLOCK(32); break;
                case 64: BLOCK(64); break;
                case 128: BLOCK(128); break;
                default: BLOCK(head_dim);
            }
        }
    }
    return 0;
}
