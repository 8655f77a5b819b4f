/* Linear layers on the CPU without AMX: y = x·Wᵀ (+ bias) on the packed weights of linear_amx.c.
 *
 * Two kernels read the same packed layout (per block of NB output features and chunk of KC
 * input features, two tiles of 16 K-pairs × 16 features × 2), a K-pair of 16 features being
 * 16 dwords whose low half is the even input feature and whose high half the odd one:
 * - FMA: bf16 weights widened to float32 on the fly (the low half shifted up, the high half
 *   masked: one instruction per 16 values) and multiplied with float32 FMA by x converted to
 *   float32 once per call. Built for AVX-512 (MR_FMA rows × 2 tiles of accumulators in
 *   registers) or the build's narrower vectors (AVX2, SSE, NEON: 4 rows, one tile at a
 *   time; 1-2 rows over both tiles). In builds with FMA but without AVX-512 (AVX2), calls of
 *   WIDE_MIN_ROWS rows or more take the widened path instead: each thread widens a group of its
 *   blocks to float32 once per call, into a buffer it keeps, and every pass multiplies from
 *   there, MR_W rows × WV vectors of accumulators at a time.
 * - DPBF16 (AVX512-BF16): vdpbf16ps on the pairs as they are, x's pairs broadcast.
 * The FMA kernel computes each output as one chain over the input features in order from 0
 * (an FMA per feature; a multiply and an add in a build without FMA), whatever its path,
 * register block, pass or thread count: the bits of linear_f32 on the same weights. DPBF16
 * adds its pairs' products in input-feature order. Both kernels' float32 sums are written by
 * linear_out.h, as the AMX kernel's are (bias in float32, one rounding to bf16; the gated and
 * rotary epilogues). Threads split the blocks as the AMX kernel does; with more than 64 rows a
 * thread takes its blocks in groups that stay in L2 while every pass of rows runs over them.
 */
#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "linear_out.h"
#include "parts.h"

#define TILE_DWORDS 256       /* one 16-pair × 16-feature tile as dwords */
#define GROUP 16              /* blocks per group with more than two passes, at most ... */
#define GROUP_BYTES (3 << 19) /* ... and about this much weight */
#define PREFETCH_AHEAD 32768  /* bytes of the weight stream fetched ahead, into L2 (PF_FAR) ... */
#define PREFETCH_NEAR 16384   /* ... or into L1 (PF_NEAR) */
#define PF_FAR 1              /* a pass of several row panels: they read each block again */
#define PF_NEAR 2             /* a pass of one panel: each line is read once */

#ifdef __AVX512F__
#define MR_FMA 12 /* rows per FMA register block (2 tiles: 24 accumulators) */
#define NT_FMA 2  /* tiles per FMA register block */
#else
#define MR_FMA 4 /* 4 rows × one tile (16 features) in the build's vectors (vf, common.h) */
#define NT_FMA 1
#endif
/* The FMA kernel's widened path: builds with FMA but not AVX-512 (whose register block takes
 * both tiles of a chunk, the widening shared by 12 rows), calls of WIDE_MIN_ROWS rows or more
 * (prefills: decode-sized calls stream their weights once and keep the packed path). */
#if !defined(__AVX512F__) && defined(__FMA__)
#define WIDE 1
#else
#define WIDE 0
#endif
#define WIDE_MIN_ROWS 65     /* from this many rows */
#define MR_W 6               /* rows per register block ... */
#define WV 2                 /* ... by this many vectors of VL features: 12 accumulators */
#define WIDE_PASS 24         /* rows per pass (whole register blocks) */
#define WIDE_SEGMENT 256     /* input features per segment */
#define WIDE_BYTES (1 << 20) /* float32 weights a thread widens per group, about (at least a unit) */
#define MR_DP 12
#define SEGMENT 8 /* chunks per segment: 16 KiB of weights */
#define WIDEN_PARALLEL_MIN 65536 /* x values widened by the threads together from here */

typedef uint32_t v16w __attribute__((vector_size(64))); /* a K-pair of 16 features */

/* Fetch the two cache lines past pair p of a chunk (2 KB: 16 pairs × 2 lines) that the stream
 * reads PREFETCH_AHEAD bytes later, into L2 (PF_FAR: the panels of a pass share L1 for the
 * block they all read), or PREFETCH_NEAR bytes later, into L1 (PF_NEAR: one panel reads each
 * line once, and L1 holds nothing else worth keeping): spread over the products, so the
 * stream flows without a burst of prefetches filling the line buffers. Past the end of the
 * weights it fetches nothing that matters. */
static inline void stream_ahead(const uint32_t *chunk, int p, int pf) {
    if (pf == PF_NEAR) {
        const char *at = (const char *)chunk + PREFETCH_NEAR + p * 128;
        __builtin_prefetch(at, 0, 3);
        __builtin_prefetch(at + 64, 0, 3);
        return;
    }
    const char *at = (const char *)chunk + PREFETCH_AHEAD + p * 128;
    __builtin_prefetch(at, 0, 2);
    __builtin_prefetch(at + 64, 0, 2);
}

static inline v16w load_pairs(const uint32_t *p) {
    v16w w;
    memcpy(&w, p, sizeof w);
    return w;
}

#ifdef __AVX512F__
/* acc[i][16·t ..] (+)= the products of chunks c0 .. c1 - 1 for the mr rows of a panel of x
 * (float32 [k][mr]: input feature by input feature, its rows side by side) and tiles t0 ..
 * t0 + NT_FMA - 1 of one block (w: its chunks, as dwords); the sums start from acc where
 * c0 > 0. */
static inline __attribute__((always_inline)) void fma_rows(int mr, const float *x,
                                                           const uint32_t *w, int64_t c0, int64_t c1,
                                                           int t0, int pf, float (*acc)[NB]) {
    v16 a[MR_FMA][NT_FMA];
    for (int i = 0; i < MR_FMA; i++)
        for (int t = 0; t < NT_FMA; t++) {
            a[i][t] = (v16){0};
            if (c0 > 0 && i < mr) memcpy(&a[i][t], &acc[i][16 * (t0 + t)], sizeof(v16));
        }
    for (int64_t c = c0; c < c1; c++) {
        for (int p = 0; p < 16; p++) {
            v16 lo[NT_FMA], hi[NT_FMA];
            for (int t = 0; t < NT_FMA; t++) {
                const v16w d = load_pairs(w + (c * 2 + t0 + t) * TILE_DWORDS + p * 16);
                lo[t] = (v16)(d << 16);
                hi[t] = (v16)(d & 0xffff0000u);
            }
            if (pf) /* the weight stream ahead, two lines per pair */
                stream_ahead(w + c * 2 * TILE_DWORDS, p, pf);
            const float *xk = x + (c * KC + 2 * p) * mr;
#pragma GCC unroll 16
            for (int i = 0; i < mr; i++) {
                const float x0 = xk[i], x1 = xk[mr + i];
                for (int t = 0; t < NT_FMA; t++) {
                    a[i][t] += x0 * lo[t];
                    a[i][t] += x1 * hi[t];
                }
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int t = 0; t < NT_FMA; t++) memcpy(&acc[i][16 * (t0 + t)], &a[i][t], sizeof(v16));
}

#else
/* fma_rows for builds without AVX-512, over nt tiles from t0 (nt 2: a pass of 1-2 rows reads
 * each weight line once): the tiles' features as vectors of VL lanes, the same sums in the
 * same order. */
static inline __attribute__((always_inline)) void fma_rows_nt(int mr, int nt, const float *x,
                                                              const uint32_t *w, int64_t c0, int64_t c1,
                                                              int t0, int pf, float (*acc)[NB]) {
    vf a[MR_FMA][2][16 / VL];
    for (int i = 0; i < MR_FMA; i++)
        for (int t = 0; t < nt; t++)
            for (int h = 0; h < 16 / VL; h++) {
                a[i][t][h] = (vf){0};
                if (c0 > 0 && i < mr) memcpy(&a[i][t][h], &acc[i][16 * (t0 + t) + VL * h], sizeof(vf));
            }
    for (int64_t c = c0; c < c1; c++) {
        for (int p = 0; p < 16; p++) {
            if (pf) stream_ahead(w + c * 2 * TILE_DWORDS, p, pf);
            const float *xk = x + (c * KC + 2 * p) * mr;
            for (int t = 0; t < nt; t++) {
                vf lo[16 / VL], hi[16 / VL];
                for (int h = 0; h < 16 / VL; h++) {
                    vfu d;
                    memcpy(&d, w + (c * 2 + t0 + t) * TILE_DWORDS + p * 16 + VL * h, sizeof d);
                    lo[h] = (vf)(d << 16);
                    hi[h] = (vf)(d & 0xffff0000u);
                }
#pragma GCC unroll 16
                for (int i = 0; i < mr; i++) {
                    const float x0 = xk[i], x1 = xk[mr + i];
                    for (int h = 0; h < 16 / VL; h++) {
                        a[i][t][h] += x0 * lo[h];
                        a[i][t][h] += x1 * hi[h];
                    }
                }
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int t = 0; t < nt; t++)
            for (int h = 0; h < 16 / VL; h++)
                memcpy(&acc[i][16 * (t0 + t) + VL * h], &a[i][t][h], sizeof(vf));
}

static inline __attribute__((always_inline)) void fma_rows(int mr, const float *x,
                                                           const uint32_t *w, int64_t c0, int64_t c1,
                                                           int t0, int pf, float (*acc)[NB]) {
    fma_rows_nt(mr, 1, x, w, c0, c1, t0, pf, acc);
}
#endif

#if WIDE
/* ---- the widened path (see WIDE) ----
 * A thread widens a group's blocks to float32 once per call, [2 tiles][k][16 features] per
 * block, into a buffer of its own; every pass of the call then multiplies from it, MR_W rows
 * × WV vectors at a time, each sum continued by one FMA per input feature in order, as
 * fma_rows adds them: the same bits. x is read in radixrt_vec_widen's panels as they are. */

/* Block w (packed: chunks × 2 tiles × 16 K-pairs × 16 features) as float32 at out: feature
 * 16·t + f, input feature i at out[(t·k + i)·16 + f], k = chunks·KC. */
static void widen_block(const uint32_t *w, int64_t chunks, float *out) {
    const int64_t k = chunks * KC;
    for (int64_t c = 0; c < chunks; c++) {
        for (int t = 0; t < 2; t++)
            for (int p = 0; p < 16; p++) {
                const uint32_t *src = w + (c * 2 + t) * TILE_DWORDS + p * 16;
                float *lo = out + (t * k + c * KC + 2 * p) * 16, *hi = lo + 16;
                for (int h = 0; h < 16 / VL; h++) {
                    vfu d;
                    memcpy(&d, src + VL * h, sizeof d);
                    const vf l = (vf)(d << 16), u = (vf)(d & 0xffff0000u);
                    memcpy(lo + VL * h, &l, sizeof l);
                    memcpy(hi + VL * h, &u, sizeof u);
                }
            }
    }
}

/* acc[i][0 .. WV·VL - 1] for rows i < mr over input features k0 .. k1 - 1: row i's x value
 * for input kk at xr[i][kk·xs] (its panel of x widened, see radixrt_vec_widen), the weights
 * at wt[kk·16 ..] (a widened tile from some feature); the sums continue from acc, or start
 * at 0 where k0 is 0. */
static inline __attribute__((always_inline)) void wide_rows(int mr, const float *const *xr, int64_t xs,
                                                            const float *wt, int64_t k0, int64_t k1,
                                                            float (*acc)[NB], int col) {
    vf a[MR_W][WV];
#pragma GCC unroll 8
    for (int i = 0; i < MR_W; i++)
        for (int v = 0; v < WV; v++) {
            a[i][v] = (vf){0};
            if (k0 > 0 && i < mr) memcpy(&a[i][v], &acc[i][col + VL * v], sizeof(vf));
        }
#pragma GCC unroll 4
    for (int64_t kk = k0; kk < k1; kk++) {
        vf wv[WV];
        for (int v = 0; v < WV; v++) memcpy(&wv[v], wt + kk * 16 + VL * v, sizeof(vf));
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            const float xi = xr[i][kk * xs];
            for (int v = 0; v < WV; v++) a[i][v] += xi * wv[v];
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < WV; v++) memcpy(&acc[i][col + VL * v], &a[i][v], sizeof(vf));
}

/* wide_rows for n rows (1 .. MR_W), with n, and x's stride where the rows lie in whole panels,
 * constants in its loop. A function of its own: the 12 accumulators, 2 weight vectors and a broadcast take 15 of
 * AVX2's 16 registers, none left for a caller's values. */
static __attribute__((noinline)) void wide_register_block(int n, const float *const *xr, int64_t xs,
                                                          const float *wt, int64_t k0, int64_t k1,
                                                          float (*acc)[NB], int col) {
    if (xs != MR_FMA) { /* the last, partial panel's rows */
        wide_rows(n, xr, xs, wt, k0, k1, acc, col);
        return;
    }
    switch (n) {
#define WIDE_ROWS(c) \
    case c: wide_rows(c, xr, MR_FMA, wt, k0, k1, acc, col); break;
        WIDE_ROWS(1) WIDE_ROWS(2) WIDE_ROWS(3) WIDE_ROWS(4) WIDE_ROWS(5) WIDE_ROWS(6)
#undef WIDE_ROWS
    default: break;
    }
}

/* Rows r0 .. r0 + rows - 1 of x widened (m rows, k input features: panels of MR_FMA rows, the
 * last holding the rest) into acc (row r0 at acc[0]), input features k0 .. k1 - 1 of block wb
 * (widened). A register block takes rows that share a panel stride: rows of whole panels, or
 * of the last, partial one. */
static void wide_segment(const float *xf, int64_t m, int64_t k, int64_t r0, int rows, const float *wb,
                         int64_t k0, int64_t k1, float (*acc)[NB]) {
    const int64_t whole = m / MR_FMA * MR_FMA; /* rows in whole panels */
    for (int col = 0; col < NB; col += WV * VL) {
        const float *wt = wb + col / 16 * k * 16 + col % 16;
        for (int i = 0; i < rows;) {
            const int64_t j = r0 + i, xs = j < whole ? MR_FMA : m - whole;
            int64_t n = (j < whole ? whole : m) - j; /* rows up to the stride's end, at most MR_W */
            n = n < rows - i ? n : rows - i;
            n = n < MR_W ? n : MR_W;
            const float *xr[MR_W] = {0};
            for (int q = 0; q < n; q++) { /* row j + q: its panel, from the row's column */
                const int64_t p0 = j + q < whole ? (j + q) / MR_FMA * MR_FMA : whole;
                xr[q] = xf + p0 * k + (j + q - p0);
            }
            wide_register_block((int)n, xr, xs, wt, k0, k1, acc + i, col);
            i += (int)n;
        }
    }
}

/* One block's sums (wb: widened) for rows r0 .. r0 + rows - 1, over segments of WIDE_SEGMENT
 * input features (a segment's weights and x stay in L1 while every register block reads them). */
static void wide_block(const float *xf, int64_t m, int64_t k, int64_t r0, int rows, const float *wb,
                       float (*acc)[NB]) {
    for (int64_t k0 = 0; k0 < k; k0 += WIDE_SEGMENT)
        wide_segment(xf, m, k, r0, rows, wb, k0, k0 + WIDE_SEGMENT < k ? k0 + WIDE_SEGMENT : k, acc);
}

static pthread_key_t room_key; /* a thread's room, freed when the thread ends ... */
static pthread_once_t room_key_once = PTHREAD_ONCE_INIT;
static int room_key_made; /* ... where the key could be made (else no thread has room) */

static void room_key_create(void) {
    room_key_made = pthread_key_create(&room_key, free) == 0;
}

/* This thread's room for widened weights: grown to `floats` where smaller, kept for the
 * thread's life (reused by every call). NULL if it cannot be had. */
static float *wide_room(int64_t floats) {
    static __thread float *room;
    static __thread int64_t size;
    if (floats > size) {
        pthread_once(&room_key_once, room_key_create);
        if (!room_key_made) return NULL;
        free(room);
        size = 0;
        room = aligned_alloc(64, (size_t)floats * 4);
        pthread_setspecific(room_key, room);
        if (room == NULL) return NULL;
        size = floats;
    }
    return room;
}

/* Blocks b0 .. b1 - 1 of c's weights widened into this thread's room (block b at
 * (b - b0)·k·NB), or NULL where there is no room: the caller then reads the packed weights. */
static const float *widen_group(const struct vec_call *c, int64_t b0, int64_t b1) {
    const int64_t chunks = c->k / KC, block_elems = chunks * 2 * 512;
    float *room = wide_room((b1 - b0) * c->k * NB);
    if (room == NULL) return NULL;
    for (int64_t b = b0; b < b1; b++)
        widen_block((const uint32_t *)(c->packed + b * block_elems), chunks, room + (b - b0) * c->k * NB);
    return room;
}
#else
static const float *widen_group(const struct vec_call *c, int64_t b0, int64_t b1) {
    (void)c, (void)b0, (void)b1;
    return NULL;
}

static void wide_block(const float *xf, int64_t m, int64_t k, int64_t r0, int rows, const float *wb,
                       float (*acc)[NB]) {
    (void)xf, (void)m, (void)k, (void)r0, (void)rows, (void)wb, (void)acc;
}
#endif

/* Rows 0 .. rows - 1 of acc over chunks c0 .. c1 - 1 of tiles t0 .. t0 + NT_FMA - 1; x: the
 * pass's panels of MR_FMA rows (the last may have fewer), k input features each. */
static inline void fma_segment(const float *x, int64_t k, const uint32_t *w, int64_t c0, int64_t c1,
                               int t0, int rows, float (*acc)[NB]) {
    /* the first panel's first tile pass fetches ahead: into L1 where it is the only pass over
     * the segment (one panel, and the tiles of AVX-512's register block) */
    const int pf = t0 > 0 ? 0 : rows <= MR_FMA && NT_FMA == 2 ? PF_NEAR : PF_FAR;
    int r = 0;
    for (; r + MR_FMA <= rows; r += MR_FMA) fma_rows(MR_FMA, x + r * k, w, c0, c1, t0, r == 0 ? pf : 0, acc + r);
    switch (rows - r) { /* the last panel, with a register block of its own size */
#define FMA_REST(n) \
    case n: fma_rows(n, x + r * k, w, c0, c1, t0, r == 0 ? pf : 0, acc + r); break;
        FMA_REST(1) FMA_REST(2) FMA_REST(3)
#if MR_FMA > 4
        FMA_REST(4) FMA_REST(5) FMA_REST(6) FMA_REST(7) FMA_REST(8) FMA_REST(9) FMA_REST(10)
        FMA_REST(11)
#endif
#undef FMA_REST
    default: break;
    }
}

/* One block's sums for `rows` rows of x (panels, see fma_segment) into acc, over segments of
 * SEGMENT chunks (a segment's weights stay in L1 while every panel reads them). */
static void fma_block(const float *x, int64_t k, const uint32_t *w, int64_t chunks, int rows,
                      float (*acc)[NB]) {
    for (int64_t c0 = 0; c0 < chunks; c0 += SEGMENT) {
        const int64_t c1 = c0 + SEGMENT < chunks ? c0 + SEGMENT : chunks;
#ifndef __AVX512F__
        if (rows <= 2) { /* both tiles in one pass: the weight stream read once, fetched into L1 */
            if (rows == 1)
                fma_rows_nt(1, 2, x, w, c0, c1, 0, PF_NEAR, acc);
            else
                fma_rows_nt(2, 2, x, w, c0, c1, 0, PF_NEAR, acc);
            continue;
        }
#endif
        for (int t0 = 0; t0 < 2; t0 += NT_FMA) fma_segment(x, k, w, c0, c1, t0, rows, acc);
    }
}

#ifdef __AVX512BF16__
/* acc[i][..] for i < mr rows of x (bf16, xs apart) over one block's two tiles, by vdpbf16ps. */
static inline __attribute__((always_inline)) void dp_rows(int mr, const bf16 *x, int64_t xs,
                                                          const uint32_t *w, int64_t chunks, int pf,
                                                          float (*acc)[NB]) {
    __m512 a[MR_DP][2];
    for (int i = 0; i < MR_DP; i++) a[i][0] = a[i][1] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
        for (int p = 0; p < 16; p++) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + (c * 2) * TILE_DWORDS + p * 16);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + (c * 2 + 1) * TILE_DWORDS + p * 16);
            if (pf) stream_ahead(w + c * 2 * TILE_DWORDS, p, pf);
            const bf16 *xk = x + c * KC + 2 * p;
#pragma GCC unroll 16
            for (int i = 0; i < mr; i++) {
                int32_t pair;
                memcpy(&pair, xk + i * xs, 4);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                a[i][0] = _mm512_dpbf16_ps(a[i][0], xb, w0);
                a[i][1] = _mm512_dpbf16_ps(a[i][1], xb, w1);
            }
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm512_storeu_ps(&acc[i][0], a[i][0]);
        _mm512_storeu_ps(&acc[i][16], a[i][1]);
    }
}

static void dp_block(const bf16 *x, int64_t xs, const uint32_t *w, int64_t chunks, int rows,
                     float (*acc)[NB]) {
    /* The first panel fetches ahead into L2 (PF_FAR) whatever the rows, a lone panel too: L2
     * keeps more lines in flight than L1's miss buffers, and this kernel's stream needs them. */
    const int pf = PF_FAR;
    int r = 0;
    for (; r + MR_DP <= rows; r += MR_DP) dp_rows(MR_DP, x + r * xs, xs, w, chunks, r == 0 ? pf : 0, acc + r);
    switch (rows - r) {
#define DP_REST(n) \
    case n: dp_rows(n, x + r * xs, xs, w, chunks, r == 0 ? pf : 0, acc + r); break;
        DP_REST(1) DP_REST(2) DP_REST(3) DP_REST(4) DP_REST(5) DP_REST(6) DP_REST(7) DP_REST(8)
        DP_REST(9) DP_REST(10) DP_REST(11)
#undef DP_REST
    default: break;
    }
}
#endif

/* 1 if radixrt_linear_vec runs `kernel` in this build, else 0. */
int radixrt_linear_vec_available(int kernel) {
    if (kernel == KERNEL_FMA) return 1;
#ifdef __AVX512BF16__
    if (kernel == KERNEL_DPBF16) return 1;
#endif
    return 0;
}

/* Rows r0 .. r1 - 1, input features i0 .. i1 - 1 of x [m, k] bf16 (rows x_stride apart) into
 * xf as float32 panels of MR_FMA rows (the last holds the rest): panel j, at j·MR_FMA·k, is
 * [k][rows of the panel]. (Threads that share the work split the features: a panel's rows
 * interleave, its features lie one after another.) */
void radixrt_vec_widen(const struct vec_call *c, float *xf, int64_t r0, int64_t r1, int64_t i0, int64_t i1) {
    const int64_t m = c->m, k = c->k, xs = c->x_stride;
    for (int64_t p0 = r0 / MR_FMA * MR_FMA; p0 < r1; p0 += MR_FMA) {
        const int64_t mr = m - p0 < MR_FMA ? m - p0 : MR_FMA;
        float *panel = xf + p0 * k;
        if (mr == MR_FMA && p0 >= r0 && p0 + MR_FMA <= r1) { /* a whole panel: a feature's rows at once */
            for (int64_t i = i0; i < i1; i++)
#pragma GCC unroll 16
                for (int q = 0; q < MR_FMA; q++) panel[i * MR_FMA + q] = bf16_to_f32(c->x[(p0 + q) * xs + i]);
            continue;
        }
        for (int64_t r = p0 > r0 ? p0 : r0; r < p0 + mr && r < r1; r++)
            for (int64_t i = i0; i < i1; i++) panel[i * mr + (r - p0)] = bf16_to_f32(c->x[r * xs + i]);
    }
}

/* 0 if the kernel takes the call's sizes in this build, else -1. */
int radixrt_vec_check(const struct vec_call *c) {
    const int64_t m = c->m, n = c->n, k = c->k, rope_dim = c->rope_dim;
    if (!radixrt_linear_vec_available(c->kernel) || m < 0 || n <= 0 || k <= 0 || k % KC || c->x_stride < k
        || c->y_stride < (c->gated ? n / 2 : n)
        || (c->gated && (n % (2 * NB) || c->bias != NULL || c->y_f32))
        || (rope_dim && (c->gated || c->y_f32 || rope_dim < 0 || rope_dim % (2 * NB) || rope_dim > MAX_UNIT * NB
                         || n % rope_dim || c->rope_cols % rope_dim || c->rope_cols > n)))
        return -1;
    return 0;
}

/* Thread `id` of `threads`: its share of the call's output blocks (xf: x widened, for FMA). */
void radixrt_vec_part(const struct vec_call *c, const float *xf, int64_t id, int64_t threads) {
    const int64_t m = c->m, n = c->n, k = c->k;
    const int64_t blocks = (n + NB - 1) / NB, chunks = k / KC, block_elems = chunks * 2 * 512;
    const int unit = c->rope_dim ? (int)(c->rope_dim / NB) : c->gated ? 2 : 1;
    float acc[MAX_UNIT][32][NB] __attribute__((aligned(64)));
    const struct output o = {c->y, c->y_stride, c->gated ? n / 2 : n, c->bias, c->y_f32, c->gated,
                             c->positions, c->rope_cos, c->rope_sin, c->rope_dim, c->rope_cols};
    const int64_t b0 = blocks / unit * id / threads * unit, b1 = blocks / unit * (id + 1) / threads * unit;
    const int wide = WIDE && c->kernel == KERNEL_FMA && m >= WIDE_MIN_ROWS;
    int64_t group = (wide ? WIDE_BYTES / (k * NB * 4) : GROUP_BYTES / (block_elems * 2)) / unit * unit;
    group = m <= 64 || group < unit ? unit : group > GROUP ? GROUP : group;
    for (int64_t g0 = b0; g0 < b1; g0 += group) {
        const int64_t g1 = g0 + group < b1 ? g0 + group : b1;
        const float *wg = wide ? widen_group(c, g0, g1) : NULL;
        const int64_t pass = wg != NULL ? WIDE_PASS : c->kernel == KERNEL_FMA ? 32 / MR_FMA * MR_FMA : 32;
        for (int64_t r0 = 0; r0 < m; r0 += pass) {
            const int rows = m - r0 < pass ? (int)(m - r0) : (int)pass;
            for (int64_t b = g0; b < g1; b++) {
                const uint32_t *w = (const uint32_t *)(c->packed + b * block_elems);
                if (wg != NULL)
                    wide_block(xf, m, k, r0, rows, wg + (b - g0) * k * NB, acc[b % unit]);
                else if (c->kernel == KERNEL_FMA)
                    fma_block(xf + r0 * k, k, w, chunks, rows, acc[b % unit]);
#ifdef __AVX512BF16__
                else
                    dp_block(c->x + r0 * c->x_stride, c->x_stride, w, chunks, rows, acc[b % unit]);
#endif
                if (b % unit == unit - 1) {
                    const int64_t f0 = c->gated ? b / 2 * NB : (b - unit + 1) * NB;
                    const struct results done = {acc, rows, r0, f0};
                    write_results(&o, &done, unit);
                }
            }
        }
    }
}

/* As radixrt_linear (the same packed weights, arguments and outputs), computed by `kernel`
 * (KERNEL_FMA or KERNEL_DPBF16). Returns -1 (writing nothing) if the sizes do not fit or this
 * build lacks the kernel. x is widened for FMA on the calling thread below WIDEN_PARALLEL_MIN
 * values (a decode step's few rows are widened faster than a team starts), else by the team. */
int radixrt_linear_vec(int kernel, const bf16 *x, int64_t x_stride, const bf16 *packed, const bf16 *bias,
                       void *y, int64_t y_stride, int y_f32, int gated, const int64_t *positions,
                       const float *rope_cos, const float *rope_sin, int64_t rope_dim, int64_t rope_cols,
                       int64_t m, int64_t n, int64_t k, int num_threads) {
    const struct vec_call c = {kernel, x, x_stride, packed, bias, y, y_stride, y_f32, gated, positions,
                               rope_cos, rope_sin, rope_dim, rope_cols, m, n, k};
    if (radixrt_vec_check(&c) != 0 || num_threads < 1) return -1;
    if (m == 0) return 0;
    float *xf = NULL;
    if (kernel == KERNEL_FMA) {
        if ((xf = aligned_alloc(64, (size_t)(((m * k * 4) + 63) / 64 * 64))) == NULL) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (m * k >= WIDEN_PARALLEL_MIN)
        for (int64_t r = 0; r < m; r += MR_FMA) radixrt_vec_widen(&c, xf, r, r + MR_FMA < m ? r + MR_FMA : m, 0, k);
    }
#pragma omp parallel num_threads(num_threads)
    radixrt_vec_part(&c, xf, omp_get_thread_num(), omp_get_num_threads());
    free(xf);
    return 0;
}
