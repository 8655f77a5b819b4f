/* float32 linear layers on the CPU: y = x·Wᵀ (+ bias), each row's results independent of the
 * rows beside it.
 *
 * Packed layout (linear.pack_f32): W [N, K] float32 becomes, per block of FB = 64 output
 * features (N padded with zero rows to a whole block), [K][FB]: input feature by input
 * feature, the block's 64 weights side by side. A block is one contiguous run of K·256 bytes,
 * which a thread streams in the order it multiplies it. K may be any size.
 *
 * Every output element is one chain over the input features in order: acc = 0, then
 * acc = fma(x[r][i], W[f][i], acc) for i = 0 .. K - 1, then acc + bias[f] (GCC contracts the
 * a += x·w below into one FMA wherever the build has FMA; without it, a multiply and an add).
 * The chain is the same whatever the row count, the register block a row lands in, the thread
 * that runs it or the thread count, so a row's results have the same bits alone or in any batch.
 *
 * Register blocks: MR rows × RB_VECS vectors of VL features (vf, common.h): with AVX-512 the
 * block's 64 features at once (24 accumulators); narrower builds a part of them at a time.
 * The input features run in segments of KSEG whose weights (16 KiB) stay in L1 while every
 * row panel of a pass reads them; the sums wait in memory between segments (stored and read
 * back exactly, so the chain is unchanged).
 *
 * Threads split the work items (block, pass of PASS rows), in block order, into contiguous
 * shares: a thread keeps a block's weights in cache over its passes.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

#define FB 64   /* output features per block */
#define KSEG 64 /* input features per segment */
#ifdef __AVX512F__
#define MR 6      /* rows per register block ... */
#define RB_VECS 4 /* ... by this many vectors of VL features: 24 accumulators */
#else
#define MR 4
#define RB_VECS 2 /* 8 accumulators */
#endif
#define RB_COLS (RB_VECS * VL) /* features per register block */
#define PASS (8 * MR)          /* rows per work item */
#define PARALLEL_MIN (1 << 15) /* multiply-adds from which the call is shared by threads */

/* acc[i][col .. col + RB_COLS - 1] for the mr rows of x (xs apart) over `len` input features
 * (x and w from the segment's first; w: the block's [len][FB] weights), continuing the sums in
 * acc, or starting them at 0 where first. */
static inline __attribute__((always_inline)) void f32_rows(int mr, const float *x, int64_t xs,
                                                           const float *w, int64_t len, int first,
                                                           int col, float (*acc)[FB]) {
    vf a[MR][RB_VECS];
    const float *xr[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
        xr[i] = x + (i < mr ? i : 0) * xs;
#pragma GCC unroll 4
        for (int v = 0; v < RB_VECS; v++) {
            a[i][v] = (vf){0};
            if (!first && i < mr) memcpy(&a[i][v], &acc[i][col + VL * v], sizeof(vf));
        }
    }
    for (int64_t kk = 0; kk < len; kk++) {
        vf wv[RB_VECS];
#pragma GCC unroll 4
        for (int v = 0; v < RB_VECS; v++) memcpy(&wv[v], w + kk * FB + col + VL * v, sizeof(vf));
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            const float xi = xr[i][kk];
#pragma GCC unroll 4
            for (int v = 0; v < RB_VECS; v++) a[i][v] += xi * wv[v];
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int v = 0; v < RB_VECS; v++) memcpy(&acc[i][col + VL * v], &a[i][v], sizeof(vf));
}

/* Rows 0 .. rows - 1 of acc (x: their first row, xs apart) over one segment of a block. */
static void f32_segment(const float *x, int64_t xs, const float *w, int64_t len, int first, int rows,
                        float (*acc)[FB]) {
    for (int col = 0; col < FB; col += RB_COLS) {
        int r = 0;
        for (; r + MR <= rows; r += MR) f32_rows(MR, x + r * xs, xs, w, len, first, col, acc + r);
        switch (rows - r) { /* the last panel, with a register block of its own size */
#define F32_REST(n) \
    case n: f32_rows(n, x + r * xs, xs, w, len, first, col, acc + r); break;
            F32_REST(1) F32_REST(2) F32_REST(3)
#if MR > 4
            F32_REST(4) F32_REST(5)
#endif
#undef F32_REST
        default: break;
        }
    }
}

/* Rows r0 .. r0 + rows - 1 of acc + bias, written to y's features f0 .. (those below n). */
static void f32_write(float (*acc)[FB], int rows, int64_t r0, int64_t f0, const float *bias, float *y,
                      int64_t y_stride, int64_t n) {
    const int64_t cols = n - f0 < FB ? n - f0 : FB;
    for (int row = 0; row < rows; row++) {
        float *dst = y + (r0 + row) * y_stride + f0;
        if (bias == NULL) {
            memcpy(dst, acc[row], (size_t)cols * 4);
            continue;
        }
        for (int64_t f = 0; f < cols; f++) dst[f] = acc[row][f] + bias[f0 + f];
    }
}

struct f32_call {
    const float *x;
    int64_t x_stride;
    const float *packed, *bias;
    float *y;
    int64_t y_stride, m, n, k;
};

/* Work items i0 .. i1 - 1 (block i / passes, pass i % passes). */
static void f32_items(const struct f32_call *c, int64_t i0, int64_t i1) {
    float acc[PASS][FB] __attribute__((aligned(64)));
    const int64_t passes = (c->m + PASS - 1) / PASS;
    for (int64_t item = i0; item < i1; item++) {
        const int64_t b = item / passes, r0 = item % passes * PASS;
        const int rows = c->m - r0 < PASS ? (int)(c->m - r0) : PASS;
        const float *wb = c->packed + b * c->k * FB, *xp = c->x + r0 * c->x_stride;
        for (int64_t k0 = 0; k0 < c->k; k0 += KSEG) {
            const int64_t len = c->k - k0 < KSEG ? c->k - k0 : KSEG;
            f32_segment(xp + k0, c->x_stride, wb + k0 * FB, len, k0 == 0, rows, acc);
        }
        f32_write(acc, rows, r0, b * FB, c->bias, c->y, c->y_stride, c->n);
    }
}

/* y [m, n] (rows y_stride apart) = x [m, k] (rows x_stride apart) · Wᵀ + bias (bias [n] or
 * NULL), W packed as above. Returns -1 (writing nothing) on sizes it does not take. */
int radixrt_linear_f32(const float *x, int64_t x_stride, const float *packed, const float *bias, float *y,
                       int64_t y_stride, int64_t m, int64_t n, int64_t k, int num_threads) {
    if (m < 0 || n <= 0 || k <= 0 || x_stride < k || y_stride < n || num_threads < 1) return -1;
    if (m == 0) return 0;
    const struct f32_call c = {x, x_stride, packed, bias, y, y_stride, m, n, k};
    const int64_t items = (n + FB - 1) / FB * ((m + PASS - 1) / PASS);
#pragma omp parallel num_threads(num_threads) if (m * n * k >= PARALLEL_MIN)
    {
        const int64_t id = omp_get_thread_num(), threads = omp_get_num_threads();
        f32_items(&c, items * id / threads, items * (id + 1) / threads);
    }
    return 0;
}
