/* Decode attention on the CPU over K/V read through slot indices, cascade-aware.
 *
 * One query token per request. The keys of a request are split into segments:
 * a segment is a list of slots and the requests that attend to all of it (a
 * prefix shared through the radix cache is one segment for all its requests;
 * each request's private tail is a segment of its own). A request attends to at
 * most two segments (part 0 and part 1); their results are merged by their
 * log-sum-exps at the end, so a shared prefix is read once for all the
 * requests that share it, straight from the KV buffers, with no gathered copy.
 *
 * Layout: q and out [B, H, D]; k_buf and v_buf [N, KH, D] (row = slot); all
 * contiguous, float32 or bfloat16 (the same dtype for all). The H query heads
 * of KV head j are heads j*G .. j*G+G-1 (G = H / KH), as in PyTorch's GQA.
 * Accumulation is float32 with an online softmax (flash decoding).
 *
 * Work items are (segment, KV head, block of at most QB query rows); threads
 * of the caller's OpenMP runtime take them from a shared counter (PyTorch's
 * libgomp: the library is linked against it, so no second thread pool runs).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#define QB 32 /* query rows per work item */
#define KB 32 /* keys per block */
#define DMAX 256

typedef uint16_t bf16;

static inline float bf16_to_f32(bf16 x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline bf16 f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (bf16)((bits >> 16) | 0x40u); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);                                  /* round to nearest even */
    return (bf16)(bits >> 16);
}

typedef float v16 __attribute__((vector_size(64)));                /* 16 float32 lanes */
typedef int32_t v16i __attribute__((vector_size(64)));
#define RB 4  /* query rows computed together (independent accumulator chains) */
#define DC 32 /* head dims per accumulator chunk in P·V (two vectors) */

/* mask ? a : b per lane (mask lanes all ones or all zeros, as comparisons give) */
static inline v16 vselect(v16i mask, v16 a, v16 b) {
    return (v16)(((v16i)a & mask) | ((v16i)b & ~mask));
}

/* e^x per lane (relative error ~2e-7; lanes below -87.3 give 0, so e^-inf = 0): x = n·ln2 + r,
 * |r| <= ln2 (n truncated toward zero), e^r by its degree-7 Taylor polynomial, 2^n by exponent. */
static inline v16 vexp(v16 x) {
    const v16i lo = x < -87.3f;
    const v16 zero = {0}, floor = zero - 87.3f, ceiling = zero + 88.0f;
    x = vselect(lo, floor, vselect(x > 88.0f, ceiling, x));
    const v16i n = __builtin_convertvector(x * 1.44269504088896341f, v16i);
    const v16 nf = __builtin_convertvector(n, v16);
    const v16 r = (x - nf * 0.693145751953125f) - nf * 1.428606765330187e-06f;
    v16 p = zero + 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    p = (v16)((v16i)p + (n << 23));
    return vselect(lo, zero, p);
}

static inline float hmax(v16 x) {
    float m = x[0];
    for (int i = 1; i < 16; i++) m = x[i] > m ? x[i] : m;
    return m;
}

static inline float hsum(v16 x) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += x[i];
    return s;
}

/* Row `row` (D values) of a buffer as float32. */
static inline void load_row(const void *buf, int64_t row, int64_t d, int is_bf16, float *dst) {
    if (is_bf16) {
        const bf16 *src = (const bf16 *)buf + row * d;
        for (int64_t i = 0; i < d; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)buf + row * d, (size_t)d * sizeof(float));
    }
}

/* Scores of keys [0, nk) of the block for NV·16 query rows: st[t][lanes] = Σ_i qt[i][lanes]·kf[t][i].
 * Four keys at a time, so 4·NV accumulator chains run side by side. */
static inline __attribute__((always_inline)) void scores(const int nv, const v16 (*qt)[2],
                                                         const float (*kf)[DMAX], int64_t nk, int64_t d,
                                                         v16 (*st)[2]) {
    int64_t t = 0;
    for (; t + 4 <= nk; t += 4) {
        v16 a[4][2] = {{{0}}};
        for (int64_t i = 0; i < d; i++) {
            for (int v = 0; v < nv; v++) {
                const v16 qv = qt[i][v];
                a[0][v] += qv * kf[t][i];
                a[1][v] += qv * kf[t + 1][i];
                a[2][v] += qv * kf[t + 2][i];
                a[3][v] += qv * kf[t + 3][i];
            }
        }
        for (int u = 0; u < 4; u++)
            for (int v = 0; v < nv; v++) st[t + u][v] = a[u][v];
    }
    for (; t < nk; t++) {
        v16 a[2] = {{0}};
        for (int64_t i = 0; i < d; i++)
            for (int v = 0; v < nv; v++) a[v] += qt[i][v] * kf[t][i];
        for (int v = 0; v < nv; v++) st[t][v] = a[v];
    }
}

#ifdef __AVX512BF16__
/* The same from bfloat16 keys read in place, with AVX512-BF16 pair dot products: lanes are
 * query rows, qp[c] holds each row's dims (2c, 2c+1); a key's pair is broadcast. */
static inline __attribute__((always_inline)) void scores_bf16(const int nv, const __m512i (*qp)[2],
                                                              const bf16 *const *krow, int64_t nk,
                                                              int64_t d, float scaling, v16 (*st)[2]) {
    int64_t t = 0;
    for (; t + 4 <= nk; t += 4) {
        __m512 a[4][2];
        for (int u = 0; u < 4; u++) a[u][0] = a[u][1] = _mm512_setzero_ps();
        for (int64_t c = 0; c < d / 2; c++) {
            __m512bh kp[4];
            for (int u = 0; u < 4; u++) {
                uint32_t pair;
                memcpy(&pair, krow[t + u] + 2 * c, 4);
                kp[u] = (__m512bh)_mm512_set1_epi32((int)pair);
            }
            for (int v = 0; v < nv; v++) {
                const __m512bh qv = (__m512bh)qp[c][v];
                for (int u = 0; u < 4; u++) a[u][v] = _mm512_dpbf16_ps(a[u][v], qv, kp[u]);
            }
        }
        for (int u = 0; u < 4; u++)
            for (int v = 0; v < nv; v++) st[t + u][v] = (v16)a[u][v] * scaling;
    }
    for (; t < nk; t++) {
        __m512 a[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t c = 0; c < d / 2; c++) {
            uint32_t pair;
            memcpy(&pair, krow[t] + 2 * c, 4);
            const __m512bh kp = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int v = 0; v < nv; v++) a[v] = _mm512_dpbf16_ps(a[v], (__m512bh)qp[c][v], kp);
        }
        for (int v = 0; v < nv; v++) st[t][v] = (v16)a[v] * scaling;
    }
}
#endif

/* One work item: rows [q0, q0 + nq) (nq <= QB) of a segment's queries on KV head j. Query
 * row r is member r / G of the segment, head j*G + r % G; rows are the vector lanes of the
 * scores (q transposed once per item, so keys need no transposing). Writes each row's
 * unnormalised output (acc), running max (m) and sum (l) into the partial buffers at its part. */
static void attend_item(const void *q, const void *k_buf, const void *v_buf, int is_bf16,
                        int64_t h, int64_t kh, int64_t d, float scaling,
                        const int64_t *slots, int64_t n_keys, const int64_t *members,
                        int64_t part, int64_t j, int64_t q0, int64_t nq,
                        float *part_acc, float *part_m, float *part_l) {
    const int64_t g = h / kh;
    const int nv = nq > 16 ? 2 : 1;
#ifdef __AVX512BF16__
    const int is_bf16_dot = is_bf16;
#else
    const int is_bf16_dot = 0;
#endif
    v16 qt[DMAX][2];                                /* q transposed: qt[dim][rows], scaled */
    float acc[QB][DMAX] __attribute__((aligned(64)));
    float kf[KB][DMAX] __attribute__((aligned(64))); /* the block's keys, float32 */
    float vf[KB][DMAX] __attribute__((aligned(64))); /* its values */
    v16 st[KB][2];                                  /* scores, then probabilities: [key][rows] */
    v16 m[2], l[2];
    float row[DMAX] __attribute__((aligned(64)));

#ifdef __AVX512BF16__
    __m512i qp[DMAX / 2][2]; /* bf16 q as dim pairs, lanes = rows (unscaled: scores are scaled) */
    const bf16 *krow[KB];
    if (is_bf16) {
        uint32_t pairs[DMAX / 2][32] __attribute__((aligned(64)));
        memset(pairs, 0, (size_t)(d / 2) * sizeof pairs[0]);
        for (int64_t r = 0; r < nq; r++) {
            const int64_t b = members[(q0 + r) / g], head = j * g + (q0 + r) % g;
            const bf16 *src = (const bf16 *)q + (b * h + head) * d;
            for (int64_t c = 0; c < d / 2; c++) pairs[c][r] = src[2 * c] | ((uint32_t)src[2 * c + 1] << 16);
        }
        for (int64_t c = 0; c < d / 2; c++) {
            qp[c][0] = _mm512_load_si512(&pairs[c][0]);
            qp[c][1] = _mm512_load_si512(&pairs[c][16]);
        }
    }
#endif
    for (int64_t i = 0; i < d; i++) qt[i][0] = qt[i][1] = (v16){0};
    for (int64_t r = 0; r < nq && !is_bf16_dot; r++) {
        const int64_t b = members[(q0 + r) / g], head = j * g + (q0 + r) % g;
        load_row(q, b * h + head, d, is_bf16, row);
        for (int64_t i = 0; i < d; i++) qt[i][r / 16][r % 16] = row[i] * scaling;
    }
    for (int64_t r = 0; r < QB; r++)
        for (int64_t i = 0; i < d; i++) acc[r][i] = 0.0f;
    for (int v = 0; v < 2; v++) {
        m[v] = (v16){0} - INFINITY;
        l[v] = (v16){0};
    }
    const int64_t rb_end = (nq + RB - 1) / RB * RB;
    for (int64_t k0 = 0; k0 < n_keys; k0 += KB) {
        const int64_t nk = n_keys - k0 < KB ? n_keys - k0 : KB;
        for (int64_t t = 0; t < nk; t++) {
            const int64_t kv_row = slots[k0 + t] * kh + j;
#ifdef __AVX512BF16__
            if (is_bf16_dot)
                krow[t] = (const bf16 *)k_buf + kv_row * d;
            else
#endif
                load_row(k_buf, kv_row, d, is_bf16, kf[t]);
            load_row(v_buf, kv_row, d, is_bf16, vf[t]);
        }
#ifdef __AVX512BF16__
        if (is_bf16_dot) {
            if (nv == 1)
                scores_bf16(1, qp, krow, nk, d, scaling, st);
            else
                scores_bf16(2, qp, krow, nk, d, scaling, st);
        } else
#endif
        if (nv == 1)
            scores(1, qt, kf, nk, d, st);
        else
            scores(2, qt, kf, nk, d, st);
        /* online softmax, lane by lane (a lane is a query row) */
        v16 alpha[2];
        for (int v = 0; v < nv; v++) {
            v16 mx = m[v];
            for (int64_t t = 0; t < nk; t++) mx = vselect(st[t][v] > mx, st[t][v], mx);
            alpha[v] = vexp(m[v] - mx); /* 0 on the first block (m = -inf) */
            v16 sum = {0};
            for (int64_t t = 0; t < nk; t++) {
                st[t][v] = vexp(st[t][v] - mx);
                sum += st[t][v];
            }
            m[v] = mx;
            l[v] = l[v] * alpha[v] + sum;
        }
        /* acc = acc·alpha + P·V: per chunk of DC dims, RB rows at a time (2·RB vector chains) */
        const float *pf = (const float *)st; /* p of key t, row r: pf[t * 32 + r] */
        const float *af = (const float *)alpha;
        for (int64_t r0 = 0; r0 < rb_end; r0 += RB) {
            for (int64_t c = 0; c < d; c += DC) {
                v16 a[RB][2];
                for (int rr = 0; rr < RB; rr++) {
                    const float scale = af[r0 + rr];
                    a[rr][0] = *(v16 *)&acc[r0 + rr][c] * scale;
                    a[rr][1] = *(v16 *)&acc[r0 + rr][c + 16] * scale;
                }
                for (int64_t t = 0; t < nk; t++) {
                    const v16 va = *(const v16 *)&vf[t][c], vc = *(const v16 *)&vf[t][c + 16];
                    for (int rr = 0; rr < RB; rr++) {
                        const float pt = pf[t * 32 + r0 + rr];
                        a[rr][0] += pt * va;
                        a[rr][1] += pt * vc;
                    }
                }
                for (int rr = 0; rr < RB; rr++) {
                    *(v16 *)&acc[r0 + rr][c] = a[rr][0];
                    *(v16 *)&acc[r0 + rr][c + 16] = a[rr][1];
                }
            }
        }
    }
    const float *mf = (const float *)m, *lf = (const float *)l;
    for (int64_t r = 0; r < nq; r++) {
        const int64_t b = members[(q0 + r) / g], head = j * g + (q0 + r) % g;
        const int64_t at = (b * 2 + part) * h + head;
        memcpy(part_acc + at * d, acc[r], (size_t)d * sizeof(float));
        part_m[at] = mf[r];
        part_l[at] = lf[r];
    }
}

/* Returns 0, or -1 when a size is out of range (nothing is written then).
 *
 * seg_slot_start [S + 1]: segment s's slots are slots[seg_slot_start[s] .. seg_slot_start[s+1]);
 * seg_member_start [S + 1]: its requests are members[seg_member_start[s] .. [s+1]);
 * seg_part [S]: the part (0 or 1) its results go to; num_parts [B]: 1 or 2 per request.
 * part_acc [B, 2, H, D], part_m and part_l [B, 2, H]: float32 scratch. */
int radixrt_decode_attention(const void *q, const void *k_buf, const void *v_buf, void *out,
                             int is_bf16, int64_t b, int64_t h, int64_t kh, int64_t d, float scaling,
                             int64_t num_segments, const int64_t *slots, const int64_t *seg_slot_start,
                             const int64_t *members, const int64_t *seg_member_start,
                             const int64_t *seg_part, const int64_t *num_parts,
                             float *part_acc, float *part_m, float *part_l, int num_threads) {
    if (d > DMAX || d <= 0 || d % DC != 0 || kh <= 0 || h % kh != 0 || num_threads < 1) return -1;
    const int64_t g = h / kh;
    /* Work items: per segment, KH × ceil(members·G / QB). */
    int64_t items = 0;
    for (int64_t s = 0; s < num_segments; s++) {
        int64_t rows = (seg_member_start[s + 1] - seg_member_start[s]) * g;
        items += kh * ((rows + QB - 1) / QB);
    }
    int64_t next = 0;
#pragma omp parallel num_threads(num_threads)
    {
        for (;;) {
            int64_t item = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
            if (item >= items) break;
            /* find the item's segment (segments are few: a linear walk) */
            int64_t s = 0, rows = 0, blocks = 0;
            for (;; s++) {
                rows = (seg_member_start[s + 1] - seg_member_start[s]) * g;
                blocks = (rows + QB - 1) / QB;
                if (item < kh * blocks) break;
                item -= kh * blocks;
            }
            int64_t j = item / blocks, q0 = (item % blocks) * QB;
            int64_t nq = rows - q0 < QB ? rows - q0 : QB;
            attend_item(q, k_buf, v_buf, is_bf16, h, kh, d, scaling, slots + seg_slot_start[s],
                        seg_slot_start[s + 1] - seg_slot_start[s], members + seg_member_start[s],
                        seg_part[s], j, q0, nq, part_acc, part_m, part_l);
        }
    }
    /* Merge the parts of every (request, head). */
#pragma omp parallel for num_threads(num_threads)
    for (int64_t bh = 0; bh < b * h; bh++) {
        int64_t req = bh / h, head = bh % h;
        int64_t a0 = (req * 2) * h + head, a1 = (req * 2 + 1) * h + head;
        float w0 = 1.0f, w1 = 0.0f, m = part_m[a0], total = part_l[a0];
        if (num_parts[req] == 2) {
            float mx = part_m[a1] > m ? part_m[a1] : m;
            w0 = expf(m - mx);
            w1 = expf(part_m[a1] - mx);
            total = part_l[a0] * w0 + part_l[a1] * w1;
        }
        float inv = total > 0.0f ? 1.0f / total : 0.0f;
        const float *o0 = part_acc + a0 * d, *o1 = part_acc + a1 * d;
        if (is_bf16) {
            bf16 *dst = (bf16 *)out + bh * d;
            for (int64_t i = 0; i < d; i++)
                dst[i] = f32_to_bf16((w0 * o0[i] + (w1 != 0.0f ? w1 * o1[i] : 0.0f)) * inv);
        } else {
            float *dst = (float *)out + bh * d;
            for (int64_t i = 0; i < d; i++) dst[i] = (w0 * o0[i] + (w1 != 0.0f ? w1 * o1[i] : 0.0f)) * inv;
        }
    }
    return 0;
}
