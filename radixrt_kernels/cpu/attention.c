/* Attention on the CPU over K/V read through slot indices (decode and extend),
 * cascade-aware.
 *
 * The query tokens are the rows of q. Their keys are split into segments: a
 * segment is a list of slots and the query tokens (its members) that attend to
 * it. In decode (one token per request) a prefix shared through the radix cache
 * is one segment for all its requests and each request's private tail is a
 * segment of its own. A token attends to at most two segments (part 0 and part
 * 1); their results are merged by their log-sum-exps at the end, so a shared
 * prefix is read once for all the requests that share it, straight from the KV
 * buffers, with no gathered copy. A token with one part is written out by its
 * work item directly.
 *
 * A causal segment (extend: a request's whole sequence, its new tokens the
 * members) ends with its members' own keys, in order: member i of n sees the
 * keys [0, n_keys - n + i + 1).
 *
 * Layout: q and out [T, H, D]; k_buf and v_buf [N, KH, D] (row = slot); all
 * contiguous, float32 or bfloat16 (the same dtype for all). The H query heads
 * of KV head j are heads j*G .. j*G+G-1 (G = H / KH), as in PyTorch's GQA.
 * Accumulation is float32 with an online softmax (flash decoding).
 *
 * The step's new K/V rows are written into their slots first (one call per
 * layer stores and attends).
 *
 * Work items are (segment, KV head, block of at most QB query rows, AMX_QB where AMX runs
 * the items, DOTS_QB where AVX512-BF16 dot products do; in a causal
 * segment the last block, the one with the most keys, first); threads
 * of the caller's OpenMP runtime take them, KH at a time, from a shared counter (PyTorch's
 * libgomp: the library is linked against it, so no second thread pool runs).
 * Per item, by what the CPU has (the build is -march=native):
 * - attend_item_amx: bf16, items of >= AMX_MIN_ROWS query rows (a shared
 *   prefix, an extend), with AMX tile products;
 * - attend_item_bf16: the other bf16 items where the caller asks for dot
 *   products (bf16_dots) and the build has AVX512-BF16, with vdpbf16ps and the
 *   keys as vector lanes (a private tail has only G query rows);
 * - attend_item: float32, and bf16 otherwise (converted to float32),
 *   query rows as vector lanes, written with GCC vector extensions.
 * Which of the last two runs bf16 faster depends on the CPU (vdpbf16ps has
 * half FMA's throughput on some, twice its flops on others): the caller
 * measures and says (radixrt.model.calibrate).
 *
 * Exact mode (the call's `exact`): a query row's output has the same bits whatever
 * the other rows of the call, however its keys are split between a shared prefix
 * and a private tail, and in decode as in extend. Per row every path's arithmetic
 * depends only on that row's query and keys; a row reduces its keys in blocks at
 * fixed offsets from key 0 of its sequence (AKB keys per softmax step for AMX, KB
 * otherwise), in order; a key a row does not see (past its causal limit, or a
 * block's padding past the segment's last key) has the score -inf, so its
 * probability exp(-inf) = 0 and, where a block holds none of the row's keys, the
 * factor exp(m - m) = 1 leave the row's state as it was (sums gain exact zeros).
 * So in exact mode:
 * - every item of a call runs one path: AMX for every bf16 item where the CPU
 *   has it (any row count), else the bf16_dots choice; float32 on attend_item;
 * - a token's two parts are not merged: its part-0 segment (a shared prefix, a
 *   multiple of the path's step long, else the call is refused) runs first and
 *   leaves the unnormalised state (acc, m, l) in the part buffers; its part-1
 *   segment then starts from that state (a second phase of items) and writes the
 *   output. The caller's segments have no split of a lone request
 *   (radixrt_decode_segments with exact).
 *
 * A sliding window (the call's `window` W > 0): a token at position p (positions[token], the
 * index of its own key in its sequence) sees only the keys at positions p - W + 1 .. p; a
 * segment's key i is at position seg_key_start[s] + i. A row's first visible key of a
 * segment is its `from`; an item reads no key before the least `from` of its rows (those
 * keys' slots may hold anything: keys a window dropped), so its key loop starts at the
 * block (of the path's step, from the segment's key 0) that holds it, and a row's keys
 * before its own `from` score -inf like keys past its limit. A block that holds none of a
 * row's keys leaves the row's state (acc, m, l) as it was, also before the row's first key
 * (an all -inf block's maximum counts as 0: probabilities e^-inf = 0, factor 0 on a zero
 * state), so a row's bits do not depend on where its item's loop starts. In exact mode a
 * two-part token's part 1 starts on a multiple of the step, so every row's blocks stay
 * aligned from key 0 of its sequence. A layer's cost follows W, not the sequence.
 *
 * Logit soft-capping (the call's `softcap` c > 0): a score s (after scaling) becomes
 * c·tanh(s / c) before the masks and the softmax (soft_cap).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "parts.h"
#if defined(__AVX__)
#include <immintrin.h>
#endif

#define QB 32     /* query rows per work item ... */
#define AMX_QB 64 /* ... where AMX runs the items (more rows share each block's key and value layouts) */
#define DOTS_QB 96 /* ... and where AVX512-BF16 dot products run them (the same reason) */
#define KB 32 /* keys per block */
#define DMAX 256
#define AMX_MIN_ROWS 8 /* items with fewer query rows (a private tail) stay on AVX-512 */
#define AKB (2 * KB)   /* keys per softmax step in the AMX path */
/* K/V lines are fetched ahead into L2, not L1: L1 has few miss buffers, so fetching a block's
 * scattered lines into it leaves most of them waiting on memory; L2 keeps many more in flight. */
#define PREFETCH_LOCALITY 2
#define AHEAD 2 /* blocks of keys a work item fetches ahead of the one it computes */
#define EXACT_STEP AKB /* exact mode: a shared prefix is a multiple of this many keys (every path's step) */

#define RB 4  /* query rows computed together (independent accumulator chains) ... */
#define RB_WIDE 8 /* ... in the dot-product path's items of more than RB rows */
#define DC (2 * VL) /* head dims per accumulator chunk in P·V (two vectors) */
#define QV (QB / VL)  /* vectors holding an item's query rows as lanes (the float32 path) */

/* Row `row` (D values) of a buffer as float32. */
static inline void load_row(const void *buf, int64_t row, int64_t d, int is_bf16, float *dst) {
    if (is_bf16) {
        const bf16 *src = (const bf16 *)buf + row * d;
        for (int64_t i = 0; i < d; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)buf + row * d, (size_t)d * sizeof(float));
    }
}

static inline vf vbcast(float x) { /* x in every lane */
#if defined(__AVX512F__)
    return (vf)_mm512_set1_ps(x);
#elif VL == 8
    return (vf)_mm256_set1_ps(x);
#else
    return (vf){x, x, x, x};
#endif
}

/* a·b + c, fused where the build has FMA, whatever the compiler would choose: a score's chain
 * must round the same way in every loop of scores() (decode and extend items reach different
 * ones), and a compiler free to fuse may fuse the same expression in one loop and not in the
 * next. */
static inline vf vfma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__) && VL == 8
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

/* Scores of keys [0, nk) of the block for nv·VL query rows: st[t][lanes] = Σ_i qt[i][lanes]·kf[t][i].
 * ks keys at a time, so ks·nv accumulator chains run side by side (4·nv with AVX-512's 16
 * lanes; 8 with narrower vectors, which have fewer registers). */
static inline __attribute__((always_inline)) void scores(const int nv, const vf (*qt)[QV],
                                                         const float (*kf)[DMAX], int64_t nk, int64_t d,
                                                         vf (*st)[QV]) {
    const int ks = VL == 16 ? 4 : nv >= 8 ? 1 : 8 / nv;
    int64_t t = 0;
    for (; t + ks <= nk; t += ks) {
        vf a[8][QV];
        for (int u = 0; u < ks; u++)
            for (int v = 0; v < nv; v++) a[u][v] = (vf){0};
#pragma GCC unroll 4
        for (int64_t i = 0; i < d; i++) {
            for (int v = 0; v < nv; v++) {
                const vf qv = qt[i][v];
                for (int u = 0; u < ks; u++) a[u][v] = vfma(qv, vbcast(kf[t + u][i]), a[u][v]);
            }
        }
        for (int u = 0; u < ks; u++)
            for (int v = 0; v < nv; v++) st[t + u][v] = a[u][v];
    }
    for (; t < nk; t++) {
        vf a[QV];
        for (int v = 0; v < nv; v++) a[v] = (vf){0};
        for (int64_t i = 0; i < d; i++)
            for (int v = 0; v < nv; v++) a[v] = vfma(qt[i][v], vbcast(kf[t][i]), a[v]);
        for (int v = 0; v < nv; v++) st[t][v] = a[v];
    }
}

/* acc[r] = acc[r]·alpha[r] + Σ_t p[t][r]·v[t] for rows [0, rows) (a multiple of RB), with p
 * key-major as the scores are (32 row lanes per key): per chunk of DC dims, RB rows at a time
 * (2·RB vector chains). */
static inline void pv_update(float (*acc)[DMAX], const float (*p)[32], const float *alpha,
                             const float (*v)[DMAX], int64_t nk, int64_t d, int64_t rows) {
    for (int64_t r0 = 0; r0 < rows; r0 += RB) {
        for (int64_t c = 0; c < d; c += DC) {
            vf a[RB][2];
            for (int rr = 0; rr < RB; rr++) {
                const float scale = alpha[r0 + rr];
                a[rr][0] = *(vf *)&acc[r0 + rr][c] * scale;
                a[rr][1] = *(vf *)&acc[r0 + rr][c + VL] * scale;
            }
#pragma GCC unroll 4
            for (int64_t t = 0; t < nk; t++) {
                const vf va = *(const vf *)&v[t][c], vc = *(const vf *)&v[t][c + VL];
                for (int rr = 0; rr < RB; rr++) {
                    const float w = p[t][r0 + rr];
                    a[rr][0] += w * va;
                    a[rr][1] += w * vc;
                }
            }
            for (int rr = 0; rr < RB; rr++) {
                *(vf *)&acc[r0 + rr][c] = a[rr][0];
                *(vf *)&acc[r0 + rr][c + VL] = a[rr][1];
            }
        }
    }
}

/* What every work item of a call shares. */
struct call {
    const void *q, *k_buf, *v_buf;
    void *out;
    int is_bf16;
    int64_t h, kh, g, d;
    int64_t q_rows;  /* rows of D values from one token of q to the next (H when contiguous) */
    float scaling;
    const int64_t *num_parts;          /* [T] */
    float *part_acc, *part_m, *part_l; /* [T, 2, H, D], [T, 2, H], [T, 2, H] */
    int exact;                         /* part 1 continues part 0's state (see the header) */
    int64_t window;                    /* 0, or a sliding window of this many keys (the header) */
    const int64_t *positions;          /* [T] with a window: each token's own key's position */
    float softcap;                     /* 0, or the scores' soft cap */
};

/* A work item: rows [q0, q0 + nq) (nq <= QB, AMX_QB for AMX, DOTS_QB for dot products) of a segment's queries on KV head j. Query row r
 * is member r / G of the segment, head j*G + r % G. */
struct item {
    const int64_t *slots, *members;
    int64_t n_keys;      /* keys read: the segment's, in a causal segment up to the last row's limit */
    int64_t causal_from; /* -1, or (causal) row r sees the keys [0, causal_from + (q0 + r) / G + 1) */
    int64_t part, j, q0, nq;
    int64_t key_start; /* the position of the segment's key 0 in its members' sequences */
    int64_t k_from;    /* the least first visible key of the item's rows: no key before it is read */
};

/* The number of keys row r of the item sees (rows past nq: as row nq - 1). */
static inline int64_t row_limit(const struct item *it, int64_t g, int64_t r) {
    if (it->causal_from < 0) return it->n_keys;
    return it->causal_from + (it->q0 + (r < it->nq ? r : it->nq - 1)) / g + 1;
}

/* The first key of the segment row r of the item sees (rows past nq: as row nq - 1): 0, or
 * under a window the one at its token's position - W + 1 (at most n_keys: then none). */
static inline int64_t row_from(const struct call *c, const struct item *it, int64_t r) {
    if (c->window <= 0) return 0;
    const int64_t token = it->members[(it->q0 + (r < it->nq ? r : it->nq - 1)) / c->g];
    const int64_t from = c->positions[token] - c->window + 1 - it->key_start;
    return from < 0 ? 0 : from < it->n_keys ? from : it->n_keys;
}

/* from[r] = row_from of rows [0, rows) of the item (rows past nq: padding); returns the
 * largest. */
static inline int64_t row_froms(const struct call *c, const struct item *it, int64_t rows, int64_t *from) {
    int64_t last = 0;
    for (int64_t r = 0; r < rows; r++) {
        from[r] = row_from(c, it, r);
        last = from[r] > last ? from[r] : last;
    }
    return last;
}

/* Where an item's key loop starts: the block of `step` keys (from the segment's key 0) that
 * holds its first visible key (n_keys when it sees none). */
static inline int64_t first_block(const struct item *it, int64_t step) {
    return it->k_from >= it->n_keys ? it->n_keys : it->k_from / step * step;
}

/* -inf on the scores of a block's keys before `from` or at or past `left` (both relative to
 * the block; s0: keys 0-15, s1: 16-31). */
static inline void mask_outside(v16 *s0, v16 *s1, int64_t from, int64_t left) {
    if (from <= 0 && left >= KB) return;
    const v16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16 lf = (v16){0} + (float)(left < KB ? left : KB), ff = (v16){0} + (float)(from > 0 ? from : 0);
    const v16 ninf = (v16){0} - INFINITY;
    *s0 = vselect((iota < lf) & (iota >= ff), *s0, ninf);
    *s1 = vselect((iota + 16.0f < lf) & (iota + 16.0f >= ff), *s1, ninf);
}

/* Logit soft-capping: c·tanh(s / c) per lane. tanh(y) for |y| < 1/4 by its odd Taylor
 * polynomial to y^11 (relative error < 1e-9 there), else as 1 - 2 / (e^(2|y|) + 1), with y's
 * sign (vexpf saturates: ±1 for large |y|; NaN stays NaN). */
static inline vf soft_cap(vf s, float c) {
    const vf y = s / c, a = vsel(y < 0.0f, -y, y), a2 = a * a;
    vf poly = (vf){0} - 1382.0f / 155925;
    poly = poly * a2 + 62.0f / 2835;
    poly = poly * a2 - 17.0f / 315;
    poly = poly * a2 + 2.0f / 15;
    poly = poly * a2 - 1.0f / 3;
    poly = (poly * a2 + 1.0f) * a;
    const vf far = 1.0f - 2.0f / (vexpf(a + a) + 1.0f);
    const vf t = vsel(a < 0.25f, poly, far);
    return c * vsel(y < 0.0f, -t, t);
}

/* An online-softmax step's reference maximum: mx, or 0 where mx is -inf (a row that has seen
 * no key yet: its probabilities e^-inf = 0 and its factor e^(-inf - 0) = 0 keep its zero
 * state). */
static inline vf max_ref(vf mx) {
    return vsel(mx == -INFINITY, (vf){0}, mx);
}

/* Output row `row` of [T·H, D] = a·inv, in the call's dtype (D a multiple of VL). */
static inline void store_out(const struct call *c, int64_t row, const float *a, float inv) {
    const size_t elem = c->is_bf16 ? 2 : 4;
    char *dst = (char *)c->out + row * c->d * elem;
    for (int64_t i = 0; i < c->d; i += VL) {
        vf v;
        memcpy(&v, a + i, sizeof v);
        vstore(dst + i * elem, v * inv, c->is_bf16);
    }
}

/* The row of [T·H] (token·H + head) of query row r of an item; its token into *token. */
static inline int64_t row_of(const struct call *c, const struct item *it, int64_t r, int64_t *token) {
    *token = it->members[(it->q0 + r) / c->g];
    return *token * c->h + it->j * c->g + (it->q0 + r) % c->g;
}

/* Rows [0, nq) of an item's state (acc, m, l): a token with one part, and in exact mode a
 * token's part 1, is written out normalised; otherwise its part goes into the partial buffers
 * (merged at the end, or in exact mode continued by its part 1). */
static inline void write_rows(const struct call *c, const struct item *it, const float *acc,
                              int64_t acc_stride, const float *m, const float *l) {
    for (int64_t r = 0; r < it->nq; r++) {
        int64_t b;
        const int64_t row = row_of(c, it, r, &b);
        if (c->num_parts[b] == 1 || (c->exact && it->part == 1)) {
            store_out(c, row, acc + r * acc_stride, l[r] > 0.0f ? 1.0f / l[r] : 0.0f);
            continue;
        }
        const int64_t at = row + (b + it->part) * c->h; /* (b * 2 + part) * H + head */
        memcpy(c->part_acc + at * c->d, acc + r * acc_stride, (size_t)c->d * sizeof(float));
        c->part_m[at] = m[r];
        c->part_l[at] = l[r];
    }
}

/* Where dim i of a row lies in the AVX512-BF16 and AMX paths' accumulators (each 32-dim chunk
 * as [lo | hi], lo lane 4L+e = dim 8L+e, hi lane 4L+e = dim 8L+4+e: see unpermute). */
static inline int64_t permuted_dim(int64_t i) {
    const int64_t e = i & 31;
    return (i & ~(int64_t)31) + (e & 4 ? 16 : 0) + 4 * (e >> 3) + (e & 3);
}

/* An exact call's part-1 item starts where its tokens' part 0 left off: rows [0, nq) of acc
 * (rows acc_stride apart; permuted: laid out as permuted_dim says), m and l from the part
 * buffers. Other items keep the empty state they were given. */
static inline void seed_rows(const struct call *c, const struct item *it, float *acc, int64_t acc_stride,
                             int permuted, float *m, float *l) {
    if (!c->exact || it->part != 1) return;
    for (int64_t r = 0; r < it->nq; r++) {
        int64_t b;
        const int64_t row = row_of(c, it, r, &b), at = row + b * c->h; /* (b * 2 + 0) * H + head */
        const float *src = c->part_acc + at * c->d;
        for (int64_t i = 0; i < c->d; i++) acc[r * acc_stride + (permuted ? permuted_dim(i) : i)] = src[i];
        m[r] = c->part_m[at];
        l[r] = c->part_l[at];
    }
}

/* Per lane (a query row): the largest of m and the scores st[0 .. nk)[v], NaN scores passed
 * over. Four independent chains: a maximum is the same value in any order (a +0 and a -0 may
 * trade places, which no exp(s - max) or later state tells apart). */
static inline vf block_max(const vf (*st)[QV], int v, int64_t nk, vf m) {
    vf mq[4] = {m, m, m, m};
    int64_t t = 0;
    for (; t + 4 <= nk; t += 4)
        for (int u = 0; u < 4; u++) mq[u] = vsel(st[t + u][v] > mq[u], st[t + u][v], mq[u]);
    for (; t < nk; t++) mq[0] = vsel(st[t][v] > mq[0], st[t][v], mq[0]);
    const vf a = vsel(mq[1] > mq[0], mq[1], mq[0]), b = vsel(mq[3] > mq[2], mq[3], mq[2]);
    return vsel(b > a, b, a);
}

/* Fetch the K/V rows (of KV head j, row_bytes each) of keys from .. from + count - 1 ahead:
 * into L2 (PREFETCH_LOCALITY), or with into_l1 into L1 (the AMX path's items). */
static inline __attribute__((always_inline)) void prefetch_rows(const void *k_buf, const void *v_buf,
                                                                const int64_t *slots, int64_t from, int64_t count,
                                                                int64_t n_keys, int64_t kh, int64_t j,
                                                                int64_t row_bytes, const int into_l1) {
    for (int64_t t = from; t < n_keys && t < from + count; t++) {
        const char *k = (const char *)k_buf + (slots[t] * kh + j) * row_bytes;
        const char *v = (const char *)v_buf + (slots[t] * kh + j) * row_bytes;
        for (int64_t byte = 0; byte < row_bytes; byte += 64) {
            if (into_l1) {
                __builtin_prefetch(k + byte);
                __builtin_prefetch(v + byte);
            } else {
                __builtin_prefetch(k + byte, 0, PREFETCH_LOCALITY);
                __builtin_prefetch(v + byte, 0, PREFETCH_LOCALITY);
            }
        }
    }
}

/* A work item with the item's query rows as the vector lanes of the scores (q transposed once
 * per item, so keys need no transposing), float32 math. */
static void attend_item(const struct call *c, const struct item *it) {
    const void *q = c->q, *k_buf = c->k_buf, *v_buf = c->v_buf;
    const int is_bf16 = c->is_bf16;
    const int64_t h = c->h, kh = c->kh, d = c->d, g = c->g, j = it->j, q0 = it->q0, nq = it->nq;
    const int64_t n_keys = it->n_keys, *slots = it->slots, *members = it->members;
    const float scaling = c->scaling;
    const int nv = (int)((nq + VL - 1) / VL);
    vf qt[DMAX][QV];                                /* q transposed: qt[dim][rows], scaled */
    float acc[QB][DMAX] __attribute__((aligned(64)));
    float kf[KB][DMAX] __attribute__((aligned(64))); /* the block's keys, float32 */
    float vals[KB][DMAX] __attribute__((aligned(64))); /* its values */
    vf st[KB][QV];                                  /* scores, then probabilities: [key][rows] */
    vf m[QV], l[QV];
    float row[DMAX] __attribute__((aligned(64)));
    vf lim[QV], lo[QV]; /* each row's number of keys, and its first key */
    int64_t from[QB];

    const int64_t last_from = row_froms(c, it, QB, from); /* blocks before it need masking ... */
    for (int64_t r = 0; r < QB; r++) {
        lim[r / VL][r % VL] = (float)row_limit(it, g, r);
        lo[r / VL][r % VL] = (float)from[r];
    }
    const int64_t first_limit = row_limit(it, g, 0); /* ... and blocks past this */
    for (int64_t i = 0; i < d; i++)
        for (int v = 0; v < QV; v++) qt[i][v] = (vf){0};
    for (int64_t r = 0; r < nq; r++) {
        const int64_t b = members[(q0 + r) / g], head = j * g + (q0 + r) % g;
        load_row(q, b * c->q_rows + head, d, is_bf16, row);
        for (int64_t i = 0; i < d; i++) qt[i][r / VL][r % VL] = row[i] * scaling;
    }
    for (int64_t r = 0; r < QB; r++)
        for (int64_t i = 0; i < d; i++) acc[r][i] = 0.0f;
    for (int v = 0; v < QV; v++) {
        m[v] = (vf){0} - INFINITY;
        l[v] = (vf){0};
    }
    seed_rows(c, it, &acc[0][0], DMAX, 0, (float *)m, (float *)l);
    const int64_t rb_end = (nq + RB - 1) / RB * RB;
    const int64_t row_bytes = d * (is_bf16 ? 2 : 4);
    prefetch_rows(k_buf, v_buf, slots, first_block(it, KB), AHEAD * KB, n_keys, kh, j, row_bytes, 0);
    for (int64_t k0 = first_block(it, KB); k0 < n_keys; k0 += KB) {
        const int64_t nk = n_keys - k0 < KB ? n_keys - k0 : KB;
        prefetch_rows(k_buf, v_buf, slots, k0 + AHEAD * KB, KB, n_keys, kh, j, row_bytes, 0);
        for (int64_t t = 0; t < nk; t++) {
            if (k0 + t < it->k_from) { /* seen by none of the rows: not read */
                memset(kf[t], 0, (size_t)d * sizeof(float));
                memset(vals[t], 0, (size_t)d * sizeof(float));
                continue;
            }
            const int64_t kv_row = slots[k0 + t] * kh + j;
            load_row(k_buf, kv_row, d, is_bf16, kf[t]);
            load_row(v_buf, kv_row, d, is_bf16, vals[t]);
        }
        switch (nv) { /* a constant row-vector count per instance, so the chains stay in registers */
        case 1: scores(1, qt, kf, nk, d, st); break;
        case 2: scores(2, qt, kf, nk, d, st); break;
#if QV > 2
        case 3: scores(3, qt, kf, nk, d, st); break;
        case 4: scores(4, qt, kf, nk, d, st); break;
#endif
#if QV > 4
        default: scores(QV, qt, kf, nk, d, st); break;
#endif
        }
        if (c->softcap > 0.0f)
            for (int64_t t = 0; t < nk; t++)
                for (int v = 0; v < nv; v++) st[t][v] = soft_cap(st[t][v], c->softcap);
        if (k0 + nk > first_limit || k0 < last_from) { /* -inf on the keys outside each row's */
            for (int64_t t = 0; t < nk; t++) {
                const float key = (float)(k0 + t);
                for (int v = 0; v < nv; v++)
                    st[t][v] = vsel((lim[v] > key) & (lo[v] <= key), st[t][v], (vf){0} - INFINITY);
            }
        }
        /* online softmax, lane by lane (a lane is a query row) */
        vf alpha[QV];
        for (int v = 0; v < nv; v++) {
            const vf mx = block_max(st, v, nk, m[v]), ref = max_ref(mx);
            alpha[v] = vexpf(m[v] - ref); /* 0 on a row's first block (m = -inf) */
            vf sum = {0};
            for (int64_t t = 0; t < nk; t++) {
                st[t][v] = vexpf(st[t][v] - ref);
                sum += st[t][v];
            }
            m[v] = mx;
            l[v] = l[v] * alpha[v] + sum;
        }
        pv_update(acc, (const float (*)[32])st, (const float *)alpha, vals, nk, d, rb_end);
    }
    write_rows(c, it, &acc[0][0], DMAX, (const float *)m, (const float *)l);
}

#ifdef __AVX512BF16__
/* The cache lines of the bf16 K/V rows (of head j) of keys from .. from + count - 1 (scattered
 * slots, which no hardware prefetcher follows) into lines; returns how many (at most count·D/16). */
static inline int64_t key_lines(const bf16 *k_buf, const void *v_buf, const int64_t *slots, int64_t from,
                                int64_t count, int64_t n_keys, int64_t kh, int64_t j, int64_t d,
                                const char **lines) {
    int64_t n = 0;
    for (int64_t t = from; t < n_keys && t < from + count; t++) {
        const int64_t off = (slots[t] * kh + j) * d;
        for (int64_t byte = 0; byte < d * 2; byte += 64) {
            lines[n++] = (const char *)(k_buf + off) + byte;
            lines[n++] = (const char *)v_buf + off * 2 + byte;
        }
    }
    return n;
}

/* Transpose a 16 × 16 matrix of 32-bit elements held as 16 rows. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int a = 0; a < 4; a++) { /* u[4a + e], lane L: rows 4a .. 4a+3 of column 4L + e */
        u[4 * a] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
        u[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
        u[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
        u[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
    }
    for (int e = 0; e < 4; e++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44);
        const __m512i v1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
        const __m512i w0 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44);
        const __m512i w1 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
        r[e] = _mm512_shuffle_i32x4(v0, w0, 0x88);
        r[4 + e] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
        r[8 + e] = _mm512_shuffle_i32x4(v1, w1, 0x88);
        r[12 + e] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
    }
}

/* A block's keys (nk <= KB) transposed as dim pairs: kt[c][half] lane t holds dims 2c, 2c+1
 * of key half·16 + t (0 before key `skip`, which are not read, and past the last key). */
static inline void key_pairs_transposed(const bf16 *k_buf, const int64_t *slots, int64_t skip, int64_t nk,
                                        int halves, int64_t kh, int64_t j, int64_t d,
                                        __m512i (*kt)[2]) {
    for (int half = 0; half < halves; half++) {
        for (int64_t c0 = 0; c0 < d / 2; c0 += 16) {
            __m512i r16[16];
            for (int t = 0; t < 16; t++) {
                const int64_t key = half * 16 + t;
                r16[t] = key >= skip && key < nk ? _mm512_loadu_si512(k_buf + (slots[key] * kh + j) * d + 2 * c0)
                                                 : _mm512_setzero_si512();
            }
            transpose16(r16);
            for (int c = 0; c < 16; c++) kt[c0 + c][half] = r16[c];
        }
    }
}

/* A block's values as key pairs: vp[tp][c][0/1] interleaves keys 2tp, 2tp+1 over dims
 * c·32 .. c·32+31 (unpack lo / hi: 128-bit lane L holds dims 8L .. 8L+3 / 8L+4 .. 8L+7).
 * Keys before `skip` (not read) and past the last key are 0 (an odd last key pairs with 0). */
static inline void value_pairs(const void *v_buf, const int64_t *slots, int64_t skip, int64_t nk, int64_t kh,
                               int64_t j, int64_t d, __m512i (*vp)[DMAX / 32][2]) {
    for (int64_t tp = 0; tp < KB / 2; tp++) {
        const int64_t ta = 2 * tp, tb = 2 * tp + 1;
        const bf16 *va = ta >= skip && ta < nk ? (const bf16 *)v_buf + (slots[ta] * kh + j) * d : NULL;
        const bf16 *vb = tb >= skip && tb < nk ? (const bf16 *)v_buf + (slots[tb] * kh + j) * d : NULL;
        for (int64_t c = 0; c < d / 32; c++) {
            const __m512i a = va ? _mm512_loadu_si512(va + 32 * c) : _mm512_setzero_si512();
            const __m512i b = vb ? _mm512_loadu_si512(vb + 32 * c) : _mm512_setzero_si512();
            vp[tp][c][0] = _mm512_unpacklo_epi16(a, b);
            vp[tp][c][1] = _mm512_unpackhi_epi16(a, b);
        }
    }
}

/* acc rows hold each 32-dim chunk as [lo | hi] (lo lane 4L+i = dim 8L+i, hi = 8L+4+i): back to
 * dim order. */
static inline void unpermute(int64_t nq, int64_t d, int64_t stride, float (*acc)[stride]) {
    for (int64_t r = 0; r < nq; r++) {
        for (int64_t c = 0; c < d / 32; c++) {
            const __m512 lo = _mm512_load_ps(&acc[r][32 * c]), hi = _mm512_load_ps(&acc[r][32 * c + 16]);
            const __m512 t0 = _mm512_shuffle_f32x4(lo, hi, 0x44), t1 = _mm512_shuffle_f32x4(lo, hi, 0xEE);
            _mm512_store_ps(&acc[r][32 * c], _mm512_shuffle_f32x4(t0, t0, 0xD8));
            _mm512_store_ps(&acc[r][32 * c + 16], _mm512_shuffle_f32x4(t1, t1, 0xD8));
        }
    }
}

/* An item's bf16 query rows into qb (rows nq .. rows-1: zeros), and its running state. */
static inline void start_rows(const bf16 *q, const int64_t *members, int64_t g, int64_t q_rows, int64_t j,
                              int64_t q0, int64_t nq, int64_t rows, int64_t d, int64_t stride,
                              bf16 (*qb)[stride], float (*acc)[stride], float *m, float *l) {
    for (int64_t r = 0; r < rows; r++) {
        if (r < nq) {
            const int64_t b = members[(q0 + r) / g], head = j * g + (q0 + r) % g;
            memcpy(qb[r], q + (b * q_rows + head) * d, (size_t)d * sizeof(bf16));
        } else {
            memset(qb[r], 0, (size_t)d * sizeof(bf16));
        }
        for (int64_t i = 0; i < d; i++) acc[r][i] = 0.0f;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
}


/* Per row rr < rb (4 or 8): out[rr] = the sum (is_max: the largest) of x[rr]'s 16 lanes, the
 * rows reduced side by side (rows in pairs, then quads, as 128-bit lane shuffles). A sum
 * follows one tree whatever rb: lanes i + (i + 8), then i + (i + 4), then (0 + 2) + (1 + 3). */
static inline __attribute__((always_inline)) void rows_reduce(const int rb, const int is_max, const v16 *x,
                                                              float *out) {
#define REDUCE_OP(a, b) (is_max ? _mm512_max_ps(a, b) : _mm512_add_ps(a, b))
    __m512 y[RB_WIDE / 2], z[RB_WIDE / 4];
    for (int p = 0; p < rb / 2; p++) { /* quads: row 2p's lanes 0-3 op 8-11, 4-7 op 12-15; row 2p+1's */
        const __m512 a = (__m512)x[2 * p], b = (__m512)x[2 * p + 1];
        y[p] = REDUCE_OP(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
    for (int p = 0; p < rb / 4; p++) { /* quad q: row 4p+q's lanes i op i + 4 */
        const __m512 a = y[2 * p], b = y[2 * p + 1];
        z[p] = REDUCE_OP(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
    }
    for (int p = 0; p < rb / 4; p++) { /* lane 4q: (0 op 2) op (1 op 3) of quad q */
        const __m512 g = REDUCE_OP(z[p], _mm512_permute_ps(z[p], _MM_SHUFFLE(1, 0, 3, 2)));
        const v16 h = (v16)REDUCE_OP(g, _mm512_permute_ps(g, _MM_SHUFFLE(2, 3, 0, 1)));
        for (int q = 0; q < 4; q++) out[4 * p + q] = h[4 * q];
    }
#undef REDUCE_OP
}

/* The online-softmax step of rows rr < rb (4 or 8) over a block of 32 scores each (s[rr][0]:
 * keys 0-15, s[rr][1]: 16-31; -inf on padding and masked keys): updates each row's running max
 * m[rr] and sum l[rr], writes its probabilities as bf16 key pairs (rounded as PyTorch's flash
 * kernel rounds them) and the factor by which its output so far must be scaled, alpha[rr] (0
 * while the row has seen no key: max_ref). The rows' maxima, factors and sums are reduced
 * side by side; a row's values depend on its own scores only. */
static inline __attribute__((always_inline)) void softmax_rows(const int rb, const v16 (*s)[2], float *m, float *l,
                                                               float *alpha, uint32_t (*ppair)[KB / 2]) {
    v16 x[RB_WIDE], old = (v16){0} - INFINITY, top = old;
    float block_max[RB_WIDE], block_sum[RB_WIDE];
    for (int rr = 0; rr < rb; rr++) x[rr] = (v16)_mm512_max_ps((__m512)s[rr][0], (__m512)s[rr][1]);
    rows_reduce(rb, 1, x, block_max);
    for (int rr = 0; rr < rb; rr++) {
        old[rr] = m[rr];
        top[rr] = block_max[rr];
    }
    const v16 mx = vselect(top > old, top, old), ref = max_ref(mx);
    const v16 factor = vselect(old == -INFINITY, (v16){0}, vexp(old - mx));
    for (int rr = 0; rr < rb; rr++) {
        const v16 p0 = vexp(s[rr][0] - ref[rr]), p1 = vexp(s[rr][1] - ref[rr]);
        _mm512_store_si512(ppair[rr], (__m512i)_mm512_cvtne2ps_pbh((__m512)p1, (__m512)p0));
        x[rr] = p0 + p1;
        m[rr] = mx[rr];
        alpha[rr] = factor[rr];
    }
    rows_reduce(rb, 0, x, block_sum);
    for (int rr = 0; rr < rb; rr++) l[rr] = l[rr] * alpha[rr] + block_sum[rr];
}

/* 16 scores of a block as the softmax takes them: scaled, soft-capped where the call says,
 * plus pad (0 on keys, -inf past the last key). */
static inline v16 block_scores(const struct call *c, __m512 sc, v16 pad) {
    v16 s = (v16)sc * c->scaling;
    if (c->softcap > 0.0f) s = soft_cap(s, c->softcap);
    return s + pad;
}

/* One step of attend_item_bf16 over a block of keys (k0 .. k0 + nk - 1, in kt and vp) for its
 * query rows r0 .. r0 + rb - 1: scores, the online softmax, acc = acc·alpha + P·V. rb rows give
 * 2·rb independent accumulator chains. */
static inline __attribute__((always_inline)) void rows_step(
    const int rb, int64_t r0, int64_t k0, int64_t nk, int halves, const struct call *c, const int64_t *limit,
    const int64_t *from, const v16 *pad, uint32_t (*qpair)[DMAX / 2], __m512i (*kt)[2],
    __m512i (*vp)[DMAX / 32][2], uint32_t (*ppair)[KB / 2], float (*acc)[DMAX], float *m, float *l,
    const char *const *ahead, int64_t n_ahead) {
    const int64_t d = c->d;
    __m512 sc[RB_WIDE][2];
    float alpha[RB_WIDE];
    for (int rr = 0; rr < rb; rr++) sc[rr][0] = sc[rr][1] = _mm512_setzero_ps();
    const int64_t per = (n_ahead + d / 2 - 1) / (d / 2); /* lines fetched per dim pair */
    for (int64_t cp = 0, next = 0; cp < d / 2; cp++) {
        for (const int64_t to = next + per < n_ahead ? next + per : n_ahead; next < to; next++)
            __builtin_prefetch(ahead[next], 0, PREFETCH_LOCALITY);
        for (int rr = 0; rr < rb; rr++) {
            const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qpair[r0 + rr][cp]);
            for (int hf = 0; hf < halves; hf++)
                sc[rr][hf] = _mm512_dpbf16_ps(sc[rr][hf], qb, (__m512bh)kt[cp][hf]);
        }
    }
    v16 s[RB_WIDE][2];
    for (int rr = 0; rr < rb; rr++) {
        s[rr][0] = block_scores(c, sc[rr][0], pad[0]);
        s[rr][1] = halves == 2 ? block_scores(c, sc[rr][1], pad[1]) : pad[1];
        mask_outside(&s[rr][0], &s[rr][1], from[r0 + rr] - k0, limit[r0 + rr] - k0);
    }
    softmax_rows(rb, (const v16 (*)[2])s, m + r0, l + r0, alpha, ppair + r0);
    /* per 32 dims: 2·rb chains over key pairs */
    for (int64_t dc = 0; dc < d / 32; dc++) {
        __m512 a[RB_WIDE][2];
        for (int rr = 0; rr < rb; rr++) {
            const __m512 scale = _mm512_set1_ps(alpha[rr]);
            a[rr][0] = _mm512_mul_ps(_mm512_load_ps(&acc[r0 + rr][32 * dc]), scale);
            a[rr][1] = _mm512_mul_ps(_mm512_load_ps(&acc[r0 + rr][32 * dc + 16]), scale);
        }
        for (int64_t tp = 0; tp < (nk + 1) / 2; tp++) {
            const __m512bh lo = (__m512bh)vp[tp][dc][0], hi = (__m512bh)vp[tp][dc][1];
            for (int rr = 0; rr < rb; rr++) {
                const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)ppair[r0 + rr][tp]);
                a[rr][0] = _mm512_dpbf16_ps(a[rr][0], pb, lo);
                a[rr][1] = _mm512_dpbf16_ps(a[rr][1], pb, hi);
            }
        }
        for (int rr = 0; rr < rb; rr++) {
            _mm512_store_ps(&acc[r0 + rr][32 * dc], a[rr][0]);
            _mm512_store_ps(&acc[r0 + rr][32 * dc + 16], a[rr][1]);
        }
    }
}

/* attend_item for bfloat16 with AVX512-BF16 dot products: the keys are the vector lanes of
 * the scores (a block's keys transposed as dim pairs: kt[c][half] holds dims 2c, 2c+1 of keys
 * half·16 .. half·16+15), each query row's dim pair is broadcast, and keys are read in place
 * from the KV buffer. Few query rows (a private tail: G rows) waste no lanes this way. */
static void attend_item_bf16(const struct call *c, const struct item *it) {
    const bf16 *q = c->q, *k_buf = c->k_buf;
    const void *v_buf = c->v_buf;
    const int64_t h = c->h, kh = c->kh, d = c->d, g = c->g, j = it->j, q0 = it->q0, nq = it->nq;
    const int64_t n_keys = it->n_keys, *slots = it->slots, *members = it->members;
    const int rb = nq > RB ? RB_WIDE : RB; /* rows per step: more chains where an item has them */
    const int64_t rows = (nq + rb - 1) / rb * rb, start = first_block(it, KB);
    int64_t from[DOTS_QB], limit[DOTS_QB];
    uint32_t qpair[DOTS_QB][DMAX / 2];
    float acc[DOTS_QB][DMAX] __attribute__((aligned(64)));
    __m512i kt[DMAX / 2][2];
    __m512i vp[KB / 2][DMAX / 32][2];
    uint32_t ppair[DOTS_QB][KB / 2] __attribute__((aligned(64)));
    float m[DOTS_QB], l[DOTS_QB];

    /* K/V are fetched two blocks ahead, a share of the block with each step's rows, spread over
     * its score products */
    const int64_t share = (KB + rows / rb - 1) / (rows / rb);
    row_froms(c, it, rows, from);
    for (int64_t r = 0; r < rows; r++) limit[r] = row_limit(it, g, r);
    prefetch_rows(k_buf, v_buf, slots, start, AHEAD * KB, n_keys, kh, j, d * (int64_t)sizeof(bf16), 0);
    start_rows(q, members, g, c->q_rows, j, q0, nq, rows, d, DMAX, (bf16 (*)[DMAX])qpair, acc, m, l);
    seed_rows(c, it, &acc[0][0], DMAX, 1, m, l);
    for (int64_t k0 = start; k0 < n_keys; k0 += KB) {
        const int64_t nk = n_keys - k0 < KB ? n_keys - k0 : KB, skip = it->k_from - k0;
        const int halves = nk > 16 ? 2 : 1;
        key_pairs_transposed(k_buf, slots + k0, skip, nk, halves, kh, j, d, kt);
        value_pairs(v_buf, slots + k0, skip, nk, kh, j, d, vp);
        v16 pad[2]; /* 0 on keys, -inf past the last key */
        for (int t = 0; t < KB; t++) pad[t / 16][t % 16] = t < nk ? 0.0f : -INFINITY;
        for (int64_t r0 = 0; r0 < rows; r0 += rb) {
            const char *ahead[KB * 2 * DMAX / 32];
            const int64_t n_ahead =
                key_lines(k_buf, v_buf, slots, k0 + AHEAD * KB + r0 / rb * share, share, n_keys, kh, j, d, ahead);
            if (rb == RB_WIDE)
                rows_step(RB_WIDE, r0, k0, nk, halves, c, limit, from, pad, qpair, kt, vp, ppair, acc, m, l, ahead,
                          n_ahead);
            else
                rows_step(RB, r0, k0, nk, halves, c, limit, from, pad, qpair, kt, vp, ppair, acc, m, l, ahead, n_ahead);
        }
    }
    unpermute(nq, d, DMAX, acc);
    write_rows(c, it, &acc[0][0], DMAX, m, l);
}
#endif


#ifdef HAVE_AMX
/* Tile registers, all 16 rows × 64 bytes. Q·Kᵀ: 0, 3, 5, 6 the scores of a step's four
 * groups of 16 keys (C), 1 a q chunk (A), 2, 4, 7 key chunks (B). P·V: 3 and 6 the
 * probabilities of its two blocks (A), 4, 1, 7, 2 value chunks (B), 5 and 0 two output chunks
 * (C).
 *
 * attend_item for bfloat16 with AMX tiles, for items with many query rows (a shared prefix,
 * an extend). Keys go in steps of AKB = two blocks: per step and 16 query rows, Q·Kᵀ is d/32
 * tile products per 16 keys, the online softmax runs on the stored scores with AVX-512 (the
 * 16 rows' maxima and rescale factors as one vector), and P·V is one tile product per 16 dims
 * and block. Same layouts as attend_item_bf16 (keys transposed as dim pairs, values as key
 * pairs). */
static void attend_item_amx(const struct call *c, const struct item *it) {
    const bf16 *q = c->q, *k_buf = c->k_buf;
    const void *v_buf = c->v_buf;
    const int64_t h = c->h, kh = c->kh, d = c->d, g = c->g, j = it->j, q0 = it->q0, nq = it->nq;
    const int64_t n_keys = it->n_keys, *slots = it->slots, *members = it->members;
    const int64_t mtiles = (nq + 15) / 16;
    /* rows of q and of the output d values apart: rows DMAX apart would crowd a few L1 sets */
    bf16 qb_rows[AMX_QB * DMAX] __attribute__((aligned(64)));
    float acc_rows[AMX_QB * DMAX] __attribute__((aligned(64)));
    bf16 (*qb)[d] = (bf16 (*)[d])qb_rows;
    float (*acc)[d] = (float (*)[d])acc_rows;
    __m512i kt[2][DMAX / 2][2];
    __m512i vp[2][KB / 2][DMAX / 32][2];
    float sc[AMX_QB][AKB] __attribute__((aligned(64)));
    uint32_t ppair[AMX_QB][AKB / 2] __attribute__((aligned(64)));
    float m[AMX_QB] __attribute__((aligned(64))), l[AMX_QB], alpha[AMX_QB] __attribute__((aligned(64)));
    int64_t from[AMX_QB];
    const v16 ninf = (v16){0} - INFINITY;

    row_froms(c, it, nq, from);
    start_rows(q, members, g, c->q_rows, j, q0, nq, 16 * mtiles, d, d, qb, acc, m, l);
    seed_rows(c, it, acc_rows, d, 1, m, l);
    memset(ppair[nq], 0, sizeof ppair[0] * (size_t)(16 * mtiles - nq)); /* padding rows: P = 0 */
    for (int64_t k0 = first_block(it, AKB); k0 < n_keys; k0 += AKB) {
        const int64_t nk = n_keys - k0 < AKB ? n_keys - k0 : AKB;
        const int blocks = nk > KB ? 2 : 1, quarters = 2 * blocks;
        prefetch_rows(k_buf, v_buf, slots, k0 + AKB, AKB, n_keys, kh, j, d * (int64_t)sizeof(bf16), 1);
        for (int bl = 0; bl < blocks; bl++) {
            const int64_t k1 = k0 + KB * bl, nb = nk - KB * bl < KB ? nk - KB * bl : KB;
            key_pairs_transposed(k_buf, slots + k1, it->k_from - k1, nb, 2, kh, j, d, kt[bl]);
            value_pairs(v_buf, slots + k1, it->k_from - k1, nb, kh, j, d, vp[bl]);
        }
        v16 pad[4]; /* 0 on keys, -inf past the last key */
        for (int t = 0; t < AKB; t++) pad[t / 16][t % 16] = t < nk ? 0.0f : -INFINITY;
        for (int64_t mt = 0; mt < mtiles; mt++) {
            const int64_t r0 = 16 * mt;
            /* Scores of keys 16·qt .. 16·qt+15 in tiles 0, 3, 5, 6 (qt = 0..3): independent
             * accumulators, so the tile products overlap instead of waiting on each other. */
            _tile_zero(0);
            _tile_zero(3);
            if (blocks == 2) {
                _tile_zero(5);
                _tile_zero(6);
            }
            for (int64_t dc = 0; dc < d / 32; dc++) {
                _tile_loadd(1, &qb[r0][32 * dc], sizeof qb[0]);
                _tile_loadd(2, &kt[0][16 * dc][0], sizeof kt[0][0]);
                _tile_loadd(4, &kt[0][16 * dc][1], sizeof kt[0][0]);
                _tile_dpbf16ps(0, 1, 2);
                _tile_dpbf16ps(3, 1, 4);
                if (blocks == 2) {
                    _tile_loadd(7, &kt[1][16 * dc][0], sizeof kt[0][0]);
                    _tile_dpbf16ps(5, 1, 7);
                    _tile_loadd(2, &kt[1][16 * dc][1], sizeof kt[0][0]);
                    _tile_dpbf16ps(6, 1, 2);
                }
            }
            _tile_stored(0, &sc[r0][0], sizeof sc[0]);
            _tile_stored(3, &sc[r0][16], sizeof sc[0]);
            if (blocks == 2) {
                _tile_stored(5, &sc[r0][32], sizeof sc[0]);
                _tile_stored(6, &sc[r0][48], sizeof sc[0]);
            }
            const int real = nq - r0 < 16 ? (int)(nq - r0) : 16; /* rows past it: padding, skipped */
            v16 block_max = ninf; /* lane r: row r0 + r */
            for (int r = 0; r < real; r++) {
                v16 sv[4];
                for (int qt = 0; qt < 4; qt++)
                    sv[qt] = qt < quarters ? block_scores(c, *(__m512 *)&sc[r0 + r][16 * qt], pad[qt]) : ninf;
                const int64_t left = row_limit(it, g, r0 + r) - k0, first = from[r0 + r] - k0;
                mask_outside(&sv[0], &sv[1], first, left);
                mask_outside(&sv[2], &sv[3], first - KB, left - KB);
                for (int qt = 0; qt < 4; qt++) *(v16 *)&sc[r0 + r][16 * qt] = sv[qt];
                const v16 a = vselect(sv[0] > sv[1], sv[0], sv[1]), b = vselect(sv[2] > sv[3], sv[2], sv[3]);
                block_max[r] = hmax(vselect(a > b, a, b));
            }
            const v16 m_old = *(v16 *)&m[r0];
            const v16 m_new = vselect(block_max > m_old, block_max, m_old);
            *(v16 *)&alpha[r0] = vselect(m_old == ninf, (v16){0}, vexp(m_old - m_new)); /* 0 at the start */
            *(v16 *)&m[r0] = m_new;
            for (int r = 0; r < real; r++) {
                const float mx = m_new[r] == -INFINITY ? 0.0f : m_new[r]; /* max_ref */
                v16 sum = {0};
                for (int half = 0; half < blocks; half++) { /* probabilities as bf16 key pairs */
                    const v16 p0 = vexp(*(v16 *)&sc[r0 + r][32 * half] - mx);
                    const v16 p1 = vexp(*(v16 *)&sc[r0 + r][32 * half + 16] - mx);
                    _mm512_store_si512(&ppair[r0 + r][16 * half], (__m512i)_mm512_cvtne2ps_pbh((__m512)p1, (__m512)p0));
                    sum += p0 + p1;
                }
                l[r0 + r] = l[r0 + r] * alpha[r0 + r] + hsum(sum);
                if (alpha[r0 + r] != 1.0f) {
                    const __m512 scale = _mm512_set1_ps(alpha[r0 + r]);
                    for (int64_t i = 0; i < d; i += 16)
                        _mm512_store_ps(&acc[r0 + r][i], _mm512_mul_ps(_mm512_load_ps(&acc[r0 + r][i]), scale));
                }
            }
            /* P·V per 32 dims: the lo and hi output chunks in tiles 5 and 0, side by side */
            _tile_loadd(3, &ppair[r0][0], sizeof ppair[0]);
            if (blocks == 2) _tile_loadd(6, &ppair[r0][16], sizeof ppair[0]);
            for (int64_t dc = 0; dc < d / 32; dc++) {
                float *lo = &acc[r0][32 * dc], *hi = &acc[r0][32 * dc + 16];
                _tile_loadd(5, lo, sizeof acc[0]);
                _tile_loadd(0, hi, sizeof acc[0]);
                _tile_loadd(4, &vp[0][0][dc][0], sizeof vp[0][0]);
                _tile_loadd(1, &vp[0][0][dc][1], sizeof vp[0][0]);
                _tile_dpbf16ps(5, 3, 4);
                _tile_dpbf16ps(0, 3, 1);
                if (blocks == 2) {
                    _tile_loadd(7, &vp[1][0][dc][0], sizeof vp[1][0]);
                    _tile_loadd(2, &vp[1][0][dc][1], sizeof vp[1][0]);
                    _tile_dpbf16ps(5, 6, 7);
                    _tile_dpbf16ps(0, 6, 2);
                }
                _tile_stored(5, lo, sizeof acc[0]);
                _tile_stored(0, hi, sizeof acc[0]);
            }
        }
    }
    unpermute(nq, d, d, acc);
    write_rows(c, it, &acc[0][0], d, m, l);
}
#endif

/* 1 if radixrt_attention's bf16_dots takes effect in this build (AVX512-BF16), else 0. */
int radixrt_attention_dots_available(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* What every work item of an attention call shares. */
static struct call call_of(const struct attn_call *c) {
    const struct attention_args *a = &c->a;
    return (struct call){a->q,    c->k_buf, c->v_buf,          a->out,           (int)a->is_bf16,
                         a->h,    a->kh,    a->h / a->kh,      a->d,             a->q_stride / a->d,
                         (float)a->scaling, a->num_parts, a->part_acc, a->part_m, a->part_l, (int)a->exact,
                         a->window,  a->positions, (float)a->softcap};
}

/* The phase whose items include segment s's: its part where part 1 continues part 0 (an exact
 * call with two-part tokens), else 0. */
static inline int phase_of(const struct attn_call *c, int64_t s) {
    return c->phases == 2 ? (int)c->a.seg_part[s] : 0;
}

/* 1 if an exact call's segments let a token's part 1 continue its part 0: every member of a
 * part-1 segment has two parts, and a part-0 segment with a two-part member is not causal and
 * ends on a multiple of the path's key step (AKB where AMX runs the items, else KB). */
static int exact_segments(const struct attn_call *c) {
    const struct attention_args *a = &c->a;
    const int64_t step = c->use_amx ? AKB : KB;
    for (int64_t s = 0; s < a->num_segments; s++) {
        int one = 0, two = 0; /* members with one part, with two */
        for (int64_t i = a->seg_member_start[s]; i < a->seg_member_start[s + 1]; i++) {
            one |= a->num_parts[a->members[i]] != 2;
            two |= a->num_parts[a->members[i]] == 2;
        }
        const int causal = a->seg_causal != NULL && a->seg_causal[s];
        const int64_t n_keys = a->seg_slot_start[s + 1] - a->seg_slot_start[s];
        if (a->seg_part[s] == 1 ? one : two && (causal || n_keys % step != 0)) return 0;
    }
    return 1;
}

int radixrt_attn_prepare(struct attn_call *c) {
    const struct attention_args *a = &c->a;
    if (a->d > DMAX || a->d <= 0 || a->d % 32 != 0 || a->kh <= 0 || a->h % a->kh != 0 || a->q_stride % a->d != 0)
        return -1;
    if (a->window < 0 || (a->window > 0 && (!a->seg_key_start || !a->positions)) || !(a->softcap >= 0.0))
        return -1;
    const int64_t g = a->h / a->kh;
#ifdef HAVE_AMX
    c->use_amx = a->is_bf16 && amx_permitted();
    c->qb = c->use_amx ? AMX_QB : QB; /* an AMX call's items under AMX_MIN_ROWS go to AVX-512 (but exact) */
#else
    c->use_amx = 0;
    c->qb = QB;
#endif
#ifdef __AVX512BF16__
    if (!c->use_amx && a->is_bf16 && a->bf16_dots) c->qb = DOTS_QB;
#endif
    int two_parts = 0;
    for (int64_t tok = 0; tok < a->t && !two_parts; tok++) two_parts = a->num_parts[tok] == 2;
    c->merging = two_parts && !a->exact;
    c->phases = two_parts && a->exact ? 2 : 1;
    if (a->exact && !exact_segments(c)) return -2;
    /* Work items: per segment, KH × ceil(members·G / qb), in the segment's phase. */
    c->items[0] = c->items[1] = 0;
    for (int64_t s = 0; s < a->num_segments; s++) {
        const int64_t rows = (a->seg_member_start[s + 1] - a->seg_member_start[s]) * g;
        c->items[phase_of(c, s)] += a->kh * ((rows + c->qb - 1) / c->qb);
    }
    return 0;
}

void radixrt_attn_store(const struct attn_call *c, int64_t id, int64_t threads) {
    const size_t elem = c->a.is_bf16 ? 2 : 4, row_bytes = (size_t)(c->a.kh * c->a.d) * elem;
    for (int64_t i = c->a.n_new * id / threads; i < c->a.n_new * (id + 1) / threads; i++) {
        const size_t from = (size_t)(i * c->a.new_stride) * elem;
        memcpy((char *)c->k_buf + c->a.new_slots[i] * row_bytes, (const char *)c->a.new_k + from, row_bytes);
        memcpy((char *)c->v_buf + c->a.new_slots[i] * row_bytes, (const char *)c->a.new_v + from, row_bytes);
    }
}

/* Work item `item` of phase `phase`: items run segment by segment (of that phase), per segment
 * KV head by KV head, per head block by block (in a causal segment the last block first). */
static struct item item_at(const struct attn_call *c, int phase, int64_t item) {
    const int64_t g = c->a.h / c->a.kh, qb = c->qb, kh = c->a.kh;
    const int64_t *seg_member_start = c->a.seg_member_start, *seg_slot_start = c->a.seg_slot_start;
    int64_t s = 0, rows = 0, blocks = 0;
    for (;; s++) { /* the item's segment (a linear walk) */
        if (phase_of(c, s) != phase) continue;
        rows = (seg_member_start[s + 1] - seg_member_start[s]) * g;
        blocks = (rows + qb - 1) / qb;
        if (item < kh * blocks) break;
        item -= kh * blocks;
    }
    const int causal = c->a.seg_causal != NULL && c->a.seg_causal[s];
    const int64_t block = causal ? blocks - 1 - item % blocks : item % blocks; /* longest first */
    struct item it = {c->a.slots + seg_slot_start[s], c->a.members + seg_member_start[s],
                      seg_slot_start[s + 1] - seg_slot_start[s], -1, c->a.seg_part[s],
                      item / blocks, block * qb, 0, c->a.window > 0 ? c->a.seg_key_start[s] : 0, 0};
    it.nq = rows - it.q0 < qb ? rows - it.q0 : qb;
    if (causal) {
        it.causal_from = it.n_keys - rows / g;
        it.n_keys = row_limit(&it, g, it.nq - 1);
    }
    if (c->a.window > 0) { /* the least first key of its rows */
        const struct call call = call_of(c);
        it.k_from = it.n_keys;
        for (int64_t r = 0; r < it.nq; r++) {
            const int64_t from = row_from(&call, &it, r);
            it.k_from = from < it.k_from ? from : it.k_from;
        }
    }
    return it;
}

/* An item on its path (the header says which); *configured: whether this thread's AMX tiles
 * are. */
static void run_item(const struct attn_call *c, const struct call *call, const struct item *it,
                     int *configured) {
#ifdef HAVE_AMX
    if (c->use_amx && (c->a.exact || it->nq >= AMX_MIN_ROWS)) {
        if (!*configured) {
            amx_configure();
            *configured = 1;
        }
        attend_item_amx(call, it);
        return;
    }
#else
    (void)configured;
#endif
#ifdef __AVX512BF16__
    if (c->a.is_bf16 && c->a.bf16_dots) {
        attend_item_bf16(call, it);
        return;
    }
#endif
    attend_item(call, it);
}

void radixrt_attn_items(const struct attn_call *c, int64_t *next, int phase) {
    const struct call call = call_of(c);
    int configured = 0;
    /* KH items at a time: a decode segment's KV heads on one thread, which then reads whole
     * K/V rows (the heads of a slot are adjacent) */
    const int64_t take = c->a.kh;
    for (;;) {
        const int64_t first = __atomic_fetch_add(next, take, __ATOMIC_RELAXED);
        if (first >= c->items[phase]) break;
        for (int64_t item = first; item < first + take && item < c->items[phase]; item++) {
            const struct item it = item_at(c, phase, item);
            run_item(c, &call, &it, &configured);
        }
    }
#ifdef HAVE_AMX
    if (configured) _tile_release();
#endif
}

void radixrt_attn_merge(const struct attn_call *c, int64_t id, int64_t threads) {
    const int64_t h = c->a.h, d = c->a.d, th_count = c->a.t * h;
    const struct call call = call_of(c);
    const float *part_m = c->a.part_m, *part_l = c->a.part_l, *part_acc = c->a.part_acc;
    for (int64_t th = th_count * id / threads; th < th_count * (id + 1) / threads; th++) {
        const int64_t tok = th / h, head = th % h;
        if (c->a.num_parts[tok] != 2) continue;
        const int64_t a0 = (tok * 2) * h + head, a1 = (tok * 2 + 1) * h + head;
        const float mx = part_m[a1] > part_m[a0] ? part_m[a1] : part_m[a0];
        const float w0 = expf(part_m[a0] - mx), w1 = expf(part_m[a1] - mx);
        const float total = part_l[a0] * w0 + part_l[a1] * w1;
        const float *o0 = part_acc + a0 * d, *o1 = part_acc + a1 * d;
        float merged[DMAX] __attribute__((aligned(64)));
        for (int64_t i = 0; i < d; i += VL) {
            vf x0, x1;
            memcpy(&x0, o0 + i, sizeof x0);
            memcpy(&x1, o1 + i, sizeof x1);
            const vf sum = w1 != 0.0f ? w0 * x0 + w1 * x1 : w0 * x0; /* w1 = 0: an empty part's 0·NaN */
            memcpy(merged + i, &sum, sizeof sum);
        }
        store_out(&call, th, merged, total > 0.0f ? 1.0f / total : 0.0f);
    }
}

/* Returns 0, -1 when a size is out of range, or -2 when an exact call's segments do not let
 * part 1 continue part 0 (exact_segments); nothing is written then.
 *
 * q [T, H, D] (the query tokens; token rows q_stride elements apart, heads contiguous) and out
 * [T, H, D] (contiguous).
 * seg_slot_start [S + 1]: segment s's slots are slots[seg_slot_start[s] .. seg_slot_start[s+1]);
 * seg_member_start [S + 1]: its query tokens are members[seg_member_start[s] .. [s+1]);
 * seg_part [S]: the part (0 or 1) its results go to; seg_causal [S] (NULL: none): 1 if causal;
 * num_parts [T]: 1 or 2 per token.
 * part_acc [T, 2, H, D], part_m and part_l [T, 2, H]: float32 scratch (touched only for tokens
 * with two parts).
 * new_k, new_v [n_new, KH, D] (token rows new_stride elements apart, heads contiguous): written
 * to rows new_slots [n_new] of k_buf, v_buf first.
 * bf16_dots: bf16 items that AMX does not take run on AVX512-BF16 dot products (where the build
 * has them) instead of being widened to float32 for FMA.
 * exact: exact mode (the header): a row's bits depend on its query and keys alone.
 * window (0: none) and softcap (0: none): a sliding window of that many keys and the scores'
 * soft cap (the header); with a window, seg_key_start [S] (the position of each segment's key 0
 * in its members' sequences) and positions [T] (each token's own key's position).
 *
 * The work runs as parts (parts.h): the new rows stored, the work items taken from a shared
 * counter by the threads (in an exact call with two-part tokens: the part-0 items, then the
 * part-1 items), then (no threads started for none) the two parts of every (token, head) that
 * has two merged (not in exact mode). */
int radixrt_attention(const void *q, int64_t q_stride, void *k_buf, void *v_buf, void *out, int is_bf16,
                      int bf16_dots, int exact,
                      int64_t t, int64_t h, int64_t kh, int64_t d, float scaling, int64_t num_segments,
                      const int64_t *slots, const int64_t *seg_slot_start, const int64_t *members,
                      const int64_t *seg_member_start, const int64_t *seg_part,
                      const int64_t *seg_causal, const int64_t *num_parts, float *part_acc,
                      float *part_m, float *part_l, int num_threads, const void *new_k,
                      const void *new_v, int64_t new_stride, const int64_t *new_slots, int64_t n_new,
                      const int64_t *seg_key_start, const int64_t *positions, int64_t window, float softcap) {
    struct attn_call c = {.a = {q, q_stride, out, is_bf16, bf16_dots, exact, t, h, kh, d, scaling, num_segments,
                                slots, seg_slot_start, members, seg_member_start, seg_part, seg_causal, num_parts,
                                part_acc, part_m, part_l, new_k, new_v, new_stride, new_slots, n_new,
                                seg_key_start, positions, window, softcap},
                          .k_buf = k_buf,
                          .v_buf = v_buf};
    if (num_threads < 1) return -1;
    const int rc = radixrt_attn_prepare(&c);
    if (rc != 0) return rc;
    radixrt_attn_store(&c, 0, 1); /* first the step's new K/V rows (a new token attends to itself) */
    int64_t next[2] = {0, 0};
#pragma omp parallel num_threads(num_threads)
    {
        radixrt_attn_items(&c, &next[0], 0);
        if (c.phases == 2) {
#pragma omp barrier
            radixrt_attn_items(&c, &next[1], 1);
        }
    }
    if (!c.merging) return 0;
#pragma omp parallel num_threads(num_threads)
    radixrt_attn_merge(&c, omp_get_thread_num(), omp_get_num_threads());
    return 0;
}

/* A decode step's segments for radixrt_attention, as the attention backend's PyTorch path
 * groups requests (torch_backend._shared_groups): requests with the same first slot form a
 * group; its prefix is the longest run of slots all its requests share, capped at each one's
 * length - 1; a group of >= min_group requests with a prefix of >= min_prefix slots gets a
 * segment of its own (part 0 of its members, groups in ascending first slot), then each request
 * one for its remaining slots (part 1 in a group, else part 0 over all its slots). With
 * split_from > 0, a request in no group with >= split_from slots gets two segments instead,
 * its first len / 2 slots (part 0) and the rest (part 1): more work items where a batch has too
 * few to keep the threads busy, merged as a group's parts are. With exact, for an exact call:
 * a group's prefix is rounded down to a multiple of EXACT_STEP slots (the rest goes to each
 * request's tail), and no request is split (split_from is not used).
 *
 * table [*, table_stride] holds each request row's slots; request i (of b) is row req_rows[i],
 * lens[i] >= 1 slots. Outputs (sizes: slots sum(lens); slot_start, member_start 2b + 1;
 * members 2b; part 2b; num_parts b; key_start 2b: the position of each segment's first slot in
 * its requests' rows; positions b: each request's lens[i] - 1); order [b] scratch. Returns the
 * number of segments. */
int64_t radixrt_decode_segments(const int64_t *table, int64_t table_stride, const int64_t *req_rows,
                                const int64_t *lens, int64_t b, int64_t min_prefix, int64_t min_group,
                                int64_t split_from, int exact, int64_t *slots, int64_t *slot_start, int64_t *members,
                                int64_t *member_start, int64_t *part, int64_t *num_parts, int64_t *key_start,
                                int64_t *positions, int64_t *order) {
#define SLOT(i, p) table[req_rows[i] * table_stride + (p)]
    for (int64_t i = 0; i < b; i++) { /* requests by (first slot, index): insertion sort */
        int64_t at = i;
        while (at > 0 && (SLOT(order[at - 1], 0) > SLOT(i, 0)
                          || (SLOT(order[at - 1], 0) == SLOT(i, 0) && order[at - 1] > i))) {
            order[at] = order[at - 1];
            at--;
        }
        order[at] = i;
    }
    int64_t segs = 0, n_slots = 0, n_members = 0;
    slot_start[0] = member_start[0] = 0;
    for (int64_t i = 0; i < b; i++) num_parts[i] = 0; /* 0: no group yet; the prefix length + 1 below */
    for (int64_t g0 = 0; g0 < b;) {
        int64_t g1 = g0 + 1;
        while (g1 < b && SLOT(order[g1], 0) == SLOT(order[g0], 0)) g1++;
        const int64_t first = order[g0];
        int64_t c = lens[first] - 1;
        for (int64_t at = g0 + 1; at < g1; at++) {
            const int64_t r = order[at], shared = lens[r] < lens[first] ? lens[r] : lens[first];
            int64_t run = 0;
            while (run < shared && SLOT(r, run) == SLOT(first, run)) run++;
            if (run > lens[r] - 1) run = lens[r] - 1;
            if (run < c) c = run;
        }
        if (exact) c -= c % EXACT_STEP;
        if (g1 - g0 >= min_group && c >= min_prefix) {
            for (int64_t p = 0; p < c; p++) slots[n_slots++] = SLOT(first, p);
            for (int64_t at = g0; at < g1; at++) {
                members[n_members++] = order[at];
                num_parts[order[at]] = c + 1;
            }
            key_start[segs] = 0;
            part[segs++] = 0;
            slot_start[segs] = n_slots;
            member_start[segs] = n_members;
        }
        g0 = g1;
    }
    for (int64_t i = 0; i < b; i++) {
        positions[i] = lens[i] - 1;
        if (!num_parts[i] && !exact && split_from > 0 && lens[i] >= split_from) { /* two halves */
            for (int half = 0; half < 2; half++) {
                const int64_t p0 = half ? lens[i] / 2 : 0, p1 = half ? lens[i] : lens[i] / 2;
                for (int64_t p = p0; p < p1; p++) slots[n_slots++] = SLOT(i, p);
                members[n_members++] = i;
                key_start[segs] = p0;
                part[segs++] = half;
                slot_start[segs] = n_slots;
                member_start[segs] = n_members;
            }
            num_parts[i] = 2;
            continue;
        }
        const int64_t start = num_parts[i] ? num_parts[i] - 1 : 0;
        for (int64_t p = start; p < lens[i]; p++) slots[n_slots++] = SLOT(i, p);
        members[n_members++] = i;
        key_start[segs] = start;
        part[segs++] = num_parts[i] ? 1 : 0;
        num_parts[i] = num_parts[i] ? 2 : 1;
        slot_start[segs] = n_slots;
        member_start[segs] = n_members;
    }
    return segs;
#undef SLOT
}
