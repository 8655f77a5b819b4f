/* The kernels' per-thread parts, for radixrt_chain (chain.c), which runs several steps one
 * after another inside one parallel region: each part does thread id's share of a call, and
 * the chain puts a barrier between the steps. The library's own entry points run the same
 * parts, so a step gives the results of the call it stands for, bit for bit. */
#ifndef RADIXRT_CPU_PARTS_H
#define RADIXRT_CPU_PARTS_H

#include <stdint.h>

#include "common.h"

#define KERNEL_FMA 0
#define KERNEL_DPBF16 1
#define HIDDEN __attribute__((visibility("hidden")))

/* A linear call of linear_vec.c's kernels: radixrt_linear_vec's arguments. */
struct vec_call {
    int kernel;
    const bf16 *x;
    int64_t x_stride;
    const bf16 *packed;
    const bf16 *bias;
    void *y;
    int64_t y_stride;
    int y_f32, gated;
    const int64_t *positions;
    const float *rope_cos, *rope_sin;
    int64_t rope_dim, rope_cols, m, n, k;
};

int radixrt_linear_vec_available(int kernel);
HIDDEN int radixrt_vec_check(const struct vec_call *c);
HIDDEN void radixrt_vec_widen(const struct vec_call *c, float *xf, int64_t r0, int64_t r1);
HIDDEN void radixrt_vec_part(const struct vec_call *c, const float *xf, int64_t id, int64_t threads);

/* Rows r0 .. r1 - 1 of radixrt_rms_norm (elementwise.c); 0, or -1 if n is too wide. */
HIDDEN int radixrt_norm_rows(const void *x, int64_t x_stride, void *residual, void *out, const void *weight,
                             int64_t r0, int64_t r1, int64_t n, float eps, int is_bf16);

/* Rows r0 .. r1 - 1 of radixrt_rope (elementwise.c); 0, or -1 for a head size it does not take. */
HIDDEN int radixrt_rope_rows(void *x, int64_t x_stride, int64_t r0, int64_t r1, int64_t heads, int64_t d,
                             const int64_t *positions, const float *cos_table, const float *sin_table,
                             int is_bf16);

#endif
