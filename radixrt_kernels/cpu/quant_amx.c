/* quant.c's kernels on AMX-int8 tiles, for calls of many rows: the integer sums by tile
 * products (tdpbssd), the float32 chain per output in ascending k on AVX-512 vectors (lanes =
 * a panel's 16 outputs), each operation rounded on its own, as quant.c states it.
 *
 * A 32-block of a panel unpacks to its values as signed bytes w = q - OFF (Q8_0: the int8
 * itself), 8 rows of 64 bytes, row u holding values 4u .. 4u + 3 of the 16 lanes: quant.h's
 * vectors, which are AMX's B layout for K = 32. One tile product of 16 rows of xq (32 bytes
 * each: the same 32-block) by that B gives, for 16 rows × 16 outputs, the block's exact sums
 * Σ w·xq. Q6_K's 16-value sub-blocks take one product each (K = 16: B's rows 0-3, then 4-7),
 * so each sub-block's sum stays separate. The products' int32 tiles are stored to memory and
 * read back row by row into the chain; a block's chain runs while the next block's products
 * are in the tiles (two tile pairs, taking blocks in turn).
 *
 * A work item (one panel, up to AMX_PASS rows) unpacks the panel's blocks a segment of SEG
 * blocks at a time and runs every 16-row tile of the item over the segment; the last tile of a
 * call (fewer than 16 rows) reads its rows of xq from a zero-padded copy. xq's rows start on
 * 32-byte boundaries (quant.c aligns xq; K is a multiple of 32), so no tile row spans two lines.
 */
#pragma GCC optimize("fp-contract=off")
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "quant.h"

#if defined(HAVE_AMX) && defined(__AMX_INT8__) && defined(__AVX512BW__) && defined(__F16C__)
#include <immintrin.h>

#define INLINE static inline __attribute__((always_inline))
#define SEG 32  /* 32-blocks unpacked at a time (the x of a 16-row tile over them: 16 KB) */
#define ROWS AMX_PASS /* rows sharing an unpacked segment */

/* A segment's blocks: B tiles w (signed values), scales a (a[1]: Q6_K's second sub-block, else
 * a[0] again) and offsets c per lane (zero where the type has none). */
struct segment {
    int8_t w[SEG][8][64] __attribute__((aligned(64)));
    float a[SEG][2][LANES] __attribute__((aligned(64)));
    float c[SEG][LANES] __attribute__((aligned(64)));
};

/* Tile pair 0: sums 0, x 2, w 3; pair 1: sums 1, x 4, w 5 (16 × 16 int32 sums; 16 rows × 32
 * bytes of x; 8 rows × 64 bytes of w). Q6_K, a product per 16-value sub-block: pair 0: sums 0
 * and 1, pair 1: sums 2 and 3, both from x 4, 6 (16 rows × 16 bytes) and w 5, 7 (4 × 64).
 * Static data: GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes, so the stores
 * that fill the rest of a stack copy may be dropped. */
struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
static const struct tile_config CONFIGS[2] = {
    {.palette = 1, .colsb = {64, 64, 32, 64, 32, 64}, .rows = {16, 16, 16, 8, 16, 8}},
    {.palette = 1, .colsb = {64, 64, 64, 64, 16, 64, 16, 64}, .rows = {16, 16, 16, 16, 16, 4, 16, 4}},
};

/* Panel p's 32-blocks b0 .. b0 + count - 1 into s. */
INLINE void unpack_segment(const struct qcall *c, const int qt, int64_t p, int64_t b0, int count,
                           struct segment *s) {
    const struct qlayout *L = &LAYOUTS[qt];
    const int per = L->qk / 32;
    const uint8_t *pw = c->packed + p * c->panel_bytes;
    for (int i = 0; i < count; i++) {
        const int64_t b = b0 + i;
        const uint8_t *rec = pw + b / per * L->rec;
        const __m512i off = _mm512_set1_epi8((char)(L->bits == 8 ? 128 : L->off));
        __m512i u[8];
        quant_unpack512(qt, rec, (int)(b % per), u);
        for (int v = 0; v < 8; v++) _mm512_store_si512(s->w[i][v], _mm512_sub_epi8(u[v], off)); /* w = u - OFF */
        __m512 scale[2], cv;
        quant_scales512(qt, rec, (int)(b % per), scale, &cv);
        _mm512_store_ps(s->a[i][0], scale[0]);
        _mm512_store_ps(s->a[i][1], scale[1]);
        _mm512_store_ps(s->c[i], cv);
    }
}

/* One 32-block's products for 16 rows of x (32 bytes each, stride bytes apart) by w, into tile
 * pair `pair` (0 or 1), left in the tiles. */
INLINE void products(const int qt, const int pair, const int8_t *x, int64_t stride, const int8_t *w) {
    if (qt == Q6_K) {
        _tile_loadd(4, x, stride);
        _tile_loadd(5, w, 64);
        _tile_loadd(6, x + 16, stride);
        _tile_loadd(7, w + 256, 64);
        if (pair == 0) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_dpbssd(0, 4, 5);
            _tile_dpbssd(1, 6, 7);
        } else {
            _tile_zero(2);
            _tile_zero(3);
            _tile_dpbssd(2, 4, 5);
            _tile_dpbssd(3, 6, 7);
        }
    } else if (pair == 0) {
        _tile_zero(0);
        _tile_loadd(2, x, stride);
        _tile_loadd(3, w, 64);
        _tile_dpbssd(0, 2, 3);
    } else {
        _tile_zero(1);
        _tile_loadd(4, x, stride);
        _tile_loadd(5, w, 64);
        _tile_dpbssd(1, 4, 5);
    }
}

/* The sums left in tile pair `pair` into sums[0] (Q6_K: its sub-blocks' into sums[0], sums[1]). */
INLINE void store_sums(const int qt, const int pair, int32_t sums[2][16][LANES]) {
    if (qt == Q6_K && pair == 0) {
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
    } else if (qt == Q6_K) {
        _tile_stored(2, sums[0], 64);
        _tile_stored(3, sums[1], 64);
    } else if (pair == 0) {
        _tile_stored(0, sums[0], 64);
    } else {
        _tile_stored(1, sums[0], 64);
    }
}

/* A 16-row tile's activation scales over a segment: dx[r][i] and, for the types with an offset,
 * sx[r][i] = (float)(sx_j): the sum of xq over 32-block i (rows past rr: untouched). */
struct tile_scales {
    float dx[16][SEG] __attribute__((aligned(64)));
    float sx[16][SEG] __attribute__((aligned(64)));
};

INLINE void gather_scales(const struct qcall *c, const int qt, int64_t b0, int count, int64_t row0, const int rr,
                          struct tile_scales *t) {
    const int64_t nb = c->k / 32;
    for (int r = 0; r < rr; r++) {
        memcpy(t->dx[r], c->dx + (row0 + r) * nb + b0, (size_t)count * sizeof(float));
        if (LAYOUTS[qt].c_kind == C_NONE) continue;
        const int32_t *sx16 = c->sx16 + (row0 + r) * 2 * nb + 2 * b0;
        for (int i = 0; i < count; i++) t->sx[r][i] = (float)(sx16[2 * i] + sx16[2 * i + 1]);
    }
}

/* One 32-block (i of the segment) of the chain for rows 0 .. rr - 1 of the tile:
 * acc[r] + (a · dx) · isum [+ (a1 · dx) · isum1] [+ (c · dx) · sx]. */
INLINE void chain(const int qt, const struct segment *s, const struct tile_scales *t, int i, const int rr,
                  const int32_t (*isum)[LANES], const int32_t (*isum1)[LANES], __m512 acc[16]) {
    const struct qlayout *L = &LAYOUTS[qt];
    const __m512 a0 = _mm512_load_ps(s->a[i][0]), a1 = _mm512_load_ps(s->a[i][1]), cv = _mm512_load_ps(s->c[i]);
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) {
        if (r >= rr) break;
        const __m512 dx = _mm512_set1_ps(t->dx[r][i]);
        acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(a0, dx), _mm512_cvtepi32_ps(_mm512_load_si512(isum[r]))));
        if (L->a_kind == A_DSC16)
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(a1, dx), _mm512_cvtepi32_ps(_mm512_load_si512(isum1[r]))));
        if (L->c_kind != C_NONE)
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(cv, dx), _mm512_set1_ps(t->sx[r][i])));
    }
}

/* Rows row0 .. row0 + rr - 1 (x: their xq from the segment's first block on, 16 rows stride
 * bytes apart) over the segment's count blocks from b0: acc[r] continued. Block i + 1's tile
 * products run during block i's chain, and are stored after it: the chain's loads never wait
 * behind a tile store that is still waiting for its products. */
INLINE void tile_rows(const struct qcall *c, const int qt, const struct segment *s, int64_t b0, int count,
                      int64_t row0, const int rr, const int8_t *x, int64_t stride, float acc[][LANES]) {
    int32_t sums[2][2][16][LANES] __attribute__((aligned(64)));
    struct tile_scales t;
    __m512 v[16];
    gather_scales(c, qt, b0, count, row0, rr, &t);
    for (int r = 0; r < 16; r++) v[r] = r < rr ? _mm512_loadu_ps(acc[r]) : _mm512_setzero_ps();
    products(qt, 0, x, stride, s->w[0][0]);
    for (int i = 0; i < count; i += 2) { /* even blocks on tile pair 0, odd on pair 1 */
        store_sums(qt, 0, sums[0]);
        if (i + 1 < count) products(qt, 1, x + 32 * (i + 1), stride, s->w[i + 1][0]);
        chain(qt, s, &t, i, rr, sums[0][0], sums[0][1], v);
        if (i + 1 == count) break;
        store_sums(qt, 1, sums[1]);
        if (i + 2 < count) products(qt, 0, x + 32 * (i + 2), stride, s->w[i + 2][0]);
        chain(qt, s, &t, i + 1, rr, sums[1][0], sums[1][1], v);
    }
    for (int r = 0; r < rr; r++) _mm512_storeu_ps(acc[r], v[r]);
}

/* The segment for rows row0 .. row0 + rows - 1 (rows <= ROWS), in 16-row tiles. */
INLINE void segment_rows(const struct qcall *c, const int qt, const struct segment *s, int64_t b0, int count,
                         int64_t row0, int rows, float acc[ROWS][LANES]) {
    for (int t = 0; t < rows; t += 16) {
        const int rr = rows - t < 16 ? rows - t : 16;
        const int8_t *x = c->xq + (row0 + t) * c->k + 32 * b0;
        if (rr == 16) {
            tile_rows(c, qt, s, b0, count, row0 + t, 16, x, c->k, acc + t);
            continue;
        }
        int8_t pad[16][32 * SEG] __attribute__((aligned(64))); /* rows past the call's: zeros */
        memset(pad, 0, sizeof pad);
        for (int r = 0; r < rr; r++) memcpy(pad[r], x + r * c->k, (size_t)(32 * count));
        tile_rows(c, qt, s, b0, count, row0 + t, rr, pad[0], 32 * SEG, acc + t);
    }
}

/* Rows row0 .. row0 + rows - 1 of panel p's sums + bias into y, as quant_store writes them
 * (bf16: rounded to nearest even, a NaN kept a NaN with its sign and top bits). */
static void store_rows(const struct qcall *c, int64_t p, int64_t row0, int rows, float acc[][LANES]) {
    if ((p + 1) * LANES > c->n) { /* the last panel's lanes past n are dropped */
        for (int r = 0; r < rows; r++) quant_store(c, row0 + r, p, acc[r]);
        return;
    }
    __m512 bias = _mm512_setzero_ps();
    if (c->bias != NULL && c->bias_bf16) /* bf16 widened exactly: its bits in a float's top half */
        bias = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const bf16 *)c->bias + p * LANES))), 16));
    else if (c->bias != NULL)
        bias = _mm512_loadu_ps((const float *)c->bias + p * LANES);
    for (int r = 0; r < rows; r++) {
        const __m512 v = c->bias ? _mm512_add_ps(_mm512_loadu_ps(acc[r]), bias) : _mm512_loadu_ps(acc[r]);
        const int64_t at = (row0 + r) * c->y_stride + p * LANES;
        if (!c->y_bf16) {
            _mm512_storeu_ps((float *)c->y + at, v);
            continue;
        }
        const __m512i bits = _mm512_castps_si512(v);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                     _mm512_set1_epi32(0x7f800000));
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        __m512i h = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
        h = _mm512_mask_or_epi32(h, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
        _mm256_storeu_si256((__m256i *)((bf16 *)c->y + at), _mm512_cvtepi32_epi16(h));
    }
}

INLINE void panel_amx(const struct qcall *c, int64_t p, int64_t r0, int rows, const int qt) {
    const int64_t nb = c->k / 32;
    struct segment s;
    float acc[ROWS][LANES] __attribute__((aligned(64)));
    _tile_loadconfig(&CONFIGS[qt == Q6_K]);
    for (int64_t rc = r0; rc < r0 + rows; rc += ROWS) {
        const int nr = r0 + rows - rc < ROWS ? (int)(r0 + rows - rc) : ROWS;
        memset(acc, 0, sizeof acc);
        for (int64_t b0 = 0; b0 < nb; b0 += SEG) {
            const int count = nb - b0 < SEG ? (int)(nb - b0) : SEG;
            unpack_segment(c, qt, p, b0, count, &s);
            segment_rows(c, qt, &s, b0, count, rc, nr, acc);
        }
        store_rows(c, p, rc, nr, acc);
    }
    _tile_release();
}

#define PANEL_AMX(T) \
    static void panel_amx_##T(const struct qcall *c, int64_t p, int64_t r0, int rows) { panel_amx(c, p, r0, rows, T); }
PANEL_AMX(Q8_0) PANEL_AMX(Q4_0) PANEL_AMX(Q4_1) PANEL_AMX(Q5_0) PANEL_AMX(Q5_1) PANEL_AMX(Q4_K) PANEL_AMX(Q5_K)
PANEL_AMX(Q6_K)

panel_fn quant_amx_kernel(int qt) {
    static const panel_fn kernels[QTYPES] = {panel_amx_Q8_0, panel_amx_Q4_0, panel_amx_Q4_1, panel_amx_Q5_0,
                                             panel_amx_Q5_1, panel_amx_Q4_K, panel_amx_Q5_K, panel_amx_Q6_K};
    return qt >= 0 && qt < QTYPES && amx_permitted() ? kernels[qt] : NULL;
}
#else
panel_fn quant_amx_kernel(int qt) {
    (void)qt;
    return NULL;
}
#endif
