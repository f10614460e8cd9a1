/* Causal prefill attention of one request over its own chunk (no earlier context), pdlab.engine.cpu_kernel.

   The common prefill: a prompt's first chunk attends to itself, causally. For each K/V head, K is transposed
   once into scratch ([head_dim][n16], keys contiguous, n padded to whole vectors with zeros) so that scores
   for a vector of keys are one vector: a block of ROWS query rows (the query heads sharing the K/V head,
   ROWS / groups positions each) is scored against every key up to its last position with broadcast
   multiply-adds, softmaxed row by row (keys past a row's position masked), and multiplied with V, whose rows
   are contiguous over head_dim. No work is done above the causal diagonal beyond the block's own last rows
   and the last vector's padding.

   The register tile follows the ISA: RB rows at a time, two vectors of VW floats each (each broadcast serves
   both), RB x 2 accumulators: 8 x 2 sixteen-float vectors on AVX-512 (16 of its 32 registers), 4 x 2
   eight-float vectors on AVX2 (8 of its 16). A sixteen-float type on AVX2 is two registers per value, and
   the tile of 8 x 2 of them spilled to the stack on every multiply-add: 4x slower than torch's SDPA there.

   Built like decode_attention.c (associative float math, -march=native); exp and softmax helpers from vec_math.h.

   Layouts (float32): element (t, head, d) of q / k / v / out at t * row_stride + head * head_stride + d;
   scratch: (head_dim + parts * ROWS) * n16 floats, n16 = n rounded up to a multiple of 16. */

#include "vec_math.h"

#ifndef ROWS
#define ROWS 8 /* query rows per block (query heads per K/V head at most this many) */
#endif
#define MAX_DIM 256
#if defined(__AVX512F__)
#define VW 16 /* floats per vector */
#define RB 8  /* rows per register tile */
#else
#define VW 8
#define RB 4
#endif

typedef float vecw __attribute__((vector_size(VW * sizeof(float))));
static inline vecw loadw(const float *p) { vecw x; memcpy(&x, p, sizeof x); return x; }
static inline void storew(float *p, vecw x) { memcpy(p, &x, sizeof x); }
static inline vecw splatw(float f) { return (vecw){0} + f; }

/* Scores s[r][t] = q'[r] . K[t] for rows [r0, r0 + RB) and keys [t, t + 2 VW) (or [t, t + VW): one vector). */
static inline __attribute__((always_inline)) void scores_tile(
        const float (*qv)[MAX_DIM], const float *kt, int n, int r0, int rows, int t, int two, float *s,
        const int head_dim) {
    vecw acc[RB][2];
    for (int r = 0; r < RB; r++) acc[r][0] = acc[r][1] = splatw(0.0f);
    for (int d = 0; d < head_dim; d++) {
        const vecw k0 = loadw(kt + (long)d * n + t);
        const vecw k1 = two ? loadw(kt + (long)d * n + t + VW) : k0;
        for (int r = 0; r < RB; r++) {
            const vecw b = splatw(qv[r0 + r][d]);
            acc[r][0] += b * k0;
            if (two) acc[r][1] += b * k1;
        }
    }
    for (int r = 0; r < RB && r0 + r < rows; r++) {
        storew(s + (long)(r0 + r) * n + t, acc[r][0]);
        if (two) storew(s + (long)(r0 + r) * n + t + VW, acc[r][1]);
    }
}

/* out[r][c..] = sum_i P[r][i] V[i][c..] for rows [r0, r0 + RB) and head_dim columns [c, c + 2 VW) (or VW). */
static inline __attribute__((always_inline)) void pv_tile(
        const float *s, int n, const float *v, long v_row, int r0, int rows, int keys, int c, int two,
        const float *inv, float *out, long o_row, long o_head, const int *qh, const int *pos) {
    vecw acc[RB][2];
    for (int r = 0; r < RB; r++) acc[r][0] = acc[r][1] = splatw(0.0f);
    for (int i = 0; i < keys; i++) {
        const vecw x0 = loadw(v + (long)i * v_row + c);
        const vecw x1 = two ? loadw(v + (long)i * v_row + c + VW) : x0;
        for (int r = 0; r < RB; r++) {
            const vecw b = splatw(s[(long)(r0 + r) * n + i]);
            acc[r][0] += b * x0;
            if (two) acc[r][1] += b * x1;
        }
    }
    for (int r = 0; r < RB && r0 + r < rows; r++) {
        float *o = out + pos[r0 + r] * o_row + qh[r0 + r] * o_head + c;
        storew(o, acc[r][0] * inv[r0 + r]);
        if (two) storew(o + VW, acc[r][1] * inv[r0 + r]);
    }
}

/* One block of `rows` query rows (row r: query head qh[r], position pos[r]) against keys [0, keys). */
static inline __attribute__((always_inline)) void block(
        const float *q, long q_row, long q_head, const float *kt, int n, const float *v, long v_row,
        float *out, long o_row, long o_head, const int *qh, const int *pos, int rows, int keys, float scale,
        float *s, const int head_dim) {
    float qv[ROWS][MAX_DIM];
    for (int r = 0; r < ROWS; r++) /* padding rows (r >= rows) repeat row 0: computed, never stored */
        for (int d = 0; d < head_dim; d++) qv[r][d] = q[pos[r] * q_row + qh[r] * q_head + d] * scale;
    for (int r0 = 0; r0 < rows; r0 += RB) { /* scores; past `keys`, K^T's zeroed padding (n is padded to 16) */
        int t = 0;
        for (; t + 2 * VW <= keys; t += 2 * VW) scores_tile(qv, kt, n, r0, rows, t, 1, s, head_dim);
        for (; t < keys; t += VW) scores_tile(qv, kt, n, r0, rows, t, 0, s, head_dim);
    }
    float inv[ROWS];
    for (int r = 0; r < rows; r++) { /* softmax over keys [0, pos + 1) */
        float *sr = s + (long)r * n;
        const int m = pos[r] + 1;
        const float sum = exp_sum(sr, m, max_of(sr, m));
        for (int i = m; i < keys; i++) sr[i] = 0.0f; /* past this row's position */
        inv[r] = 1.0f / sum;
    }
    for (int r = rows; r < ROWS; r++) inv[r] = 0.0f;
    for (int r0 = 0; r0 < rows; r0 += RB) { /* P @ V */
        int c = 0;
        for (; c + 2 * VW <= head_dim; c += 2 * VW)
            pv_tile(s, n, v, v_row, r0, rows, keys, c, 1, inv, out, o_row, o_head, qh, pos);
        for (; c < head_dim; c += VW) pv_tile(s, n, v, v_row, r0, rows, keys, c, 0, inv, out, o_row, o_head, qh, pos);
    }
}

/* Blocks of positions split over `parts` threads of an OpenMP team of torch's runtime (pdlab.engine.kernel_build),
   block i to part i mod parts, so that every part gets blocks near and far from the start (a block's work grows
   with its position); each part scores into its own rows of scratch. A block is computed the same way in any
   part, so the bits do not depend on `parts`; built without OpenMP the parts run one after another. */
int pdlab_prefill_attention(const float *q, long q_row, long q_head, const float *k, long k_row, long k_head,
                            const float *v, long v_row, long v_head, int n, int heads, int kv_heads, int head_dim,
                            float scale, float *out, long o_row, long o_head, float *scratch, int parts) {
    const int groups = heads / kv_heads;
    if (head_dim % 16 || head_dim > MAX_DIM || groups * kv_heads != heads || groups > ROWS) return -1;
    if (parts < 1) parts = 1;
    const int n16 = (n + 15) / 16 * 16; /* K^T and score rows padded to whole vectors */
    float *kt = scratch;
    const int per = ROWS / groups; /* positions per block */
    const int blocks = (n + per - 1) / per;
    for (int h = 0; h < kv_heads; h++) {
        for (int t = 0; t < n; t++) /* K^T of this head: keys contiguous */
            for (int d = 0; d < head_dim; d++) kt[(long)d * n16 + t] = k[t * k_row + h * k_head + d];
        for (int d = 0; d < head_dim; d++)
            for (int t = n; t < n16; t++) kt[(long)d * n16 + t] = 0.0f;
        const float *vh = v + (long)h * v_head;
#ifdef _OPENMP
#pragma omp parallel for num_threads(parts) schedule(static, 1) if (parts > 1)
#endif
        for (int part = 0; part < parts; part++) {
            float *s = scratch + (long)head_dim * n16 + (long)part * ROWS * n16;
            for (int b = part; b < blocks; b += parts) {
                const int p0 = b * per;
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
    }
    return 0;
}
