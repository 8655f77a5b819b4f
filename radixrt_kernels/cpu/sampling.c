/* The sampling steps on the CPU: greedy argmax over a batch's logits and the token masks of
 * structured outputs (xgrammar's bitmask), each one call instead of PyTorch's several kernels.
 *
 * argmax reads float32 or bfloat16 logits (is_bf16) VL values at a time (the build's vector
 * width, common.h), then value by value for the rest, and answers as PyTorch's argmax does.
 * Rows are split over the caller's OpenMP threads (PyTorch's libgomp) when there is enough work.
 */
#include <math.h>
#include <stdint.h>

#include "common.h"

#define PARALLEL_MIN 16384 /* elements below which one thread does the whole call */
#define INLINE static inline __attribute__((always_inline))

/* One row of radixrt_argmax. */
INLINE int64_t argmax_row(const void *x, int64_t n, int is_bf16) {
    const size_t elem = is_bf16 ? 2 : 4;
    vf best = (vf){0} - INFINITY;
    vfi at = (vfi){0} - 1, idx, nan = {0};
    for (int lane = 0; lane < VL; lane++) idx[lane] = lane;
    int64_t i = 0;
    for (; i + VL <= n; i += VL, idx += VL) {
        const vf v = vload((const char *)x + i * elem, is_bf16);
        const vfi more = v > best; /* strict: a lane keeps its first maximum */
        best = vsel(more, v, best);
        at = (more & idx) | (~more & at);
        nan |= v != v;
    }
    float top = -INFINITY;
    int64_t arg = 0; /* every value -inf: index 0 */
    for (int lane = 0; lane < VL; lane++) { /* the largest value, at its smallest index */
        if (at[lane] >= 0 && (best[lane] > top || (best[lane] == top && at[lane] < arg))) {
            top = best[lane];
            arg = at[lane];
        }
    }
    int any_nan = 0;
    for (int lane = 0; lane < VL; lane++) any_nan |= nan[lane] != 0;
    for (; i < n; i++) {
        const float v = load1(x, i, is_bf16);
        if (v > top) {
            top = v;
            arg = i;
        }
        any_nan |= v != v;
    }
    if (any_nan) { /* NaN counts as the largest value, as in PyTorch: the first one */
        for (i = 0; i < n; i++) {
            const float v = load1(x, i, is_bf16);
            if (v != v) return i;
        }
    }
    return arg;
}

/* out[r] = the index of the largest value of row r of x [rows, n] (rows row_stride elements
 * apart): the first one on ties, the first NaN if there is one (PyTorch's argmax). */
int radixrt_argmax(const void *x, int64_t rows, int64_t n, int64_t row_stride, int is_bf16, int64_t *out,
                   int num_threads) {
    if (n <= 0) return -1;
    const size_t elem = is_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const void *row = (const char *)x + r * row_stride * elem;
        out[r] = is_bf16 ? argmax_row(row, n, 1) : argmax_row(row, n, 0);
    }
    return 0;
}

/* Token masks (structured outputs): logits[rows[i], t] = -inf for every token t < vocab whose
 * bit is 0 in bitmask row rows[i] (int32 words, bit t % 32 of word t / 32, words per row
 * apart); logits float32, rows row_stride elements apart. Other rows are not touched. */
int radixrt_apply_token_bitmask(float *logits, int64_t row_stride, const int32_t *bitmask, int64_t words,
                                const int64_t *rows, int64_t n_rows, int64_t vocab, int num_threads) {
    if (vocab <= 0 || words * 32 < vocab || row_stride < vocab) return -1;
#pragma omp parallel for num_threads(num_threads) if (n_rows * vocab >= PARALLEL_MIN)
    for (int64_t i = 0; i < n_rows; i++) {
        float *row = logits + rows[i] * row_stride;
        const uint32_t *bits = (const uint32_t *)bitmask + rows[i] * words;
        for (int64_t w = 0; w * 32 < vocab; w++) {
            uint32_t blocked = ~bits[w];
            if (blocked == 0) continue;
            const int64_t base = w * 32, end = base + 32 < vocab ? base + 32 : vocab;
            if (blocked == 0xffffffffu && end == base + 32) {
                for (int b = 0; b < 32; b++) row[base + b] = -INFINITY;
                continue;
            }
            for (; blocked; blocked &= blocked - 1) {
                const int64_t t = base + __builtin_ctz(blocked);
                if (t < end) row[t] = -INFINITY;
            }
        }
    }
    return 0;
}
