/* The routed experts of a mixture-of-experts block in one call, on bf16 weights packed as
 * radixrt_linear takes them: out [t, h] = Σ_r w[t, r] · down_e(silu(x·gate_eᵀ) · x·up_eᵀ) for
 * each token's k experts e = experts[t, r], in rank order.
 *
 * 1. Grouping (the calling thread): the (token, rank) pairs p = t·k + r sorted by expert, each
 *    expert's pairs in ascending order, each pair's token row copied to xs [t·k, h].
 * 2. gate_up: for each expert with rows, its rows of xs by its gated weight [gate; up] into
 *    hs [t·k, i]; the experts' pairs of blocks (gate block, up block) split among the threads.
 * 3. down: each expert's rows of hs by its down weight into ys [t·k, h], its blocks split alike.
 * 4. The weighted sum per token: each rank's row of ys times the token's weight for it (rounded
 *    to bf16 where the weights are bf16; in float32 where they are float32), added in float32
 *    in rank order from rank 0's product, rounded once to bf16; the tokens split among the
 *    threads.
 * One parallel region, a barrier between the steps. Steps 2 and 3 call radixrt_linear (AMX) or
 * radixrt_linear_vec (FMA, AVX512-BF16) on one thread for a run of an expert's blocks (a packed
 * weight's blocks lie one after another, so a run is a packed weight of its own): a row's
 * results are the bits those kernels give it in a call of the whole weight over any rows, and
 * the sum is rounded as PyTorch's ops round it (outputs · weights, then the sum over ranks in
 * float32, then .to(bfloat16)). No contraction into FMA: every product is rounded on its own.
 */
#pragma GCC optimize("fp-contract=off")
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "linear_out.h"

#define KERNEL_AMX 2 /* 0 and 1: radixrt_linear_vec's kernels (FMA, AVX512-BF16) */

int radixrt_linear(const bf16 *x, int64_t x_stride, const bf16 *packed, const bf16 *bias, void *y,
                   int64_t y_stride, int y_f32, int gated, const int64_t *positions, const float *rope_cos,
                   const float *rope_sin, int64_t rope_dim, int64_t rope_cols, int64_t m, int64_t n, int64_t k,
                   int num_threads);
int radixrt_linear_vec(int kernel, const bf16 *x, int64_t x_stride, const bf16 *packed, const bf16 *bias,
                       void *y, int64_t y_stride, int y_f32, int gated, const int64_t *positions,
                       const float *rope_cos, const float *rope_sin, int64_t rope_dim, int64_t rope_cols,
                       int64_t m, int64_t n, int64_t k, int num_threads);
int radixrt_linear_available(void);
int radixrt_linear_vec_available(int kernel);

/* One call's grouping and buffers. kernels: the gate_up weights' kernel for an expert of up to
 * `threshold` rows, above, then the down weights' two. */
struct moe {
    int64_t t, k, e, h, i, threshold;
    const bf16 *const *gate_up, *const *down; /* [e] packed weights */
    const int *kernels;
    int64_t *count, *start; /* [e]: an expert's rows, and its first row in xs, hs and ys */
    int64_t *slot;          /* [t·k]: pair p's row */
    bf16 *xs, *hs, *ys;
};

/* 1 if every kernel named runs here. */
static int kernels_run(const int *kernels) {
    for (int j = 0; j < 4; j++) {
        const int kn = kernels[j];
        if (kn == KERNEL_AMX ? !radixrt_linear_available() : kn < 0 || kn > 1 || !radixrt_linear_vec_available(kn))
            return 0;
    }
    return 1;
}

/* Step 1: the pairs grouped by expert, their rows gathered; -1 for an expert id out of range. */
static int group_pairs(struct moe *c, const bf16 *x, int64_t x_stride, const int64_t *experts) {
    const int64_t pairs = c->t * c->k;
    memset(c->count, 0, (size_t)c->e * sizeof *c->count);
    for (int64_t p = 0; p < pairs; p++) {
        if (experts[p] < 0 || experts[p] >= c->e) return -1;
        c->count[experts[p]]++;
    }
    for (int64_t e = 0, at = 0; e < c->e; at += c->count[e], e++) c->start[e] = at;
    for (int64_t e = 0; e < c->e; e++) c->count[e] = 0; /* refilled as each pair takes its row */
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t e = experts[p], row = c->start[e] + c->count[e]++;
        c->slot[p] = row;
        memcpy(c->xs + row * c->h, x + p / c->k * x_stride, (size_t)c->h * 2);
    }
    return 0;
}

/* A run of units [u0, u1) of expert e's weight: gate_up (units: gate/up block pairs) or down
 * (units: blocks), on one thread. */
static int run_units(const struct moe *c, int down, int64_t e, int64_t u0, int64_t u1) {
    const int64_t rows = c->count[e], k = down ? c->i : c->h, width = down ? c->h : c->i;
    const int kernel = c->kernels[2 * down + (rows > c->threshold)];
    const bf16 *x = (down ? c->hs : c->xs) + c->start[e] * k;
    const bf16 *w = (down ? c->down[e] : c->gate_up[e]) + u0 * (down ? 1 : 2) * NB * k;
    bf16 *y = (down ? c->ys : c->hs) + c->start[e] * width + u0 * NB;
    const int64_t n = (u1 - u0) * NB * (down ? 1 : 2);
    if (kernel == KERNEL_AMX)
        return radixrt_linear(x, k, w, NULL, y, width, 0, !down, NULL, NULL, NULL, 0, 0, rows, n, k, 1);
    return radixrt_linear_vec(kernel, x, k, w, NULL, y, width, 0, !down, NULL, NULL, NULL, 0, 0, rows, n, k, 1);
}

/* Thread id's share of step 2 (down = 0) or 3: every expert's units, each weighing its passes
 * of 32 rows (a decode step: equal weights per thread), split in runs of whole units by where a
 * unit's weight starts. Returns -1 if a call refused its sizes. */
static int run_step(const struct moe *c, int down, int64_t id, int64_t threads) {
    const int64_t units = (down ? c->h : c->i) / NB;
    int64_t total = 0;
    for (int64_t e = 0; e < c->e; e++) total += units * ((c->count[e] + 31) / 32);
    const int64_t lo = total * id / threads, hi = total * (id + 1) / threads;
    int rc = 0;
    for (int64_t e = 0, at = 0; e < c->e && at < hi; e++) {
        const int64_t pass = (c->count[e] + 31) / 32; /* a unit's weight: 0 for an expert without rows */
        if (pass == 0) continue;
        /* unit j starts at at + j·pass: the units starting in [lo, hi) */
        int64_t j0 = lo > at ? (lo - at + pass - 1) / pass : 0, j1 = (hi - at + pass - 1) / pass;
        j1 = j1 < units ? j1 : units;
        if (j0 < j1) rc |= run_units(c, down, e, j0, j1);
        at += units * pass;
    }
    return rc;
}

/* 16 float32 values rounded to bf16 as PyTorch rounds them (nearest even, values below the
 * normal range kept; NaN to 0xffff). */
static inline v16h round_torch(v16 x) {
    const v16u bits = (v16u)x, nan = (v16u)(x != x);
    const v16u rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return __builtin_convertvector((rounded & ~nan) | (0xffffu & nan), v16h);
}

/* Rank r's row of token tok times its weight, 16 features from f: bf16 weights round the
 * product to bf16 (both factors bf16: the float32 product is exact), float32 ones do not. */
static inline v16 weighted(const struct moe *c, const void *weights, int weights_f32, int64_t tok, int64_t r,
                           int64_t f) {
    v16h yh;
    memcpy(&yh, c->ys + c->slot[tok * c->k + r] * c->h + f, sizeof yh);
    const v16 y = widen16(yh);
    if (weights_f32) return y * ((const float *)weights)[tok * c->k + r];
    return widen16(round_torch(y * bf16_to_f32(((const bf16 *)weights)[tok * c->k + r])));
}

/* Step 4 for tokens [t0, t1). */
static void weighted_sums(const struct moe *c, const void *weights, int weights_f32, bf16 *out, int64_t out_stride,
                          int64_t t0, int64_t t1) {
    for (int64_t tok = t0; tok < t1; tok++)
        for (int64_t f = 0; f < c->h; f += 16) {
            v16 acc = weighted(c, weights, weights_f32, tok, 0, f);
            for (int64_t r = 1; r < c->k; r++) acc += weighted(c, weights, weights_f32, tok, r, f);
            const v16h h = round_torch(acc);
            memcpy(out + tok * out_stride + f, &h, sizeof h);
        }
}

/* out [t, h] (rows out_stride apart) = the block's routed experts for x [t, h] (rows x_stride
 * apart), experts [t, k] (int64, rank order) and their weights [t, k] (float32 with weights_f32,
 * else bf16); gate_up [e]: each expert's [gate; up] weight [2i, h] packed gated, down [e]: its
 * [h, i] weight packed; kernels [4] (2: AMX, else radixrt_linear_vec's number): the gate_up
 * weights' kernel for an expert of up to `threshold` rows, above, then the down weights' two.
 * h and i multiples of 32. Returns -1 for sizes or kernels it does not take, an expert id out
 * of range or no memory for its buffers (writing nothing), or a kernel call that failed. */
int radixrt_moe(const bf16 *x, int64_t x_stride, bf16 *out, int64_t out_stride, int64_t t, int64_t k,
                const int64_t *experts, const void *weights, int weights_f32, int64_t num_experts,
                const bf16 *const *gate_up, const bf16 *const *down, int64_t h, int64_t i, const int *kernels,
                int64_t threshold, int num_threads) {
    if (t < 0 || k < 1 || num_experts < 1 || h <= 0 || i <= 0 || h % NB || i % NB || x_stride < h
        || out_stride < h || num_threads < 1 || !kernels_run(kernels))
        return -1;
    if (t == 0) return 0;
    const int64_t pairs = t * k;
    struct moe c = {t, k, num_experts, h, i, threshold, gate_up, down, kernels, NULL, NULL, NULL, NULL, NULL, NULL};
    c.count = malloc((size_t)(2 * num_experts + pairs) * sizeof(int64_t));
    c.xs = malloc((size_t)(pairs * (2 * h + i)) * 2);
    int rc = c.count == NULL || c.xs == NULL ? -1 : 0;
    if (rc == 0) {
        c.start = c.count + num_experts, c.slot = c.start + num_experts;
        c.hs = c.xs + pairs * h, c.ys = c.hs + pairs * i;
        rc = group_pairs(&c, x, x_stride, experts);
    }
    if (rc == 0) {
#pragma omp parallel num_threads(num_threads) reduction(| : rc)
        {
            const int64_t id = omp_get_thread_num(), threads = omp_get_num_threads();
            rc |= run_step(&c, 0, id, threads);
#pragma omp barrier
            rc |= run_step(&c, 1, id, threads);
#pragma omp barrier
            weighted_sums(&c, weights, weights_f32, out, out_stride, t * id / threads, t * (id + 1) / threads);
        }
    }
    free(c.count);
    free(c.xs);
    return rc;
}
