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
HIDDEN void radixrt_vec_widen(const struct vec_call *c, float *xf, int64_t r0, int64_t r1, int64_t i0,
                              int64_t i1);
HIDDEN void radixrt_vec_part(const struct vec_call *c, const float *xf, int64_t id, int64_t threads);

/* Rows r0 .. r1 - 1 of radixrt_rms_norm (elementwise.c), or of radixrt_rms_norm_heads: row r is
 * head r % heads of token r / heads (heads > 1: no residual); 0, or -1 if n is too wide. */
HIDDEN int radixrt_norm_rows(const void *x, int64_t x_stride, void *residual, void *out, int64_t out_stride,
                             const void *weight, int64_t heads, int64_t r0, int64_t r1, int64_t n, float eps,
                             int is_bf16);

/* Rows r0 .. r1 - 1 of radixrt_rope (elementwise.c); 0, or -1 for a head size it does not take. */
HIDDEN int radixrt_rope_rows(void *x, int64_t x_stride, int64_t r0, int64_t r1, int64_t heads, int64_t d,
                             const int64_t *positions, const float *cos_table, const float *sin_table,
                             int is_bf16);

/* Rows r0 .. r1 - 1 of radixrt_silu_mul (elementwise.c): x [*, 2n], out [*, n], contiguous. */
HIDDEN void radixrt_silu_mul_rows(const void *x, void *out, int64_t r0, int64_t r1, int64_t n, int is_bf16);

/* radixrt_attention's arguments but the KV buffers and the thread count, every field 8 bytes
 * (flags as int64, scaling a double): what a decode chain's attention steps read, as int64. */
struct attention_args {
    const void *q;
    int64_t q_stride;
    void *out;
    int64_t is_bf16, bf16_dots, exact, t, h, kh, d;
    double scaling;
    int64_t num_segments;
    const int64_t *slots, *seg_slot_start, *members, *seg_member_start, *seg_part, *seg_causal, *num_parts;
    float *part_acc, *part_m, *part_l;
    const void *new_k, *new_v;
    int64_t new_stride;
    const int64_t *new_slots;
    int64_t n_new;
    const int64_t *seg_key_start, *positions; /* a window's: [S] and [T] (NULL without one) */
    int64_t window;                           /* a sliding window of this many keys (0: none) */
    double softcap;                           /* the scores' soft cap (0: none) */
};

/* An attention call of attention.c: its arguments, then what radixrt_attn_prepare derives. */
struct attn_call {
    struct attention_args a;
    void *k_buf, *v_buf;
    int64_t items[2], qb; /* the work items of each phase, and query rows per item */
    int use_amx, merging; /* merging: tokens' two parts are merged at the end (not exact) */
    int phases;           /* 2: an exact call's part-1 items run after its part-0 items, else 1 */
};

/* Checks the sizes (-1: out of range; -2: an exact call's segments do not let part 1 continue
 * part 0) and sets items, qb, use_amx, merging and phases. */
HIDDEN int radixrt_attn_prepare(struct attn_call *c);
/* Thread id's share of storing the new K/V rows in their slots. */
HIDDEN void radixrt_attn_store(const struct attn_call *c, int64_t id, int64_t threads);
/* Work items of phase `phase` (0 .. phases - 1) taken from the shared counter *next (from 0)
 * until none is left; a phase starts when every item of the one before it is done. */
HIDDEN void radixrt_attn_items(const struct attn_call *c, int64_t *next, int phase);
/* Thread id's share of merging the tokens of two parts (after every item is done). */
HIDDEN void radixrt_attn_merge(const struct attn_call *c, int64_t id, int64_t threads);

#endif
