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
   scratch: `parts` runs of part_scratch >= heads * (max(lens) + head_dim + 1) floats, one per thread. */

#include "vec_math.h"

#define MAX_GROUP 32
#define MAX_DIM 256
#define MAX_PARTS 256 /* threads one call may run on */
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

/* P @ V of one request, every head in one pass over its V rows front to back, each row read once and whole:
   acc[(h * groups + g) * head_dim + d] (heads * head_dim floats, which stay in L1/L2), from the softmax
   numerators in scratch. Reading V head by head instead (a strided pass per head and slice of head_dim) ran
   at half the memory bandwidth: at head_dim 128 a K/V row is 1-2 KiB, and those passes touch 128 bytes of it. */
static inline __attribute__((always_inline)) void weigh8(
        const float *v, int block_size, const int *table, int n, int kv_heads, const float *scratch, float *acc,
        const int groups, const int head_dim) {
    const int dv = head_dim / 8;
    const long token_stride = (long)kv_heads * head_dim;
    for (long i = 0; i < token_stride * groups; i += 8) store8(acc + i, (vec8){0});
    for (int t0 = 0, blk = 0; t0 < n; t0 += block_size, blk++) {
        const float *vb = v + (long)table[blk] * block_size * token_stride;
        const int m = n - t0 < block_size ? n - t0 : block_size;
        for (int t = 0; t < m; t++) {
            const float *vt = vb + t * token_stride;
            for (long c = 0; c < token_stride; c += 16) PREFETCH(vt + PREFETCH_ROWS * token_stride + c);
            for (int h = 0; h < kv_heads; h++) {
                const float *vh = vt + h * head_dim;
                for (int g = 0; g < groups; g++) {
                    const float p = scratch[(long)(h * groups + g) * n + t0 + t];
                    float *a = acc + (h * groups + g) * head_dim;
                    for (int j = 0; j < dv; j++) store8(a + 8 * j, load8(a + 8 * j) + p * load8(vh + 8 * j));
                }
            }
        }
    }
}

/* One request, head_dim a multiple of 8: scores over K, softmax rows, P @ V over V, each read once front to
   back. Inlined with constant `groups` and `head_dim` for common shapes (the loops over them unroll without
   run-time trip counts) and with run-time ones for the rest. scratch: heads * (n + head_dim + 1) floats. */
static inline __attribute__((always_inline)) void request8(
        const float *qr, long q_head_stride, const float *k, const float *v, int block_size, const int *table,
        int n, int kv_heads, float scale, float *o, long o_head_stride, float *scratch, const int groups,
        const int head_dim) {
    const int heads = kv_heads * groups;
    float *acc = scratch + (long)heads * n, *inv = acc + (long)heads * head_dim;
    scores8(qr, q_head_stride, k, block_size, table, n, kv_heads, scale, scratch, groups, head_dim);
    for (int i = 0; i < heads; i++) { /* softmax rows: numerators in place, 1 / denominator aside */
        float *s = scratch + (long)i * n;
        inv[i] = 1.0f / exp_sum(s, n, max_of(s, n));
    }
    weigh8(v, block_size, table, n, kv_heads, scratch, acc, groups, head_dim);
    for (int i = 0; i < heads; i++)
        for (int j = 0; j < head_dim; j += 8) store8(o + i * o_head_stride + j, load8(acc + i * head_dim + j) * inv[i]);
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
    request8(qr, q_head_stride, k, v, block_size, table, n, kv_heads, scale, o, o_head_stride, scratch, G, D); \
    break;

/* Requests first..last-1 of the batch, with one part's scratch. */
static void requests(const float *q, long q_row_stride, long q_head_stride, const int *rows, int first, int last,
                     int kv_heads, int head_dim, const float *k, const float *v, int block_size, const int *tables,
                     int width, const int *lens, float scale, float *out, long o_row_stride, long o_head_stride,
                     float *scratch, const int groups) {
    const long token_stride = (long)kv_heads * head_dim;
    for (int b = first; b < last; b++) {
        const int n = lens[b];
        const int *table = tables + (long)b * width;
        const float *qr = q + rows[b] * q_row_stride;
        float *o = out + rows[b] * o_row_stride;
        switch (groups * 1024 + head_dim) { /* the shapes of common models get constant loop bounds */
            CASE(1, 64) CASE(1, 96) CASE(1, 128) CASE(2, 64) CASE(2, 128) CASE(4, 32) CASE(4, 64) CASE(4, 128)
            CASE(6, 128) CASE(7, 64) CASE(7, 128) CASE(8, 32) CASE(8, 64) CASE(8, 128)
            default:
                if (head_dim % 8 == 0) {
                    request8(qr, q_head_stride, k, v, block_size, table, n, kv_heads, scale, o, o_head_stride,
                             scratch, groups, head_dim);
                    break;
                }
                for (int h = 0; h < kv_heads; h++)
                    attend(qr + (long)h * groups * q_head_stride, q_head_stride, k, v, block_size, table, n,
                           token_stride, h, scale, o + (long)h * groups * o_head_stride, o_head_stride, scratch,
                           groups, head_dim);
        }
    }
}

/* Every decode request of the batch, in `parts` contiguous runs of requests of about equal context (one per
   thread of an OpenMP team of torch's runtime: pdlab.engine.kernel_build), each with its own `part_scratch`
   floats of scratch. A request is computed the same way in any part, so the bits do not depend on `parts`;
   built without OpenMP the parts run one after another. */
int pdlab_decode_attention(const float *q, long q_row_stride, long q_head_stride, const int *rows, int batch,
                           int heads, int kv_heads, int head_dim, const float *k, const float *v, int block_size,
                           const int *tables, int width, const int *lens, float scale, float *out,
                           long o_row_stride, long o_head_stride, float *scratch, long part_scratch, int parts) {
    const int groups = heads / kv_heads;
    if (groups > MAX_GROUP || head_dim > MAX_DIM || groups * kv_heads != heads) return -1;
    parts = parts < 1 ? 1 : parts > MAX_PARTS ? MAX_PARTS : parts;
    int cut[MAX_PARTS + 1]; /* part i: requests cut[i]..cut[i+1]-1, each in the part its context starts in */
    long total = 0, before = 0;
    for (int b = 0; b < batch; b++) total += lens[b];
    for (int i = 0; i <= parts; i++) cut[i] = batch;
    cut[0] = 0;
    for (int b = 0, i = 1; b < batch; before += lens[b], b++)
        while (i < parts && before * parts >= total * i) cut[i++] = b;
#ifdef _OPENMP
#pragma omp parallel for num_threads(parts) schedule(static, 1) if (parts > 1)
#endif
    for (int i = 0; i < parts; i++)
        requests(q, q_row_stride, q_head_stride, rows, cut[i], cut[i + 1], kv_heads, head_dim, k, v, block_size,
                 tables, width, lens, scale, out, o_row_stride, o_head_stride, scratch + i * part_scratch, groups);
    return 0;
}
