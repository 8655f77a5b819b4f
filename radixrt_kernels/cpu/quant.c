/* Linear layers on GGUF-quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K):
 * packing (radixrt_quant_pack: GGUF blocks to quant.h's layout), the activation quantization,
 * the portable kernel, and the call (radixrt_quant_linear) that runs one path's kernels.
 *
 * The arithmetic is radixrt/quant/arithmetic.py's, on every path: x quantized per block of 32
 * to int8 (dx = amax / 127, xq = rne(x · 127 / amax)), integer dot products per sub-block
 * (exact), and per output one float32 chain over the sub-blocks in ascending k:
 *     acc = acc + (a_j · dx_b) · (float)isum_j ;  acc = acc + (c_j · dx_b) · (float)sx_j
 * each operation rounded on its own (no contraction into FMA: the pragma below), then + bias
 * and one rounding to the output dtype. Paths differ only in how they get the exact integer
 * sums and in which outputs share a vector (lanes = output rows), so every path, row count
 * and thread count gives the same bits.
 *
 * Threads split work items (panel of 16 outputs, pass of PASS rows; AMX_PASS on AMX tiles),
 * panel-major, in contiguous shares; each output is computed whole by one thread. The call runs
 * in two parts (quant.h) so that the chain (chain.c) runs it as a step of its own parallel
 * region.
 */
#pragma GCC optimize("fp-contract=off")
#include <float.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "quant.h"

#define PASS 64               /* rows per work item */
#define TINY 0x1p-120f        /* amax below this: a zero block (127 / amax stays finite) */
#define PARALLEL_MIN (1 << 16) /* multiply-adds from which a call is shared by threads */

enum { PATH_PORTABLE, PATH_AVX2, PATH_AVX512, PATH_AMX, PATHS };
#define AMX_ROWS 32 /* rows from which a call runs on AMX tiles where it may */

/* ---- fp16 and the raw GGUF blocks ---------------------------------------------------------- */

static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 31u, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else {
        const float f = (float)man * 0x1p-24f; /* exact: a subnormal half is man · 2^-24 */
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t rd16(const uint8_t *p) {
    return (uint16_t)(p[0] | p[1] << 8);
}

/* One GGUF block of one row, unpacked: the stored values q (Q8_0: the int8's bits) and fields. */
struct rawblk {
    uint16_t d, m;
    uint8_t sc[16], mn[8];
    uint8_t q[256];
};

static void nibbles(const uint8_t *qs, int len, uint8_t *q) { /* len low nibbles, then the highs */
    for (int i = 0; i < len; i++) {
        q[i] = qs[i] & 15;
        q[len + i] = qs[i] >> 4;
    }
}

static void decode_32(int qt, const uint8_t *s, struct rawblk *b) {
    b->d = rd16(s);
    if (qt == Q8_0) {
        memcpy(b->q, s + 2, 32);
        return;
    }
    const int has_m = qt == Q4_1 || qt == Q5_1, at = has_m ? 4 : 2;
    if (has_m) b->m = rd16(s + 2);
    if (qt == Q4_0 || qt == Q4_1) {
        nibbles(s + at, 16, b->q);
        return;
    }
    const uint32_t qh = (uint32_t)s[at] | (uint32_t)s[at + 1] << 8 | (uint32_t)s[at + 2] << 16 |
                        (uint32_t)s[at + 3] << 24;
    nibbles(s + at + 4, 16, b->q);
    for (int i = 0; i < 32; i++) b->q[i] |= ((qh >> i) & 1u) << 4;
}

static void decode_k(int qt, const uint8_t *s, struct rawblk *b) {
    if (qt == Q6_K) {
        const uint8_t *ql = s, *qh = s + 128;
        memcpy(b->sc, s + 192, 16);
        b->d = rd16(s + 208);
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < 128; r++)
                b->q[128 * h + r] = (uint8_t)(((ql[64 * h + r % 64] >> (4 * (r / 64))) & 15) |
                                              ((qh[32 * h + r % 32] >> (2 * (r / 32))) & 3) << 4);
        return;
    }
    const uint8_t *sc = s + 4;
    b->d = rd16(s);
    b->m = rd16(s + 2);
    for (int j = 0; j < 4; j++) {
        b->sc[j] = sc[j] & 63;
        b->mn[j] = sc[4 + j] & 63;
        b->sc[4 + j] = (sc[8 + j] & 15) | ((sc[j] >> 2) & 48);
        b->mn[4 + j] = (sc[8 + j] >> 4) | ((sc[4 + j] >> 2) & 48);
    }
    const uint8_t *qs = s + (qt == Q4_K ? 16 : 48);
    for (int c = 0; c < 4; c++) nibbles(qs + 32 * c, 32, b->q + 64 * c);
    if (qt == Q5_K)
        for (int j = 0; j < 8; j++)
            for (int l = 0; l < 32; l++) b->q[32 * j + l] |= ((s[16 + l] >> j) & 1) << 4;
}

/* ---- records ------------------------------------------------------------------------------ */

static void put16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

/* Block b of one row into lane o of record rec (zeroed beforehand). */
static void place(const struct qlayout *L, uint8_t *rec, int o, const struct rawblk *b) {
    put16(rec + L->d_at + 2 * o, b->d);
    if (L->m_at >= 0) put16(rec + L->m_at + 2 * o, b->m);
    for (int j = 0; L->sc_at >= 0 && j < (L->a_kind == A_DSC16 ? 16 : 8); j++) rec[L->sc_at + 16 * j + o] = b->sc[j];
    for (int j = 0; L->mn_at >= 0 && j < 8; j++) rec[L->mn_at + 16 * j + o] = b->mn[j];
    for (int i = 0; i < L->qk; i++) {
        const int blk = i / 32, k = i % 32, v = k / 8, t = k % 4, hi = (k % 8) / 4;
        const uint8_t q = b->q[i];
        uint8_t *ql = rec + L->ql_at + blk * L->ql_stride, *qh = rec + L->qh_at + blk * L->qh_stride;
        if (L->bits == 8) {
            ql[64 * (k / 4) + 4 * o + t] = q;
            continue;
        }
        ql[64 * v + 4 * o + t] |= (uint8_t)((q & 15) << (4 * hi));
        if (L->bits == 5) qh[4 * o + t] |= (uint8_t)(((q >> 4) & 1) << (2 * v + hi));
        if (L->bits == 6) qh[64 * (v / 2) + 4 * o + t] |= (uint8_t)(((q >> 4) & 3) << (4 * (v % 2) + 2 * hi));
    }
}

int64_t radixrt_quant_packed_bytes(int ggml, int64_t n, int64_t k);

static int type_index(int ggml) {
    for (int t = 0; t < QTYPES; t++)
        if (LAYOUTS[t].ggml == ggml) return t;
    return -1;
}

/* raw [n] rows (raw_stride bytes apart) of k / qk GGUF blocks each into out (packed_bytes). */
int radixrt_quant_pack(int ggml, const uint8_t *raw, int64_t raw_stride, int64_t n, int64_t k, uint8_t *out) {
    const int qt = type_index(ggml);
    if (qt < 0 || n <= 0 || k <= 0 || k % LAYOUTS[qt].qk != 0) return -1;
    const struct qlayout *L = &LAYOUTS[qt];
    const int64_t blocks = k / L->qk, panels = (n + LANES - 1) / LANES;
    memset(out, 0, (size_t)radixrt_quant_packed_bytes(ggml, n, k));
#pragma omp parallel for schedule(static) if (n * k >= (1 << 20))
    for (int64_t p = 0; p < panels; p++) {
        struct rawblk b;
        for (int64_t s = 0; s < blocks; s++)
            for (int o = 0; o < LANES && p * LANES + o < n; o++) {
                const uint8_t *src = raw + (p * LANES + o) * raw_stride + s * L->type_size;
                memset(&b, 0, sizeof b);
                (L->qk == 32 ? decode_32 : decode_k)(qt, src, &b);
                place(L, out + (p * blocks + s) * L->rec, o, &b);
            }
    }
    return 0;
}

int64_t radixrt_quant_packed_bytes(int ggml, int64_t n, int64_t k) {
    const int qt = type_index(ggml);
    if (qt < 0 || n <= 0 || k <= 0 || k % LAYOUTS[qt].qk != 0) return -1;
    return (n + LANES - 1) / LANES * (k / LAYOUTS[qt].qk) * LAYOUTS[qt].rec;
}

/* ---- the portable kernel ---------------------------------------------------------------------- */

/* 32-block j of record rec (j: its index within the record's GGUF block) as integers w [8][64]
 * (quant.h's vectors: w[u][4o + t] is lane o's value 4u + t), per-lane scales a [2][16]
 * (sub-blocks of 16: a[0] for values 0-15, a[1] for 16-31; else both the same) and offsets
 * c [16] (zero where the type has none). */
static inline __attribute__((always_inline)) void unpack_portable(const struct qlayout *L, const uint8_t *rec,
                                                                   int j, int16_t w[8][64],
                                                                   float a[2][LANES], float c[LANES]) {
    const uint8_t *ql = rec + L->ql_at + j * L->ql_stride, *qh = rec + L->qh_at + j * L->qh_stride;
    for (int v = 0; v < (L->bits == 8 ? 8 : 4); v++)
        for (int i = 0; i < 64; i++) {
            const int b = ql[64 * v + i];
            if (L->bits == 8) {
                w[v][i] = (int8_t)b;
                continue;
            }
            int lo = b & 15, hi = b >> 4;
            if (L->bits == 5) {
                lo |= ((qh[i] >> (2 * v)) & 1) << 4;
                hi |= ((qh[i] >> (2 * v + 1)) & 1) << 4;
            }
            if (L->bits == 6) {
                const int h = qh[64 * (v / 2) + i] >> (4 * (v % 2));
                lo |= (h & 3) << 4;
                hi |= ((h >> 2) & 3) << 4;
            }
            w[2 * v][i] = (int16_t)(lo - L->off);
            w[2 * v + 1][i] = (int16_t)(hi - L->off);
        }
    for (int o = 0; o < LANES; o++) {
        const float d = half_to_float(rd16(rec + L->d_at + 2 * o));
        for (int h = 0; h < 2; h++) {
            a[h][o] = d;
            if (L->a_kind == A_DSC) a[h][o] = d * (float)rec[L->sc_at + 16 * j + o];
            if (L->a_kind == A_DSC16) a[h][o] = d * (float)(int8_t)rec[L->sc_at + 16 * (2 * j + h) + o];
        }
        c[o] = 0.0f;
        if (L->c_kind == C_M) c[o] = half_to_float(rd16(rec + L->m_at + 2 * o));
        if (L->c_kind == C_DMIN)
            c[o] = -(half_to_float(rd16(rec + L->m_at + 2 * o)) * (float)rec[L->mn_at + 16 * j + o]);
    }
}

/* One row's chain over one 32-block: acc [16] continued. */
static inline __attribute__((always_inline)) void chain_portable(const struct qlayout *L, const int16_t w[8][64], const float a[2][LANES],
                           const float c[LANES], const int8_t *xq, float dx, const int32_t *sx16,
                           float *acc) {
    const int halves = L->a_kind == A_DSC16 ? 2 : 1, len = 32 / halves;
    for (int h = 0; h < halves; h++) {
        int32_t isum[LANES] = {0};
        for (int u = h * len / 4; u < (h + 1) * len / 4; u++)
            for (int t = 0; t < 4; t++)
                for (int o = 0; o < LANES; o++) isum[o] += w[u][4 * o + t] * xq[4 * u + t];
        for (int o = 0; o < LANES; o++) acc[o] = acc[o] + (a[h][o] * dx) * (float)isum[o];
    }
    if (L->c_kind == C_NONE) return;
    const float sx = (float)(sx16[0] + sx16[1]);
    for (int o = 0; o < LANES; o++) acc[o] = acc[o] + (c[o] * dx) * sx;
}

/* (qt a constant at each call: the type's layout folds into the loops) */
static inline __attribute__((always_inline)) void panel_portable(const struct qcall *c, int64_t p, int64_t r0,
                                                                 int rows, const int qt) {
    const struct qlayout *L = &LAYOUTS[qt];
    const int per = L->qk / 32;
    const int64_t nb = c->k / 32, blocks = c->k / L->qk;
    float acc[PASS][LANES];
    int16_t w[8][64];
    float a[2][LANES], off[LANES];
    memset(acc, 0, sizeof acc);
    for (int64_t b = 0; b < nb; b++) {
        unpack_portable(L, c->packed + (p * blocks + b / per) * L->rec, (int)(b % per), w, a, off);
        for (int r = 0; r < rows; r++) {
            const int64_t row = r0 + r;
            chain_portable(L, w, a, off, c->xq + row * c->k + 32 * b, c->dx[row * nb + b],
                           c->sx16 + row * (c->k / 16) + 2 * b, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) quant_store(c, r0 + r, p, acc[r]);
}

#define PANEL_PORTABLE(T) \
    static void panel_portable_##T(const struct qcall *c, int64_t p, int64_t r0, int rows) { \
        panel_portable(c, p, r0, rows, T); \
    }
PANEL_PORTABLE(Q8_0) PANEL_PORTABLE(Q4_0) PANEL_PORTABLE(Q4_1) PANEL_PORTABLE(Q5_0) PANEL_PORTABLE(Q5_1)
PANEL_PORTABLE(Q4_K) PANEL_PORTABLE(Q5_K) PANEL_PORTABLE(Q6_K)
static const panel_fn PORTABLE_KERNELS[QTYPES] = {
    panel_portable_Q8_0, panel_portable_Q4_0, panel_portable_Q4_1, panel_portable_Q5_0,
    panel_portable_Q5_1, panel_portable_Q4_K, panel_portable_Q5_K, panel_portable_Q6_K};

/* The packed weight [n, k] as float32 a·w + c (gguf's dequantized values), into out [n][k]. */
int radixrt_quant_dequantize(int ggml, const uint8_t *packed, int64_t n, int64_t k, float *out) {
    const int qt = type_index(ggml);
    if (radixrt_quant_packed_bytes(ggml, n, k) < 0) return -1;
    const struct qlayout *L = &LAYOUTS[qt];
    const int per = L->qk / 32;
    const int64_t nb = k / 32, blocks = k / L->qk;
    for (int64_t p = 0; p < (n + LANES - 1) / LANES; p++) {
        int16_t w[8][64];
        float a[2][LANES], off[LANES];
        for (int64_t b = 0; b < nb; b++) {
            unpack_portable(L, packed + (p * blocks + b / per) * L->rec, (int)(b % per), w, a, off);
            for (int o = 0; o < LANES && p * LANES + o < n; o++)
                for (int i = 0; i < 32; i++) {
                    const float y = a[i / 16][o] * (float)w[i / 4][4 * o + i % 4];
                    out[(p * LANES + o) * k + 32 * b + i] = L->c_kind == C_NONE ? y : y + off[o];
                }
        }
    }
    return 0;
}

/* Rows ids[0 .. count) of a packed weight [n, k] as float32 (bf16 where out_bf16, rounded once):
 * radixrt_quant_dequantize's values of those rows (an embedding's lookup in a tied LM head's
 * blocks). Returns -1 for a size or an id out of range. */
int radixrt_quant_rows_packed(int ggml, const uint8_t *packed, int64_t n, int64_t k, const int64_t *ids,
                              int64_t count, void *out, int out_bf16) {
    const int qt = type_index(ggml);
    if (radixrt_quant_packed_bytes(ggml, n, k) < 0 || count < 0) return -1;
    for (int64_t r = 0; r < count; r++)
        if (ids[r] < 0 || ids[r] >= n) return -1;
    const struct qlayout *L = &LAYOUTS[qt];
    const int per = L->qk / 32;
    const int64_t nb = k / 32, blocks = k / L->qk;
    for (int64_t r = 0; r < count; r++) {
        const int64_t p = ids[r] / LANES, o = ids[r] % LANES;
        int16_t w[8][64];
        float a[2][LANES], off[LANES];
        for (int64_t b = 0; b < nb; b++) {
            unpack_portable(L, packed + (p * blocks + b / per) * L->rec, (int)(b % per), w, a, off);
            for (int i = 0; i < 32; i++) {
                const float y = a[i / 16][o] * (float)w[i / 4][4 * o + i % 4];
                const float v = L->c_kind == C_NONE ? y : y + off[o];
                if (out_bf16)
                    ((bf16 *)out)[r * k + 32 * b + i] = f32_to_bf16(v);
                else
                    ((float *)out)[r * k + 32 * b + i] = v;
            }
        }
    }
    return 0;
}

/* Value i (0 .. qk - 1) of a decoded block: a·w + c, with unpack_portable's a and c. */
static float raw_value(const struct qlayout *L, const struct rawblk *b, int i) {
    const float d = half_to_float(b->d);
    const int w = L->bits == 8 ? (int8_t)b->q[i] : b->q[i] - L->off;
    float a = d, c = 0.0f;
    if (L->a_kind == A_DSC) a = d * (float)b->sc[i / 32];
    if (L->a_kind == A_DSC16) a = d * (float)(int8_t)b->sc[i / 16];
    if (L->c_kind == C_M) c = half_to_float(b->m);
    if (L->c_kind == C_DMIN) c = -(half_to_float(b->m) * (float)b->mn[i / 32]);
    const float y = a * (float)w;
    return L->c_kind == C_NONE ? y : y + c;
}

/* Rows ids[0 .. count - 1] of raw GGUF blocks (n rows raw_stride bytes apart, k values each), as
 * gguf's dequantized values a·w + c, into out [count][k]: bf16 where out_bf16 (rounded once),
 * else float32. Returns -1 (writing nothing) on a type or K it does not take or an id outside
 * 0 .. n - 1. */
int radixrt_quant_rows(int ggml, const uint8_t *raw, int64_t raw_stride, int64_t n, const int64_t *ids,
                       int64_t count, int64_t k, void *out, int out_bf16) {
    const int qt = type_index(ggml);
    if (radixrt_quant_packed_bytes(ggml, n, k) < 0 || count < 0) return -1;
    for (int64_t r = 0; r < count; r++)
        if (ids[r] < 0 || ids[r] >= n) return -1;
    const struct qlayout *L = &LAYOUTS[qt];
    for (int64_t r = 0; r < count; r++)
        for (int64_t s = 0; s < k / L->qk; s++) {
            struct rawblk b;
            memset(&b, 0, sizeof b);
            (L->qk == 32 ? decode_32 : decode_k)(qt, raw + ids[r] * raw_stride + s * L->type_size, &b);
            for (int i = 0; i < L->qk; i++) {
                const float v = raw_value(L, &b, i);
                const int64_t at = r * k + s * L->qk + i;
                if (out_bf16)
                    ((bf16 *)out)[at] = f32_to_bf16(v);
                else
                    ((float *)out)[at] = v;
            }
        }
    return 0;
}

/* ---- activations, output, the call ------------------------------------------------------------ */

/* Block b of row x (k values, float32 or bf16) quantized: xq [32], dx [1], sx16 [2]. */
static void quantize_block(const void *x, int x_bf16, int64_t b, int8_t *xq, float *dx, int32_t *sx16) {
    float v[XB], amax = 0.0f;
    int bad = 0;
    for (int i = 0; i < XB; i++) {
        v[i] = load1(x, b * XB + i, x_bf16);
        const float ax = v[i] < 0 ? -v[i] : v[i];
        amax = ax > amax ? ax : amax;
        bad |= !(ax <= FLT_MAX); /* inf or NaN */
    }
    const int live = !bad && amax >= TINY;
    const float id = live ? 127.0f / amax : 0.0f;
    dx[0] = bad ? __builtin_nanf("") : live ? amax / 127.0f : 0.0f;
    for (int h = 0; h < 2; h++) {
        int32_t s = 0;
        for (int i = 16 * h; i < 16 * h + 16; i++) {
            /* rne(v · id) by the 1.5 · 2^23 trick (|v · id| <= 127.5) */
            const float r = live ? (v[i] * id + 0x1.8p23f) - 0x1.8p23f : 0.0f;
            xq[i] = (int8_t)(int)r;
            s += (int)r;
        }
        sx16[h] = s;
    }
}

void quant_store(const struct qcall *c, int64_t r, int64_t p, const float *acc) {
    const int64_t n0 = p * LANES, cols = c->n - n0 < LANES ? c->n - n0 : LANES;
    for (int64_t o = 0; o < cols; o++) {
        const float v = c->bias ? acc[o] + load1(c->bias, n0 + o, c->bias_bf16) : acc[o];
        if (c->y_bf16)
            ((bf16 *)c->y)[r * c->y_stride + n0 + o] = f32_to_bf16(v);
        else
            ((float *)c->y)[r * c->y_stride + n0 + o] = v;
    }
}

static panel_fn kernel_for(int path, int qt) {
    if (path == PATH_PORTABLE) return PORTABLE_KERNELS[qt];
    if (path == PATH_AVX2) return quant_avx2_kernel(qt);
    if (path == PATH_AVX512) return quant_avx512_kernel(qt);
    if (path == PATH_AMX) return quant_amx_kernel(qt);
    return NULL;
}

/* The path a call of `rows` rows of type ggml runs (-1 where the type is unknown): AMX tiles
 * from AMX_ROWS rows on, else the widest vectors. */
int radixrt_quant_path(int ggml, int64_t rows) {
    const int qt = type_index(ggml);
    if (qt < 0) return -1;
    if (rows >= AMX_ROWS && kernel_for(PATH_AMX, qt) != NULL) return PATH_AMX;
    for (int path = PATH_AMX - 1; path > 0; path--)
        if (kernel_for(path, qt) != NULL) return path;
    return PATH_PORTABLE;
}

int radixrt_quant_setup(struct qcall *c, int ggml, int path) {
    const int qt = type_index(ggml);
    if (radixrt_quant_packed_bytes(ggml, c->n, c->k) < 0 || c->m < 0 || c->x_stride < c->k || c->y_stride < c->n)
        return -1;
    c->L = &LAYOUTS[qt];
    c->panel_bytes = c->k / c->L->qk * c->L->rec;
    const int chosen = path < 0 ? radixrt_quant_path(ggml, c->m) : path;
    c->fn = kernel_for(chosen, qt);
    c->pass = chosen == PATH_AMX ? AMX_PASS : PASS;
    return c->fn == NULL ? -1 : 0;
}

static int64_t round64(int64_t bytes) {
    return (bytes + 63) / 64 * 64;
}

int64_t radixrt_quant_scratch_bytes(int64_t m, int64_t k) {
    return round64(m * k) + round64(m * k / XB * 4) + round64(m * k / 16 * 4);
}

void radixrt_quant_scratch(struct qcall *c, void *buf) {
    const int64_t mk = c->m * c->k;
    c->xq = buf;
    c->dx = (float *)((char *)buf + round64(mk));
    c->sx16 = (int32_t *)((char *)buf + round64(mk) + round64(mk / XB * 4));
}

/* Threads split x's (row, block) pairs in contiguous shares: each block is quantized alone. */
void radixrt_quant_x_part(const struct qcall *c, int64_t id, int64_t threads) {
    const int64_t nb = c->k / XB, units = c->m * nb, size = c->x_bf16 ? 2 : 4;
    for (int64_t u = units * id / threads; u < units * (id + 1) / threads; u++) {
        const int64_t r = u / nb, b = u % nb;
        quantize_block((const char *)c->x + r * c->x_stride * size, c->x_bf16, b, c->xq + r * c->k + b * XB,
                       c->dx + u, c->sx16 + 2 * u);
    }
}

/* Threads split the work items (panel, pass of c->pass rows), panel-major, in contiguous shares. */
void radixrt_quant_items_part(const struct qcall *c, int64_t id, int64_t threads) {
    const int64_t pass = c->pass, passes = (c->m + pass - 1) / pass;
    const int64_t items = (c->n + LANES - 1) / LANES * passes;
    for (int64_t item = items * id / threads; item < items * (id + 1) / threads; item++) {
        const int64_t r0 = item % passes * pass;
        c->fn(c, item / passes, r0, (int)(c->m - r0 < pass ? c->m - r0 : pass));
    }
}

/* y [m, n] (rows y_stride apart; bf16 where y_bf16, else float32) = x [m, k] (rows x_stride
 * apart; bf16 where x_bf16) · Wᵀ + bias (NULL, or [n]: bf16 where bias_bf16, else float32), W
 * packed by radixrt_quant_pack; by `path` (-1: radixrt_quant_path's). Returns -1 (writing
 * nothing) on a type, size or path it does not take. */
int radixrt_quant_linear(int ggml, const void *x, int64_t x_stride, int x_bf16, const uint8_t *packed,
                         const void *bias, int bias_bf16, void *y, int64_t y_stride, int y_bf16, int64_t m,
                         int64_t n, int64_t k, int num_threads, int path) {
    struct qcall c = {.x = x, .x_stride = x_stride, .x_bf16 = x_bf16, .packed = packed, .bias = bias,
                      .bias_bf16 = bias_bf16, .y = y, .y_stride = y_stride, .y_bf16 = y_bf16, .m = m, .n = n, .k = k};
    if (num_threads < 1 || radixrt_quant_setup(&c, ggml, path) != 0) return -1;
    if (m == 0) return 0;
    void *scratch = aligned_alloc(64, (size_t)radixrt_quant_scratch_bytes(m, k));
    if (scratch == NULL) return -1;
    radixrt_quant_scratch(&c, scratch);
#pragma omp parallel num_threads(num_threads) if (m * n * k >= PARALLEL_MIN)
    {
        const int64_t id = omp_get_thread_num(), threads = omp_get_num_threads();
        radixrt_quant_x_part(&c, id, threads);
#pragma omp barrier
        radixrt_quant_items_part(&c, id, threads);
    }
    free(scratch);
    return 0;
}
/* 1 where `path` runs type ggml in this build. */
int radixrt_quant_path_available(int ggml, int path) {
    const int qt = type_index(ggml);
    return qt >= 0 && path >= 0 && path < PATHS && kernel_for(path, qt) != NULL;
}
