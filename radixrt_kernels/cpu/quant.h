/* What quant.c and quant_x86.c share: the packed layout of each GGUF block type, the call's
 * description and the activation quantization's results.
 *
 * Packed layout (radixrt_quant_pack): the weight's N output rows in panels of LANES = 16
 * (N padded with zero rows to whole panels); a panel is K / QK records, one per GGUF block
 * (QK = 32, or 256 for the K types), each record holding that block of the panel's 16 rows:
 *   - per-row fields as arrays over the 16 lanes: d (fp16 [16]), m or dmin (fp16 [16]),
 *     the K types' 6-bit scales and mins (uint8 [8][16]: sub-block j's 16 lanes side by
 *     side), Q6_K's int8 scales (int8 [16][16]);
 *   - the values, per 32 of K ("a 32-block", i = 0 .. 31 within it), as 64-byte vectors of
 *     16 lanes × 4 bytes (lane o's bytes 4o .. 4o + 3, "dword lanes"):
 *       8 bits (Q8_0): vector v (0 .. 7) byte 4o + t = w(i = 4v + t), the int8 itself;
 *       4-6 bits: vector v (0 .. 3) byte 4o + t: low nibble = q(8v + t) & 15, high nibble =
 *         q(8v + 4 + t) & 15 (q the unsigned stored value, w = q - OFF);
 *       5 bits: one more vector, byte 4o + t: bit 2v = bit 4 of q(8v + t), bit 2v + 1 = bit 4
 *         of q(8v + 4 + t);
 *       6 bits: two more vectors, h = v / 2, byte 4o + t: bits 4(v % 2) .. +1 = bits 4-5 of
 *         q(8v + t), bits 4(v % 2) + 2 .. +3 = bits 4-5 of q(8v + 4 + t).
 *   So a record is exactly 16 raw blocks' bytes (Q4_K, Q5_K: 4 more per block: their scales
 *   unpacked to bytes), and unpacking a 32-block gives 8 vectors, vector u covering values
 *   4u .. 4u + 3 of all 16 lanes: integer dot products run with lanes = output rows.
 */
#ifndef RADIXRT_CPU_QUANT_H
#define RADIXRT_CPU_QUANT_H

#include <stdint.h>

#define LANES 16  /* output rows per panel */
#define XB 32     /* values per activation block */

enum { Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, QTYPES };
enum { A_D, A_DSC, A_DSC16 };     /* a = d | d·sc_j (uint8) | d·sc_j (int8, 16-value sub-blocks) */
enum { C_NONE, C_M, C_DMIN };     /* c = none | m | -(dmin·m_j) */

struct qlayout {
    int ggml;              /* gguf.GGMLQuantizationType value */
    int qk, type_size;     /* values and bytes per GGUF block */
    int rec;               /* bytes per record (a block of 16 lanes) */
    int bits, off;         /* stored bits per value; w = q - off (Q8_0: w = (int8)q) */
    int a_kind, c_kind;
    int d_at, m_at, sc_at, mn_at;   /* field offsets in a record (-1: none) */
    int qh_at, qh_stride;           /* high-bit vectors: offset, bytes per 32-block */
    int ql_at, ql_stride;           /* low-nibble (or int8) vectors */
};

static const struct qlayout LAYOUTS[QTYPES] = {
    [Q8_0] = {8, 32, 34, 544, 8, 0, A_D, C_NONE, 0, -1, -1, -1, -1, 0, 32, 512},
    [Q4_0] = {2, 32, 18, 288, 4, 8, A_D, C_NONE, 0, -1, -1, -1, -1, 0, 32, 256},
    [Q4_1] = {3, 32, 20, 320, 4, 0, A_D, C_M, 0, 32, -1, -1, -1, 0, 64, 256},
    [Q5_0] = {6, 32, 22, 352, 5, 16, A_D, C_NONE, 0, -1, -1, -1, 32, 64, 96, 256},
    [Q5_1] = {7, 32, 24, 384, 5, 0, A_D, C_M, 0, 32, -1, -1, 64, 64, 128, 256},
    [Q4_K] = {12, 256, 144, 2368, 4, 0, A_DSC, C_DMIN, 0, 32, 64, 192, -1, 0, 320, 256},
    [Q5_K] = {13, 256, 176, 2880, 5, 0, A_DSC, C_DMIN, 0, 32, 64, 192, 320, 64, 832, 256},
    [Q6_K] = {14, 256, 210, 3360, 6, 32, A_DSC16, C_NONE, 0, -1, 32, -1, 288, 128, 1312, 256},
};

/* One call: y [m][n] (rows y_stride apart; float32, or bf16 where y_bf16) = x [m][k] (rows
 * x_stride apart; bf16 where x_bf16) times the packed weight (+ bias: NULL, float32 or, where
 * bias_bf16, bf16 [n]), by fn (the path's kernel for the type), x quantized into xq [m][k] int8,
 * dx [m][k / 32] and sx16 [m][k / 16] (sums of xq over 16 values). */
struct qcall;
/* Rows r0 .. r0 + rows - 1 of one panel's outputs (the path's kernel for the call's type). */
typedef void (*panel_fn)(const struct qcall *c, int64_t panel, int64_t r0, int rows);

struct qcall {
    const struct qlayout *L;
    const void *x;
    int64_t x_stride;
    int x_bf16;
    int8_t *xq;
    float *dx;
    int32_t *sx16;
    const uint8_t *packed;
    int64_t panel_bytes;
    const void *bias;
    int bias_bf16;
    void *y;
    int64_t y_stride;
    int y_bf16;
    int64_t m, n, k;
    panel_fn fn;
    int64_t pass; /* rows per work item: PASS, or AMX_PASS on the AMX path */
};

#define AMX_PASS 256 /* rows per work item on the AMX path (the others: quant.c's PASS) */

/* Writes row r of panel p's 16 sums (+ bias, rounded to y's dtype; lanes past n dropped). */
void quant_store(const struct qcall *c, int64_t r, int64_t p, const float *acc);

/* The x86 paths' kernels per type, or NULL where this build lacks the instructions. */
panel_fn quant_avx2_kernel(int qt);
panel_fn quant_avx512_kernel(int qt);
panel_fn quant_amx_kernel(int qt); /* also NULL where the OS does not grant AMX */

#define QHIDDEN __attribute__((visibility("hidden")))

/* A call in parts, for radixrt_quant_linear and the chain (chain.c), which runs them inside a
 * parallel region of its own (the thread team's barrier between the two parts):
 * radixrt_quant_setup checks c's sizes (x, packed, bias, y, m, n, k set by the caller) and sets
 * L, panel_bytes and fn for type ggml on `path` (-1: radixrt_quant_path's); -1 where it does not
 * take them. radixrt_quant_scratch points xq, dx and sx16 into buf (radixrt_quant_scratch_bytes
 * of m rows of k, 64-byte aligned). radixrt_quant_x_part quantizes thread id's share of x;
 * radixrt_quant_items_part computes its share of the outputs, once every share of x is done. */
QHIDDEN int radixrt_quant_setup(struct qcall *c, int ggml, int path);
QHIDDEN int64_t radixrt_quant_scratch_bytes(int64_t m, int64_t k);
QHIDDEN void radixrt_quant_scratch(struct qcall *c, void *buf);
QHIDDEN void radixrt_quant_x_part(const struct qcall *c, int64_t id, int64_t threads);
QHIDDEN void radixrt_quant_items_part(const struct qcall *c, int64_t id, int64_t threads);

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
/* The AVX-512 paths' shared unpacking (quant_x86.c's VNNI kernels, quant_amx.c's). */
#include <immintrin.h>

static inline __attribute__((always_inline)) __m512i quant_shift512(__m512i v, int s) {
    return s > 0 ? _mm512_slli_epi16(v, s) : s < 0 ? _mm512_srli_epi16(v, -s) : v; /* callers mask */
}

/* 32-block j of record rec as 8 vectors of unsigned values u = w + OFF (Q8_0: w + 128). */
static inline __attribute__((always_inline)) void quant_unpack512(const int qt, const uint8_t *rec, int j,
                                                                  __m512i u[8]) {
    const struct qlayout *L = &LAYOUTS[qt];
    const uint8_t *ql = rec + L->ql_at + j * L->ql_stride, *qh = rec + L->qh_at + j * L->qh_stride;
    if (L->bits == 8) {
        for (int v = 0; v < 8; v++) u[v] = _mm512_xor_si512(_mm512_loadu_si512(ql + 64 * v), _mm512_set1_epi8(-128));
        return;
    }
    const __m512i m4 = _mm512_set1_epi8(15), b4 = _mm512_set1_epi8(16), b45 = _mm512_set1_epi8(48);
    __m512i h0 = _mm512_setzero_si512(), h1 = h0;
    if (L->bits >= 5) h0 = _mm512_loadu_si512(qh);
    if (L->bits == 6) h1 = _mm512_loadu_si512(qh + 64);
    for (int v = 0; v < 4; v++) {
        const __m512i q = _mm512_loadu_si512(ql + 64 * v);
        __m512i lo = _mm512_and_si512(q, m4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
        if (L->bits == 5) {
            lo = _mm512_or_si512(lo, _mm512_and_si512(quant_shift512(h0, 4 - 2 * v), b4));
            hi = _mm512_or_si512(hi, _mm512_and_si512(quant_shift512(h0, 3 - 2 * v), b4));
        }
        if (L->bits == 6) {
            const __m512i h = v < 2 ? h0 : h1;
            lo = _mm512_or_si512(lo, _mm512_and_si512(quant_shift512(h, 4 - 4 * (v % 2)), b45));
            hi = _mm512_or_si512(hi, _mm512_and_si512(quant_shift512(h, 2 - 4 * (v % 2)), b45));
        }
        u[2 * v] = lo;
        u[2 * v + 1] = hi;
    }
}

static inline __attribute__((always_inline)) __m512 quant_u8_lanes(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* Scales a (a[0], a[1]: the two 16-value halves; the same but for Q6_K) and offsets c (zero
 * where the type has none) of 32-block j of rec, per lane. */
static inline __attribute__((always_inline)) void quant_scales512(const int qt, const uint8_t *rec, int j,
                                                                  __m512 a[2], __m512 *c) {
    const struct qlayout *L = &LAYOUTS[qt];
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + L->d_at)));
    a[0] = a[1] = d;
    if (L->a_kind == A_DSC) a[0] = a[1] = _mm512_mul_ps(d, quant_u8_lanes(rec + L->sc_at + 16 * j));
    for (int h = 0; L->a_kind == A_DSC16 && h < 2; h++) {
        const __m128i s = _mm_loadu_si128((const __m128i *)(rec + L->sc_at + 16 * (2 * j + h)));
        a[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s)));
    }
    *c = _mm512_setzero_ps();
    if (L->c_kind == C_NONE) return;
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + L->m_at)));
    *c = m;
    if (L->c_kind == C_DMIN) /* -(dmin · m_j): the sign flipped exactly */
        *c = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(m, quant_u8_lanes(rec + L->mn_at + 16 * j))),
                                                  _mm512_set1_epi32(INT32_MIN)));
}
#endif

#endif
