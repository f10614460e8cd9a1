/* A float32 GEMM for the linears of decode steps: y = x W^T + bias, W packed once into panels of 16 output
   columns (pdlab.engine.gemm_kernel.pack).

   Why our own: a decode step's linears have a few tens of rows (one per running sequence), and there MKL
   (generic kernels on AMD CPUs) and oneDNN ran at about 40 GFLOP/s of one AVX2 core's 78 (2026-12-02, 32 rows,
   in BENCHMARKS.md), partly waiting on the weight: at 32 rows every weight float is used 32 times and then not
   again in the step, so the weight streams from DRAM. This one prefetches the next panel while it multiplies
   the current one, and packs the rows so that the inner loop reads one stream of them.

   Bits: every output element is a sum over k in order 0..k-1, one fused multiply-add per term, then + bias.
   So a row's result does not depend on the rows computed with it (alone, in a batch of 32 or in a prefill of
   2,000 the same bits), nor on the tile it lands in; it differs from F.linear's by float rounding (MKL and
   oneDNN sum in blocks). The generic path (no AVX2 + FMA) does the same with fmaf, so it has the same bits,
   slowly: a race against torch decides whether any of this is used (pdlab.engine.packed_linear).

   Layout: wp[p][i][j] = W[16 p + j][i] for panel p (the last panel's missing columns zero); bias padded
   likewise (or NULL). x: rows at row stride ldx, unit stride over k; y: rows at ldy. */

#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define PANEL 16
#define ROW_BLOCK 120 /* rows packed at a time: 120 x k floats (240 KiB at k = 512) */

#if defined(__AVX2__) && defined(__FMA__)
#define MR 6 /* 6 rows x 16 columns: twelve accumulators, two for the panel's row, one broadcast */
/* R rows (packed: a[i * R + r]) times one panel; pf: the next panel, fetched into cache meanwhile (or NULL) */
#define TILE(R)                                                                                                   \
    static void tile##R(const float *a, const float *b, long k, const float *bias, float *c, long ldc,            \
                        const float *pf) {                                                                        \
        __m256 c0[R], c1[R];                                                                                      \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) c0[r] = c1[r] = _mm256_setzero_ps();                  \
        for (long i = 0; i < k; i++, b += PANEL, a += R) {                                                        \
            if (pf) _mm_prefetch((const char *)(pf + i * PANEL), _MM_HINT_T0);                                    \
            const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);                                    \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                 \
                const __m256 v = _mm256_broadcast_ss(a + r);                                                      \
                c0[r] = _mm256_fmadd_ps(v, b0, c0[r]);                                                            \
                c1[r] = _mm256_fmadd_ps(v, b1, c1[r]);                                                            \
            }                                                                                                     \
        }                                                                                                         \
        const __m256 z0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();                                     \
        const __m256 z1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();                                 \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                     \
            _mm256_storeu_ps(c + r * ldc, _mm256_add_ps(c0[r], z0));                                              \
            _mm256_storeu_ps(c + r * ldc + 8, _mm256_add_ps(c1[r], z1));                                          \
        }                                                                                                         \
    }
/* One row times four panels (pstride floats apart): eight sums in flight where one row's tile has two, whose
   fused multiply-adds would wait on each other (a decode step of one sequence). Each output is summed as in
   tile1, so the bits are tile1's. */
#define ROW_X4 4
static void row_x4(const float *a, const float *b, long k, long pstride, const float *bias, float *c) {
    __m256 acc[2 * ROW_X4];
    _Pragma("GCC unroll 8") for (int j = 0; j < 2 * ROW_X4; j++) acc[j] = _mm256_setzero_ps();
    for (long i = 0; i < k; i++) {
        const __m256 v = _mm256_broadcast_ss(a + i);
        _Pragma("GCC unroll 4") for (int j = 0; j < ROW_X4; j++) {
            const float *bj = b + j * pstride + i * PANEL;
            acc[2 * j] = _mm256_fmadd_ps(v, _mm256_loadu_ps(bj), acc[2 * j]);
            acc[2 * j + 1] = _mm256_fmadd_ps(v, _mm256_loadu_ps(bj + 8), acc[2 * j + 1]);
        }
    }
    _Pragma("GCC unroll 8") for (int j = 0; j < 2 * ROW_X4; j++) {
        const __m256 z = bias ? _mm256_loadu_ps(bias + 8 * j) : _mm256_setzero_ps();
        _mm256_storeu_ps(c + 8 * j, _mm256_add_ps(acc[j], z));
    }
}
#else
#define MR 4
#define TILE(R)                                                                                                   \
    static void tile##R(const float *a, const float *b, long k, const float *bias, float *c, long ldc,            \
                        const float *pf) {                                                                        \
        (void)pf;                                                                                                 \
        float acc[R][PANEL] = {{0}};                                                                              \
        for (long i = 0; i < k; i++, b += PANEL, a += R)                                                          \
            for (int r = 0; r < R; r++)                                                                           \
                for (int j = 0; j < PANEL; j++) acc[r][j] = fmaf(a[r], b[j], acc[r][j]);                          \
        for (int r = 0; r < R; r++)                                                                               \
            for (int j = 0; j < PANEL; j++) c[r * ldc + j] = acc[r][j] + (bias ? bias[j] : 0.0f);                 \
    }
#endif

TILE(1)
TILE(2)
TILE(3)
TILE(4)
#if MR > 4
TILE(5)
TILE(6)
#endif

typedef void (*tile_fn)(const float *, const float *, long, const float *, float *, long, const float *);
static const tile_fn TILES[] = {0, tile1, tile2, tile3, tile4,
#if MR > 4
                                tile5, tile6
#endif
};

/* Panels p0..p1-1 of the product (output columns 16 p0 .. min(16 p1, n) - 1): one thread's part of it, which
   packs the rows for itself. Returns 0, or -1 when the rows' scratch cannot be allocated. */
static int panels(const float *x, long rows, long ldx, const float *wp, long k, long n, const float *bias, float *y,
                  long ldy, long p0, long p1) {
    static _Thread_local float *packed; /* the block's rows, MR at a time, k-major; kept for the next call */
    static _Thread_local long packed_len;
    const long block = rows < ROW_BLOCK ? rows : ROW_BLOCK, all = (n + PANEL - 1) / PANEL;
    const long last = p1 < all ? p1 : all;
    if (block * k > packed_len) {
        float *grown = aligned_alloc(64, (size_t)((block * k * (long)sizeof(float) + 63) / 64 * 64));
        if (!grown) return -1;
        free(packed);
        packed = grown;
        packed_len = block * k;
    }
    float edge[MR * PANEL]; /* the last panel's tile when n is not a multiple of PANEL */
    for (long m0 = 0; m0 < rows; m0 += ROW_BLOCK) {
        const long m1 = m0 + ROW_BLOCK < rows ? m0 + ROW_BLOCK : rows;
        for (long r = m0; r < m1; r += MR) {
            const long mr = m1 - r < MR ? m1 - r : MR;
            float *dst = packed + (r - m0) * k;
            for (long i = 0; i < k; i++)
                for (long q = 0; q < mr; q++) dst[i * mr + q] = x[(r + q) * ldx + i];
        }
        long p = p0;
#ifdef ROW_X4
        if (m1 - m0 == 1) /* a block of one row: four whole panels at a time */
            for (; p + ROW_X4 <= last && (p + ROW_X4) * PANEL <= n; p += ROW_X4)
                row_x4(packed, wp + p * k * PANEL, k, k * PANEL, bias ? bias + p * PANEL : NULL,
                       y + m0 * ldy + p * PANEL);
#endif
        for (; p < last; p++) {
            const float *b = wp + p * k * PANEL, *pb = bias ? bias + p * PANEL : NULL;
            const long c0 = p * PANEL, cols = n - c0 < PANEL ? n - c0 : PANEL;
            for (long r = m0; r < m1; r += MR) {
                const long mr = m1 - r < MR ? m1 - r : MR;
                const float *next = r == m0 && p + 1 < last ? b + k * PANEL : NULL; /* one tile fetches it */
                if (cols == PANEL) {
                    TILES[mr](packed + (r - m0) * k, b, k, pb, y + r * ldy + c0, ldy, next);
                } else {
                    TILES[mr](packed + (r - m0) * k, b, k, pb, edge, PANEL, next);
                    for (long q = 0; q < mr; q++)
                        memcpy(y + (r + q) * ldy + c0, edge + q * PANEL, cols * sizeof(float));
                }
            }
        }
    }
    return 0;
}

/* The whole product, its panels cut into `parts` even runs, one per thread of an OpenMP team (torch's runtime
   and threads: pdlab.engine.kernel_build). A panel is computed the same way whichever part it falls in, so the
   bits do not depend on `parts`; built without OpenMP the parts run one after another. Returns 0, or -1 when
   a part's row scratch cannot be allocated. */
int pdlab_gemm(const float *x, long rows, long ldx, const float *wp, long k, long n, const float *bias, float *y,
               long ldy, int parts) {
    const long all = (n + PANEL - 1) / PANEL;
    int failed = 0;
    if (parts < 1) parts = 1;
#ifdef _OPENMP
#pragma omp parallel for num_threads(parts) schedule(static, 1) reduction(| : failed) if (parts > 1)
#endif
    for (int i = 0; i < parts; i++)
        failed |= panels(x, rows, ldx, wp, k, n, bias, y, ldy, all * i / parts, all * (i + 1) / parts) != 0;
    return failed ? -1 : 0;
}
