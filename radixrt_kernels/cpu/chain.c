/* A chain: several decode-sized steps (RMS norms, linears on packed or GGUF-quantized weights,
 * rotary embeddings, SiLU-and-mul, attention) in one call and one parallel region, a barrier
 * between each step and the next, instead of one call, one thread team and (from Python) one
 * wrapper per step. A step reads what the steps before it wrote; each gives the results of the
 * library call it stands for (radixrt_rms_norm, radixrt_linear_vec, radixrt_quant_linear,
 * radixrt_rope, radixrt_silu_mul, radixrt_attention) bit for bit, since it runs the same
 * per-thread parts (parts.h, quant.h).
 *
 * The steps come as rows of int64 (struct step, pointers as addresses), so a caller can keep
 * a chain's table and run it again on every decode step whose buffers it names.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "parts.h"
#include "quant.h"

#define STEP_LINEAR 1
#define STEP_NORM 2
#define STEP_ROPE 3
#define STEP_ATTENTION 4
#define STEP_QUANT 5
#define STEP_SILU_MUL 6
#define STEP_FIELDS 21
#define ATTENTION_FIELDS 31

/* One step (every field 8 bytes: a row of the caller's int64 table).
 * STEP_LINEAR: y = x · Wᵀ (+ bias) by linear_vec.c's `kernel` on W packed as radixrt_linear
 *   takes it (w), with radixrt_linear_vec's meaning of every other field; bf16.
 * STEP_NORM: y = weight · norm(x (+ residual)) for m rows of n features as radixrt_rms_norm
 *   computes it (w: the weight; residual: NULL or the contiguous residual, which receives the
 *   sum; y rows y_stride apart), bf16, with eps; k > 1: each of the k heads of n values of a
 *   row, as radixrt_rms_norm_heads (no residual; y may be x).
 * STEP_ROPE: the rotary embedding of m rows of n heads of k values at x (rows x_stride apart),
 *   in place, as radixrt_rope rotates them (positions, rope_cos, rope_sin), bf16.
 * STEP_ATTENTION: radixrt_attention on the KV buffers y (keys) and residual (values) with the
 *   rest of its arguments at w (struct attention_args: the layers of a decode step share them,
 *   each with its own buffers).
 * STEP_QUANT: y = x · Wᵀ (+ bias) as radixrt_quant_linear computes it on `path` (-1: the path
 *   it chooses), for W [n, k] of GGUF type `kernel` packed by radixrt_quant_pack (w); x bf16
 *   (rows x_stride apart), y float32 where y_f32 else bf16 (rows y_stride apart), bias NULL or
 *   [n], bf16 where `gated` else float32.
 * STEP_SILU_MUL: y [m, n] = silu(x[:, :n]) · x[:, n:] for x [m, 2n], as radixrt_silu_mul
 *   computes it (both contiguous, bf16). */
struct step {
    int64_t kind, kernel;
    const bf16 *x;
    int64_t x_stride;
    const bf16 *w, *bias;
    void *y;
    int64_t y_stride, y_f32, gated;
    const int64_t *positions;
    const float *rope_cos, *rope_sin;
    int64_t rope_dim, rope_cols, m, n, k;
    void *residual;
    double eps;
    int64_t path;
};
_Static_assert(sizeof(struct step) == STEP_FIELDS * 8, "a step is a row of STEP_FIELDS int64");

_Static_assert(sizeof(struct attention_args) == ATTENTION_FIELDS * 8, "attention args are int64");

/* What a step's parts need, derived once per run (where the step needs anything). */
union prepared {
    struct attn_call attn;
    struct qcall quant;
};

static struct attn_call attn_call_of(const struct step *s) {
    return (struct attn_call){.a = *(const struct attention_args *)s->w, .k_buf = s->y, .v_buf = s->residual};
}

/* A norm step's heads per row (k; 0 counts as 1). */
static inline int64_t heads_of(const struct step *s) {
    return s->k > 1 ? s->k : 1;
}

static struct vec_call vec_call_of(const struct step *s) {
    return (struct vec_call){(int)s->kernel, s->x,       s->x_stride, s->w,        s->bias,
                             s->y,           s->y_stride, (int)s->y_f32, (int)s->gated, s->positions,
                             s->rope_cos,    s->rope_sin, s->rope_dim, s->rope_cols, s->m,
                             s->n,           s->k};
}

/* The number of int64 a step takes (the caller's table has rows of this many). */
int radixrt_chain_fields(void) {
    return STEP_FIELDS;
}

/* The number of int64 an attention step's arguments take. */
int radixrt_chain_attention_fields(void) {
    return ATTENTION_FIELDS;
}

static struct qcall quant_call_of(const struct step *s) {
    return (struct qcall){.x = s->x, .x_stride = s->x_stride, .x_bf16 = 1, .packed = (const uint8_t *)s->w,
                          .bias = s->bias, .bias_bf16 = (int)s->gated, .y = s->y, .y_stride = s->y_stride,
                          .y_bf16 = !s->y_f32, .m = s->m, .n = s->n, .k = s->k};
}

/* 1 if a step fits the kernels (an attention or quantized step's call prepared into *p), else 0. */
static int step_fits(const struct step *s, union prepared *p) {
    switch (s->kind) {
    case STEP_QUANT:
        p->quant = quant_call_of(s);
        return radixrt_quant_setup(&p->quant, (int)s->kernel, (int)s->path) == 0;
    case STEP_SILU_MUL:
        return s->m >= 0 && s->n > 0;
    case STEP_LINEAR: {
        const struct vec_call c = vec_call_of(s);
        return s->m >= 0 && radixrt_vec_check(&c) == 0;
    }
    case STEP_ROPE:
        return s->m >= 0 && s->x_stride >= s->n * s->k
            && radixrt_rope_rows((void *)s->x, s->x_stride, 0, 0, s->n, s->k, NULL, NULL, NULL, 1) == 0;
    case STEP_ATTENTION:
        p->attn = attn_call_of(s);
        return radixrt_attn_prepare(&p->attn) == 0;
    case STEP_NORM:
        return s->m >= 0 && s->n > 0 && s->x_stride >= s->n * heads_of(s) && s->y_stride >= s->n * heads_of(s)
            && radixrt_norm_rows(s->x, s->x_stride, s->residual, s->y, s->y_stride, s->w, heads_of(s), 0, 0, s->n,
                                 0.0f, 1) == 0;
    default:
        return 0;
    }
}

/* Thread id's part of a quantized step (x quantized by the threads together, then the items). */
static void run_quant(const struct qcall *c, int64_t id, int64_t threads) {
    radixrt_quant_x_part(c, id, threads);
#pragma omp barrier
    radixrt_quant_items_part(c, id, threads);
}

/* Thread id's rows of a SiLU-and-mul step. */
static void run_silu_mul(const struct step *s, int64_t id, int64_t threads) {
    radixrt_silu_mul_rows(s->x, s->y, s->m * id / threads, s->m * (id + 1) / threads, s->n, 1);
}

/* Thread id's part of step s (p, next: its prepared call and an attention step's work counters;
 * xf: room for x widened, for an FMA step). The barriers inside bind to the chain's region. */
static void run_step(const struct step *s, const union prepared *p, int64_t *next, float *xf, int64_t id,
                     int64_t threads) {
    if (s->kind == STEP_QUANT) {
        run_quant(&p->quant, id, threads);
    } else if (s->kind == STEP_SILU_MUL) {
        run_silu_mul(s, id, threads);
    } else if (s->kind == STEP_NORM) {
        const int64_t rows = s->m * heads_of(s);
        radixrt_norm_rows(s->x, s->x_stride, s->residual, s->y, s->y_stride, s->w, heads_of(s),
                          rows * id / threads, rows * (id + 1) / threads, s->n, (float)s->eps, 1);
    } else if (s->kind == STEP_ROPE) {
        radixrt_rope_rows((void *)s->x, s->x_stride, s->m * id / threads, s->m * (id + 1) / threads, s->n, s->k,
                          s->positions, s->rope_cos, s->rope_sin, 1);
    } else if (s->kind == STEP_ATTENTION) {
        const struct attn_call *call = &p->attn;
        radixrt_attn_store(call, id, threads);
#pragma omp barrier
        radixrt_attn_items(call, &next[0], 0);
        if (call->phases == 2) {
#pragma omp barrier
            radixrt_attn_items(call, &next[1], 1);
        }
        if (call->merging) {
#pragma omp barrier
            radixrt_attn_merge(call, id, threads);
        }
    } else {
        const struct vec_call c = vec_call_of(s);
        if (c.kernel == KERNEL_FMA) { /* x widened by the threads together, split by features */
            radixrt_vec_widen(&c, xf, 0, c.m, c.k * id / threads, c.k * (id + 1) / threads);
#pragma omp barrier
        }
        radixrt_vec_part(&c, xf, id, threads);
    }
}

/* The scratch bytes step s needs (x widened for an FMA step, x quantized for a quantized one). */
static int64_t scratch_of(const struct step *s) {
    if (s->kind == STEP_LINEAR && s->kernel == KERNEL_FMA) return s->m * s->k * 4;
    if (s->kind == STEP_QUANT) return radixrt_quant_scratch_bytes(s->m, s->k);
    return 0;
}

/* Checks and prepares every step into p[]; returns 0 with *scratch the bytes the largest step
 * needs, or -(1 + i) when step i does not fit. */
static int prepare_steps(const struct step *steps, int64_t count, union prepared *p, int64_t *scratch) {
    *scratch = 0;
    for (int64_t i = 0; i < count; i++) {
        if (!step_fits(&steps[i], &p[i])) return (int)-(1 + i);
        if (scratch_of(&steps[i]) > *scratch) *scratch = scratch_of(&steps[i]);
    }
    return 0;
}

/* Runs steps[0 .. count - 1] in order on num_threads threads. Returns 0, or -(1 + i) when step
 * i does not fit (checked before anything runs: nothing is written then). */
int radixrt_chain(const struct step *steps, int64_t count, int num_threads) {
    if (count < 0 || num_threads < 1) return -1;
    union prepared *p = calloc((size_t)count + 1, sizeof *p);
    int64_t *next = calloc(2 * ((size_t)count + 1), sizeof *next); /* each attention's work counters */
    int64_t scratch = 0;
    int rc = p == NULL || next == NULL ? -1 : prepare_steps(steps, count, p, &scratch);
    void *buf = NULL; /* one scratch buffer: the steps run one after another */
    if (rc == 0 && scratch > 0 && (buf = aligned_alloc(64, (size_t)((scratch + 63) / 64 * 64))) == NULL) rc = -1;
    for (int64_t i = 0; rc == 0 && i < count; i++)
        if (steps[i].kind == STEP_QUANT) radixrt_quant_scratch(&p[i].quant, buf);
    if (rc == 0) {
#pragma omp parallel num_threads(num_threads)
        {
            const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
            for (int64_t i = 0; i < count; i++) {
                if (i > 0) {
#pragma omp barrier
                }
                run_step(&steps[i], &p[i], &next[2 * i], buf, id, threads);
            }
        }
    }
    free(buf);
    free(p);
    free(next);
    return rc;
}
