/* Where a packed linear's results go, and how they are written: shared by the AMX kernel
 * (linear_amx.c) and the vector kernels (linear_vec.c), so every path rounds its sums the same way.
 * A block's sums arrive as float32 acc [32 rows][NB features]; write_results adds the bias,
 * rounds to bf16 and stores them, or applies the gated (SiLU-and-mul) or rotary epilogue. */
#ifndef RADIXRT_CPU_LINEAR_OUT_H
#define RADIXRT_CPU_LINEAR_OUT_H

#include <stdint.h>
#include <string.h>

#include "common.h"

#define NB 32        /* output features per block */
#define KC 32        /* input features per chunk */
#define MAX_UNIT 4   /* blocks written together at most (a rotary head of 128) */

/* Where results go: y [*, n] with rows `stride` elements apart (bf16, or float32 with f32),
 * plus the bias [n] (bf16) where not NULL. Gated: SiLU-and-mul of block pairs; rope_dim > 0:
 * the rotary embedding on the heads of rope_dim features in features [0, rope_cols), at row r's
 * position positions[r], with float32 tables cos and sin± [*, rope_dim]. */
struct output {
    void *y;
    int64_t stride, n; /* n: the output's features (gated: half the weight's) */
    const bf16 *bias;
    int f32, gated;
    const int64_t *positions;
    const float *cos, *sin;
    int64_t rope_dim, rope_cols;
};

/* A unit's finished results (a block; a gated pair of blocks; a rotary head's blocks), waiting
 * to be written: rows r0 .. r0 + rows - 1 (none when rows is 0) of the output features from f0,
 * as float32 acc[i] [32][NB] for the unit's block i. */
struct results {
    float (*acc)[32][NB];
    int rows;
    int64_t r0, f0;
};

/* One block's results (r->acc[0]) plus the bias, rounded to bf16 (then widened with f32);
 * features past n dropped. */
static inline void write_block(const struct output *o, const struct results *r) {
    for (int h = 0; h < NB / VL; h++) {
        const int64_t cols = o->n - r->f0 - VL * h;
        if (cols <= 0) break;
        vf b = {0};
        if (o->bias != NULL) {
            bf16 part[VL] = {0};
            memcpy(part, o->bias + r->f0 + VL * h, (size_t)(cols < VL ? cols : VL) * 2);
            b = vload(part, 1);
        }
        const size_t elem = o->f32 ? 4 : 2, bytes = (size_t)(cols < VL ? cols : VL) * elem;
        for (int row = 0; row < r->rows; row++) {
            const vf x = *(const vf *)&r->acc[0][row][VL * h] + b;
            const int64_t at = (r->r0 + row) * o->stride + r->f0 + VL * h;
            char *dst = (char *)o->y + at * (int64_t)elem;
            float part[VL] __attribute__((aligned(64))); /* a short last block's values */
            void *to = cols >= VL ? (void *)dst : (void *)part;
            if (o->f32) {
                const vf wide = vround(x);
                memcpy(to, &wide, sizeof wide);
            } else {
                vstore(to, x, 1);
            }
            if (to == part) memcpy(dst, part, bytes);
        }
    }
}

/* Gated output: silu(gate)·up of bf16-rounded results, rounded as radixrt_silu_mul rounds. */
static inline void write_gated(const struct output *o, const struct results *r) {
    for (int h = 0; h < NB / VL; h++) {
        for (int row = 0; row < r->rows; row++) {
            const vf g = vround(*(const vf *)&r->acc[0][row][VL * h]);
            const vf u = vround(*(const vf *)&r->acc[1][row][VL * h]);
            const vf silu = vround(g * vrecipf(1.0f + vexpf(-g)));
            vstore((bf16 *)o->y + (r->r0 + row) * o->stride + r->f0 + VL * h, silu * u, 1);
        }
    }
}

/* VL bias values from feature f as float32 (0 without a bias). */
static inline vf bias_at(const struct output *o, int64_t f) {
    return o->bias != NULL ? vload(o->bias + f, 1) : (vf){0};
}

/* A rotary head (features f0 .. f0 + D - 1, D = rope_dim): x = the results plus the bias,
 * rounded; then x·cos + roll(x, D/2)·sin± with the tables rounded to bf16 and each product and
 * the sum rounded, as radixrt_rope rotates. */
static inline void write_rope(const struct output *o, const struct results *r) {
    const int64_t d = o->rope_dim, half_blocks = d / NB / 2;
    for (int64_t i = 0; i < half_blocks; i++) {
        for (int h = 0; h < NB / VL; h++) {
            const int64_t da = i * NB + VL * h, db = da + d / 2; /* paired dims of the head */
            const vf ba = bias_at(o, r->f0 + da), bb = bias_at(o, r->f0 + db);
            for (int row = 0; row < r->rows; row++) {
                const float *cos_row = o->cos + o->positions[r->r0 + row] * d;
                const float *sin_row = o->sin + o->positions[r->r0 + row] * d;
                const vf xa = vround(*(const vf *)&r->acc[i][row][VL * h] + ba);
                const vf xb = vround(*(const vf *)&r->acc[i + half_blocks][row][VL * h] + bb);
                const vf ca = vround(vload(cos_row + da, 0)), sa = vround(vload(sin_row + da, 0));
                const vf cb = vround(vload(cos_row + db, 0)), sb = vround(vload(sin_row + db, 0));
                bf16 *out = (bf16 *)o->y + (r->r0 + row) * o->stride + r->f0;
                vstore(out + da, vround(xa * ca) + vround(xb * sa), 1);
                vstore(out + db, vround(xb * cb) + vround(xa * sb), 1);
            }
        }
    }
}

/* Write a unit's results: gated, rotated, or block by block. */
static inline void write_results(const struct output *o, const struct results *r, int unit) {
    if (o->gated) {
        write_gated(o, r);
        return;
    }
    if (o->rope_dim > 0 && r->f0 < o->rope_cols) {
        write_rope(o, r);
        return;
    }
    for (int i = 0; i < unit; i++) {
        const struct results one = {r->acc + i, r->rows, r->r0, r->f0 + i * NB};
        write_block(o, &one);
    }
}

/* Fetch for writing the output lines of rows r0 .. r0 + rows - 1 at features f0 .. f0 + NB - 1
 * (the next pass's, a pass ahead): output rows lie far apart, no hardware prefetcher follows
 * them, and a prefill's output is megabytes, so each line's first write would wait out a miss. */
static inline void claim_output(const struct output *o, int64_t r0, int64_t rows, int64_t f0) {
    const size_t elem = o->f32 ? 4 : 2;
    for (int64_t r = 0; r < rows; r++)
        for (size_t byte = 0; byte < NB * elem; byte += 64)
            __builtin_prefetch((const char *)o->y + ((r0 + r) * o->stride + f0) * elem + byte, 1, 1);
}

#endif
