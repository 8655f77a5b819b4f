/* Linear layers on the CPU in bfloat16 with AMX tile products: y = x·Wᵀ (+ bias).
 *
 * A decode step multiplies a few dozen rows by every weight of the model, so it
 * is bound by how fast the weights stream from memory. This kernel reads each
 * weight as one sequential stream per thread, in the order it multiplies it,
 * with software prefetch into L2 ahead of the products.
 *
 * Packed layout (radixrt_linear_pack): W [N, K] row-major becomes, per block of
 * NB = 32 output features (N padded with zero rows to a whole block) and per
 * chunk of KC = 32 input features, two tiles of 16 K-pairs × 16 features × 2
 * (AMX's "VNNI" B layout: element [p][c][e] = W[16·t + c][2p + e]):
 *   packed[block][chunk][tile][pair][feature][e]
 * so a block's chunks lie one after another and a thread streams its blocks in
 * order. K must be a multiple of KC.
 *
 * Per block and per pass of 32 rows of x, the products accumulate in four
 * float32 tiles (2 × 16 rows, 2 × 16 features) over the chunks in order, the
 * order oneDNN's AMX kernels add them in for up to 32 rows: there the results
 * equal PyTorch's bf16 linear bit for bit (with more rows oneDNN switches to
 * kernels that add in other orders; the two then differ in the last bf16 bit
 * now and then, equally far from a float64 product). The sum (plus the bias,
 * in float32) is rounded to bf16 once; with y_f32 it is then widened to
 * float32 (logits, as PyTorch's bf16 linear followed by .float() gives them).
 *
 * Threads (the caller's OpenMP runtime) split the blocks. With more than 64
 * rows (a prefill) a thread takes its blocks in groups (up to GROUP blocks,
 * about GROUP_BYTES of weights): all passes over a group's blocks, which stay
 * in L2, so each weight still streams from memory once and each output row is
 * written in runs of up to GROUP·64 bytes. A pass goes over the chunks in segments whose x fits
 * in L1 (one segment up to K = 640), each segment over all the group's blocks, a block's float32
 * sums stored between segments and loaded back (exactly); the weight tiles, used once per pass,
 * are loaded with the streaming hint, so the x tiles every block reads stay in L1.
 *
 * A unit's results (a block; a gated pair; a rotary head's blocks) are written during the next
 * unit's products, a slice of rows per chunk, so the epilogue's vector work overlaps the tile
 * products. None of this changes what is added to what, or in which order.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "linear_out.h"

#ifdef HAVE_AMX
#include <omp.h>
#endif

#define TILE_ELEMS 512        /* bf16 values in one 16 × 32 tile */
#define PREFETCH_AHEAD 32768  /* bytes of the weight stream ahead of the products, into L2 */
#define GROUP 16              /* blocks per group with more than two passes, at most ... */
#define GROUP_BYTES (3 << 19) /* ... and about this much weight (1.5 MiB: a group stays in L2) */
#define X_PASS_L1 (40 << 10)  /* x bytes of a pass's segment (32 rows) that stay in L1 */

/* Pack w [n, k] (row-major bf16) into packed: ceil(n / NB)·NB·k values (cpu_linear.packed_elems). */
int radixrt_linear_pack(const bf16 *w, int64_t n, int64_t k, bf16 *packed) {
    if (n <= 0 || k <= 0 || k % KC) return -1;
    const int64_t blocks = (n + NB - 1) / NB, chunks = k / KC;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t c = 0; c < chunks; c++)
            for (int t = 0; t < 2; t++)
                for (int p = 0; p < 16; p++)
                    for (int f = 0; f < 16; f++) {
                        const int64_t row = b * NB + 16 * t + f, col = c * KC + 2 * p;
                        *packed++ = row < n ? w[row * k + col] : 0;
                        *packed++ = row < n ? w[row * k + col + 1] : 0;
                    }
    return 0;
}

#ifdef HAVE_AMX
/* A cursor through a thread's weight stream, ahead of the products: each chunk's products
 * prefetch its next `lines` cache lines into L2. With P passes of 32 rows over each block, a
 * chunk of 2 × 1 KB takes 32 / P lines, so the stream keeps flowing during every pass, not only
 * during the first. */
struct prefetcher {
    const char *at, *end;
    int lines;
    int once; /* the weight tiles are loaded with the streaming hint (tileloaddt1) */
};

/* Rows [lo, hi) of a unit's finished results r (the same acc, shifted by lo rows). */
static inline void write_rows(const struct output *o, const struct results *r, int unit, int lo, int hi) {
    if (hi <= lo) return;
    const struct results part = {(float(*)[32][NB])(&r->acc[0][lo][0]), hi - lo, r->r0 + lo, r->f0};
    write_results(o, &part, unit);
}

/* One block's results for rows r0 .. r0 + 31 (two = 1) or r0 .. r0 + 15 into acc: x rows from xa
 * and xb (16 rows each, a_stride and b_stride elements apart), the block's chunks from w. It is
 * step `step` of `steps` blocks (a unit's) during which the previous unit's results are written:
 * a slice of rows with each chunk's products, so the epilogue's vector work runs beside the tile
 * products (all of it after one chunk would leave the tile unit idle while it runs). */
static inline void block_rows(const bf16 *xa, int64_t a_stride, const bf16 *xb, int64_t b_stride,
                              const bf16 *w, int64_t chunks, int two, struct prefetcher *pf, float (*acc)[NB],
                              int resume, const struct output *o, const struct results *previous, int unit,
                              int step) {
    const int64_t slices = chunks * unit; /* previous->rows over every chunk of the unit's blocks */
    if (resume) { /* the sums of the block's earlier chunks, as stored (float32: exact) */
        _tile_loadd(0, &acc[0][0], NB * 4);
        _tile_loadd(1, &acc[0][16], NB * 4);
        if (two) {
            _tile_loadd(2, &acc[16][0], NB * 4);
            _tile_loadd(3, &acc[16][16], NB * 4);
        }
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t c = 0; c < chunks; c++) {
        const bf16 *wc = w + c * 2 * TILE_ELEMS;
        for (int i = 0; i < pf->lines && pf->at < pf->end; i++, pf->at += 64)
            _mm_prefetch(pf->at, _MM_HINT_T1);
        if (pf->once) {
            _tile_stream_loadd(6, wc, 64);
            _tile_stream_loadd(7, wc + TILE_ELEMS, 64);
        } else {
            _tile_loadd(6, wc, 64);
            _tile_loadd(7, wc + TILE_ELEMS, 64);
        }
        _tile_loadd(4, xa + c * KC, a_stride * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, xb + c * KC, b_stride * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        if (previous->rows) {
            const int64_t at = step * chunks + c;
            write_rows(o, previous, unit, (int)(at * previous->rows / slices),
                       (int)((at + 1) * previous->rows / slices));
        }
    }
    _tile_stored(0, &acc[0][0], NB * 4);
    _tile_stored(1, &acc[0][16], NB * 4);
    if (two) {
        _tile_stored(2, &acc[16][0], NB * 4);
        _tile_stored(3, &acc[16][16], NB * 4);
    }
}
#endif

/* 1 if radixrt_linear runs here (built with AMX, and the OS grants it), else 0. */
int radixrt_linear_available(void) {
#ifdef HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

/* y [m, n] = x [m, k] · Wᵀ (+ bias [n]) for W packed by radixrt_linear_pack; x rows are
 * x_stride elements apart, y rows y_stride (bf16, or float32 with y_f32). Returns -1 (writing
 * nothing) if the sizes do not fit or AMX is unavailable.
 *
 * gated: W's blocks alternate gate and up features (block 2i: gate features 32i .. 32i+31,
 * block 2i+1: the matching up features; n a multiple of 64) and y [m, n / 2] = silu(x·Wgᵀ) ·
 * x·Wuᵀ, each product rounded to bf16 first: SiLU-and-mul in the same pass, no bias, bf16.
 *
 * rope_dim > 0 (a multiple of 64, at most MAX_UNIT·NB; n a multiple of it): features
 * [0, rope_cols) are heads of rope_dim values (q and k), rotated in the same pass as
 * radixrt_rope rotates them, row r at position positions[r] of the float32 tables rope_cos and
 * rope_sin (sin±) [*, rope_dim]; bf16. */
int radixrt_linear(const bf16 *x, int64_t x_stride, const bf16 *packed, const bf16 *bias, void *y,
                   int64_t y_stride, int y_f32, int gated, const int64_t *positions, const float *rope_cos,
                   const float *rope_sin, int64_t rope_dim, int64_t rope_cols, int64_t m, int64_t n, int64_t k,
                   int num_threads) {
#ifdef HAVE_AMX
    if (m < 0 || n <= 0 || k <= 0 || k % KC || x_stride < k || y_stride < (gated ? n / 2 : n) || num_threads < 1
        || (gated && (n % (2 * NB) || bias != NULL || y_f32))
        || (rope_dim && (gated || y_f32 || rope_dim < 0 || rope_dim % (2 * NB) || rope_dim > MAX_UNIT * NB
                         || n % rope_dim || rope_cols % rope_dim || rope_cols > n))
        || !amx_permitted())
        return -1;
    if (m == 0) return 0;
    const int64_t blocks = (n + NB - 1) / NB, chunks = k / KC, tiles = (m + 15) / 16;
    /* The last 16-row slice of x, when m is not a multiple of 16, is read from a zero-padded
     * copy (a tile load reads 16 whole rows). */
    bf16 *tail = NULL;
    if (m % 16) {
        tail = aligned_alloc(64, (size_t)(16 * k * 2));
        if (tail == NULL) return -1;
        memset(tail, 0, (size_t)(16 * k * 2));
        for (int64_t r = 16 * (tiles - 1); r < m; r++)
            memcpy(tail + (r % 16) * k, x + r * x_stride, (size_t)(k * 2));
    }
#pragma omp parallel num_threads(num_threads)
    {
        /* Blocks go in units (a block; a gated pair; a rotary head's blocks); the units' results
         * go to acc's halves in turn: a unit's stay untouched while they are written, during the
         * next unit's products. */
        const int unit = rope_dim ? (int)(rope_dim / NB) : gated ? 2 : 1;
        const struct output o = {y, y_stride, gated ? n / 2 : n, bias, y_f32, gated,
                                 positions, rope_cos, rope_sin, rope_dim, rope_cols};
        struct results done = {NULL, 0, 0, 0};
        const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t b0 = blocks / unit * id / threads * unit, b1 = blocks / unit * (id + 1) / threads * unit;
        amx_configure(); /* tiles 0-3: the 2 × 2 results; 4, 5: x; 6, 7: the weight tiles */
        const int64_t block_elems = chunks * 2 * TILE_ELEMS;
        const int passes = (int)((tiles + 1) / 2);
        /* a decode batch: each block's passes back to back; else groups of whole units */
        int64_t group = GROUP_BYTES / (block_elems * 2) / unit * unit;
        group = passes <= 2 || group < unit ? unit : group > GROUP ? GROUP : group;
        /* In a group, a pass's x is read by every block and each weight tile once: the weight
         * tiles are loaded past L1, and the output lines are left to the writes, spread over the
         * products (a decode batch claims them ahead). */
        struct prefetcher pf = {(const char *)(packed + b0 * block_elems) + PREFETCH_AHEAD,
                                (const char *)(packed + b1 * block_elems), (32 + passes - 1) / passes,
                                passes > 2};
        /* A grouped pass goes over the chunks in segments whose x fits in L1, each segment over
         * all the group's blocks; a block's sums wait in acc between segments. */
        const int64_t segments = passes > 2 ? (32 * k * 2 + X_PASS_L1 - 1) / X_PASS_L1 : 1;
        const int64_t seg_chunks = (chunks + segments - 1) / segments;
        /* A block's results go to acc[parity · group + its place in the group], the parity turning
         * with each pass: a unit's stay untouched while they are written, during the next unit's
         * products (in this pass, or in the next with the other parity). */
        float acc[2 * group][32][NB] __attribute__((aligned(64)));
        int parity = 0;
        for (int64_t g0 = b0; g0 < b1; g0 += group) {
            const int64_t g1 = g0 + group < b1 ? g0 + group : b1;
            for (int64_t r0 = 0; r0 < 16 * tiles; r0 += 32, parity ^= 1) {
                const int two = r0 + 16 < 16 * tiles;
                const int a_tail = tail && r0 / 16 == tiles - 1, b_tail = tail && r0 / 16 + 1 == tiles - 1;
                const bf16 *xa = a_tail ? tail : x + r0 * x_stride, *xb = b_tail ? tail : x + (r0 + 16) * x_stride;
                for (int64_t c0 = 0; c0 < chunks; c0 += seg_chunks) {
                    const int64_t c1 = c0 + seg_chunks < chunks ? c0 + seg_chunks : chunks;
                    for (int64_t b = g0; b < g1; b++) {
                        const int64_t f0 = gated ? b / 2 * NB : b * NB; /* the block's output features */
                        float(*slot)[32][NB] = &acc[parity * group + (b - g0)];
                        if (!pf.once && c1 == chunks && r0 + 32 < m && (!gated || b % 2 == 0))
                            claim_output(&o, r0 + 32, m - r0 - 32 < 32 ? m - r0 - 32 : 32, f0);
                        block_rows(xa + c0 * KC, a_tail ? k : x_stride, xb + c0 * KC, b_tail ? k : x_stride,
                                   packed + b * block_elems + c0 * 2 * TILE_ELEMS, c1 - c0, two, &pf, *slot,
                                   c0 > 0, &o, &done, unit, (int)(b % unit));
                        if (b % unit == unit - 1) /* written above; the unit's first block: b - unit + 1 */
                            done = (struct results){slot - (unit - 1), c1 < chunks ? 0 : m - r0 < 32 ? (int)(m - r0) : 32,
                                                    r0, gated ? f0 : (b - unit + 1) * NB};
                    }
                }
            }
        }
        if (done.rows) write_results(&o, &done, unit);
        _tile_release();
    }
    free(tail);
    return 0;
#else
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)y, (void)y_stride, (void)y_f32, (void)gated;
    (void)positions, (void)rope_cos, (void)rope_sin, (void)rope_dim, (void)rope_cols;
    (void)m, (void)n, (void)k, (void)num_threads;
    return -1;
#endif
}
