/* Decode attention over the paged KV pool, every decode request of a step in one call (pdlab.engine.cpu_kernel).

   One query token per request attends to its whole context, read in place from the request's blocks: no
   gather, no per-request Python. For each (request, K/V head) the G query heads that share the K/V head
   are scored against every context token, softmaxed (max-subtracted, as SDPA does) and used to weigh V.

   Plain C, no torch headers: the build takes about a second with any C compiler and is called through
   ctypes with data pointers. Built with -O3 -march=native and associative float math so that the loops
   over head_dim vectorise; exp and the softmax row helpers are vec_math.h's, shared with the other kernels.

   Layouts (float32):
     q, out   rows of the packed batch; element (row, head, d) at row * row_stride + head * head_stride + d
     k, v     one layer's blocks [num_blocks, block_size, kv_heads, head_dim], contiguous
     tables   [batch, width] block ids (int32), lens [batch] context tokens (int32), rows [batch] (int32)
   scratch: at least heads * max(lens) floats. */

#include "vec_math.h"

#define MAX_GROUP 32
#define MAX_DIM 256
#define PREFETCH_ROWS 8 /* tokens ahead: K/V rows come from L3 or DRAM, read front to back */

/* Eight floats as one value (GCC/Clang vector extension: AVX or NEON registers, generic code elsewhere). */
typedef float vec8 __attribute__((vector_size(32)));

static inline vec8 load8(const float *p) { vec8 x; memcpy(&x, p, sizeof x); return x; }
static inline void store8(float *p, vec8 x) { memcpy(p, &x, sizeof x); }

/* The sum of a vector's eight lanes, as ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)) on every path. */
static inline float hsum8(vec8 a) {
#if defined(__AVX__)
    __m256 v;
    memcpy(&v, &a, sizeof v);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
#else
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
#endif
}

/* Scores of every (K/V head, query head) of one request in one pass over its tokens, so each K row is read
   once, front to back: scratch[(h * groups + g) * n + t]. */
static inline __attribute__((always_inline)) void scores8(
        const float *qr, long q_head_stride, const float *k, int block_size, const int *table, int n,
        int kv_heads, float scale, float *scratch, const int groups, const int head_dim) {
    const int dv = head_dim / 8;
    const long token_stride = (long)kv_heads * head_dim;
    for (int t0 = 0, blk = 0; t0 < n; t0 += block_size, blk++) {
        const float *kb = k + (long)table[blk] * block_size * token_stride;
        const int m = n - t0 < block_size ? n - t0 : block_size;
        for (int t = 0; t < m; t++) {
            const float *kt = kb + t * token_stride;
            for (long c = 0; c < token_stride; c += 16) PREFETCH(kt + PREFETCH_ROWS * token_stride + c);
            for (int h = 0; h < kv_heads; h++) {
                const float *kh = kt + h * head_dim;
                for (int g = 0; g < groups; g++) {
                    const float *qg = qr + (h * groups + g) * q_head_stride;
                    vec8 a = load8(qg) * load8(kh);
                    for (int j = 1; j < dv; j++) a += load8(qg + 8 * j) * load8(kh + 8 * j);
                    scratch[(long)(h * groups + g) * n + t0 + t] = hsum8(a) * scale;
                }
            }
        }
    }
}

/* One (request, K/V head): its `groups` query heads against the request's `n` context tokens. Inlined into
   callers with constant `groups` and `head_dim` below, so the loops over them unroll and vectorise without
   run-time trip counts. head_dim a multiple of 8: eight-float vectors, scores summed across a vector once
   per (token, head), P @ V accumulated in registers, `CHUNK` vectors of head_dim at a time. */
#define CHUNK 4
static inline __attribute__((always_inline)) void attend8(
        const float *qh, long q_head_stride, const float *k, const float *v, int block_size, const int *table,
        int n, long token_stride, int h, float scale, float *o, long o_head_stride, float *scratch,
        const int groups, const int head_dim, const int scored) {
    const int dv = head_dim / 8;
    for (int t0 = 0, blk = 0; !scored && t0 < n; t0 += block_size, blk++) { /* scores: scratch[g * n + t] */
        const float *kb = k + (long)table[blk] * block_size * token_stride + (long)h * head_dim;
        const int m = n - t0 < block_size ? n - t0 : block_size;
        for (int t = 0; t < m; t++) {
            const float *kt = kb + t * token_stride;
            PREFETCH(kt + PREFETCH_ROWS * token_stride);
            for (int g = 0; g < groups; g++) {
                const float *qg = qh + g * q_head_stride;
                vec8 a = load8(qg) * load8(kt);
                for (int j = 1; j < dv; j++) a += load8(qg + 8 * j) * load8(kt + 8 * j);
                scratch[g * n + t0 + t] = hsum8(a) * scale;
            }
        }
    }
    float inv[MAX_GROUP];
    for (int g = 0; g < groups; g++) { /* softmax rows */
        float *s = scratch + (long)g * n;
        inv[g] = 1.0f / exp_sum(s, n, max_of(s, n));
    }
    for (int c = 0; c < dv; c += CHUNK) { /* P @ V, CHUNK vectors of head_dim per pass */
        const int w = dv - c < CHUNK ? dv - c : CHUNK;
        vec8 acc[MAX_GROUP][CHUNK];
        for (int g = 0; g < groups; g++)
            for (int j = 0; j < CHUNK; j++) acc[g][j] = (vec8){0};
        for (int t0 = 0, blk = 0; t0 < n; t0 += block_size, blk++) {
            const float *vb = v + (long)table[blk] * block_size * token_stride + (long)h * head_dim + 8 * c;
            const int m = n - t0 < block_size ? n - t0 : block_size;
            for (int t = 0; t < m; t++) {
                const float *vt = vb + t * token_stride;
                for (int c2 = 0; c2 < 8 * w; c2 += 16) PREFETCH(vt + PREFETCH_ROWS * token_stride + c2);
                vec8 x[CHUNK];
                for (int j = 0; j < w; j++) x[j] = load8(vt + 8 * j);
                for (int g = 0; g < groups; g++) {
                    const float p = scratch[g * n + t0 + t];
                    for (int j = 0; j < w; j++) acc[g][j] += p * x[j];
                }
            }
        }
        for (int g = 0; g < groups; g++)
            for (int j = 0; j < w; j++) store8(o + (long)g * o_head_stride + 8 * (c + j), acc[g][j] * inv[g]);
    }
}

/* Any shape within the limits: plain loops. */
static void attend(const float *qh, long q_head_stride, const float *k, const float *v, int block_size,
                   const int *table, int n, long token_stride, int h, float scale, float *o, long o_head_stride,
                   float *scratch, const int groups, const int head_dim) {
    float acc[MAX_GROUP * MAX_DIM];
    float inv[MAX_GROUP];
    for (int t0 = 0, blk = 0; t0 < n; t0 += block_size, blk++) {
        const float *kb = k + (long)table[blk] * block_size * token_stride + (long)h * head_dim;
        const int m = n - t0 < block_size ? n - t0 : block_size;
        for (int t = 0; t < m; t++) {
            const float *kt = kb + t * token_stride;
            for (int g = 0; g < groups; g++) {
                const float *qg = qh + g * q_head_stride;
                float s = 0.0f;
                for (int d = 0; d < head_dim; d++) s += qg[d] * kt[d];
                scratch[g * n + t0 + t] = s * scale;
            }
        }
    }
    for (int g = 0; g < groups; g++) {
        float *s = scratch + (long)g * n;
        inv[g] = 1.0f / exp_sum(s, n, max_of(s, n));
    }
    memset(acc, 0, sizeof(float) * groups * head_dim);
    for (int t0 = 0, blk = 0; t0 < n; t0 += block_size, blk++) {
        const float *vb = v + (long)table[blk] * block_size * token_stride + (long)h * head_dim;
        const int m = n - t0 < block_size ? n - t0 : block_size;
        for (int t = 0; t < m; t++) {
            const float *vt = vb + t * token_stride;
            for (int g = 0; g < groups; g++) {
                const float p = scratch[g * n + t0 + t];
                float *a = acc + g * head_dim;
                for (int d = 0; d < head_dim; d++) a[d] += p * vt[d];
            }
        }
    }
    for (int g = 0; g < groups; g++) {
        float *og = o + (long)g * o_head_stride;
        for (int d = 0; d < head_dim; d++) og[d] = acc[g * head_dim + d] * inv[g];
    }
}

#define CASE(G, D) case (G) * 1024 + (D): \
    scores8(q + rows[b] * q_row_stride, q_head_stride, k, block_size, table, n, kv_heads, scale, scratch, G, D); \
    for (int h = 0; h < kv_heads; h++) \
        attend8(0, q_head_stride, k, v, block_size, table, n, token_stride, h, scale, \
                out + rows[b] * o_row_stride + (long)h * G * o_head_stride, o_head_stride, \
                scratch + (long)h * G * n, G, D, 1); \
    break;

int pdlab_decode_attention(const float *q, long q_row_stride, long q_head_stride, const int *rows, int batch,
                           int heads, int kv_heads, int head_dim, const float *k, const float *v, int block_size,
                           const int *tables, int width, const int *lens, float scale, float *out,
                           long o_row_stride, long o_head_stride, float *scratch) {
    const int groups = heads / kv_heads;
    if (groups > MAX_GROUP || head_dim > MAX_DIM || groups * kv_heads != heads) return -1;
    const long token_stride = (long)kv_heads * head_dim;
    for (int b = 0; b < batch; b++) {
        const int n = lens[b];
        const int *table = tables + (long)b * width;
        switch (groups * 1024 + head_dim) { /* the shapes of common models get constant loop bounds */
            CASE(1, 64) CASE(1, 128) CASE(2, 64) CASE(2, 128) CASE(4, 32) CASE(4, 64) CASE(4, 128)
            CASE(8, 64) CASE(8, 128)
            default:
                for (int h = 0; h < kv_heads; h++) {
                    const float *qh = q + rows[b] * q_row_stride + (long)h * groups * q_head_stride;
                    float *o = out + rows[b] * o_row_stride + (long)h * groups * o_head_stride;
                    if (head_dim % 8 == 0)
                        attend8(qh, q_head_stride, k, v, block_size, table, n, token_stride, h, scale, o,
                                o_head_stride, scratch, groups, head_dim, 0);
                    else
                        attend(qh, q_head_stride, k, v, block_size, table, n, token_stride, h, scale, o,
                               o_head_stride, scratch, groups, head_dim);
                }
        }
    }
    return 0;
}
