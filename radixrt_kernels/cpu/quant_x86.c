/* quant.c's kernels on x86 vectors: AVX2 (maddubs/madd integer dot products, 8 output rows
 * per vector: a panel's lanes in two halves) and AVX-512 VNNI (vpdpbusd, a panel's 16 rows per
 * vector). Each computes quant.c's arithmetic: the integer sums exactly, then the float32 chain
 * per output in ascending k with separate multiplies and adds, vectorized across output rows.
 *
 * A 32-block's values unpack into 8 vectors u (u covering values 4u .. 4u + 3 of every lane,
 * quant.h), held unsigned where the dot product needs it (w = u - OFF, OFF · sx_j subtracted
 * from the sum); x's 4 values of each u are broadcast to every lane. AVX2 keeps maddubs's int16
 * pair sums below 2^15: the unsigned values are at most 63 (6 bits), and Q8_0 runs as |w| times
 * x with w's sign. The same unpacked block serves up to R rows of x.
 */
#pragma GCC optimize("fp-contract=off")
#include <stdint.h>
#include <string.h>

#include "quant.h"

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_Q_AVX2 1
#endif
#if defined(HAVE_Q_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_Q_AVX512 1
#endif

#define INLINE static inline __attribute__((always_inline))

static inline int32_t load32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ---- AVX-512 VNNI ------------------------------------------------------------------------- */
#ifdef HAVE_Q_AVX512
#define R512 8 /* rows sharing an unpacked block */

/* Σ over vectors v0 .. v0 + count - 1 of u · x (x's 4 values per vector broadcast), in two
 * chains. */
INLINE __m512i dot512(const __m512i *u, const int8_t *x, int v0, int count) {
    __m512i s0 = _mm512_setzero_si512(), s1 = s0;
    for (int v = v0; v < v0 + count; v += 2) {
        s0 = _mm512_dpbusd_epi32(s0, u[v], _mm512_set1_epi32(load32(x + 4 * v)));
        s1 = _mm512_dpbusd_epi32(s1, u[v + 1], _mm512_set1_epi32(load32(x + 4 * v + 4)));
    }
    return _mm512_add_epi32(s0, s1);
}

/* One row's chain over one 32-block (x: its 32 values, dx, sx16: its two half sums). */
INLINE __m512 step512(const int qt, const __m512i *u, const __m512 a[2], __m512 c, const int8_t *x,
                      float dx, const int32_t *sx16, __m512 acc) {
    const struct qlayout *L = &LAYOUTS[qt];
    const int off = L->bits == 8 ? 128 : L->off, halves = L->a_kind == A_DSC16 ? 2 : 1;
    const __m512 dxv = _mm512_set1_ps(dx);
    for (int h = 0; h < halves; h++) {
        __m512i isum = dot512(u, x, 8 / halves * h, 8 / halves);
        const int32_t sx = halves == 2 ? sx16[h] : sx16[0] + sx16[1];
        if (off) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(off * sx));
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_mul_ps(a[h], dxv), _mm512_cvtepi32_ps(isum)));
    }
    if (L->c_kind != C_NONE)
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_mul_ps(c, dxv), _mm512_set1_ps((float)(sx16[0] + sx16[1]))));
    return acc;
}

INLINE void panel512(const struct qcall *c, int64_t p, int64_t r0, int rows, const int qt) {
    const struct qlayout *L = &LAYOUTS[qt];
    const int per = L->qk / 32;
    const int64_t nb = c->k / 32;
    const uint8_t *pw = c->packed + p * c->panel_bytes;
    for (int rt = 0; rt < rows; rt += R512) {
        const int rr = rows - rt < R512 ? rows - rt : R512;
        __m512 acc[R512];
        for (int r = 0; r < R512; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *rec = pw + b / per * L->rec;
            __m512i u[8];
            __m512 a[2], off;
            quant_unpack512(qt, rec, (int)(b % per), u);
            quant_scales512(qt, rec, (int)(b % per), a, &off);
            for (int r = 0; r < R512 && r < rr; r++) {
                const int64_t row = r0 + rt + r;
                acc[r] = step512(qt, u, a, off, c->xq + row * c->k + 32 * b, c->dx[row * nb + b],
                                 c->sx16 + row * (c->k / 16) + 2 * b, acc[r]);
            }
        }
        float out[LANES];
        for (int r = 0; r < rr; r++) {
            _mm512_storeu_ps(out, acc[r]);
            quant_store(c, r0 + rt + r, p, out);
        }
    }
}

#define PANEL512(T) \
    static void panel512_##T(const struct qcall *c, int64_t p, int64_t r0, int rows) { panel512(c, p, r0, rows, T); }
PANEL512(Q8_0) PANEL512(Q4_0) PANEL512(Q4_1) PANEL512(Q5_0) PANEL512(Q5_1) PANEL512(Q4_K) PANEL512(Q5_K)
PANEL512(Q6_K)

panel_fn quant_avx512_kernel(int qt) {
    static const panel_fn kernels[QTYPES] = {panel512_Q8_0, panel512_Q4_0, panel512_Q4_1, panel512_Q5_0,
                                             panel512_Q5_1, panel512_Q4_K, panel512_Q5_K, panel512_Q6_K};
    return qt >= 0 && qt < QTYPES ? kernels[qt] : NULL;
}
#else
panel_fn quant_avx512_kernel(int qt) {
    (void)qt;
    return NULL;
}
#endif

/* ---- AVX2 --------------------------------------------------------------------------------- */
#ifdef HAVE_Q_AVX2
#define R256 4 /* rows sharing an unpacked half block */

INLINE __m256i shl256(__m256i v, int s) {
    return s > 0 ? _mm256_slli_epi16(v, s) : s < 0 ? _mm256_srli_epi16(v, -s) : v;
}

INLINE __m256i ld256(const uint8_t *p) {
    return _mm256_loadu_si256((const __m256i *)p);
}

/* Lanes 8g .. 8g + 7 of 32-block j of rec as 8 vectors (Q8_0: w itself, signed; else unsigned). */
INLINE void unpack256(const int qt, const uint8_t *rec, int j, int g, __m256i u[8]) {
    const struct qlayout *L = &LAYOUTS[qt];
    const uint8_t *ql = rec + L->ql_at + j * L->ql_stride + 32 * g, *qh = rec + L->qh_at + j * L->qh_stride + 32 * g;
    if (L->bits == 8) {
        for (int v = 0; v < 8; v++) u[v] = ld256(ql + 64 * v);
        return;
    }
    const __m256i m4 = _mm256_set1_epi8(15), b4 = _mm256_set1_epi8(16), b45 = _mm256_set1_epi8(48);
    __m256i h0 = _mm256_setzero_si256(), h1 = h0;
    if (L->bits >= 5) h0 = ld256(qh);
    if (L->bits == 6) h1 = ld256(qh + 64);
    for (int v = 0; v < 4; v++) {
        const __m256i q = ld256(ql + 64 * v);
        __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if (L->bits == 5) {
            lo = _mm256_or_si256(lo, _mm256_and_si256(shl256(h0, 4 - 2 * v), b4));
            hi = _mm256_or_si256(hi, _mm256_and_si256(shl256(h0, 3 - 2 * v), b4));
        }
        if (L->bits == 6) {
            const __m256i h = v < 2 ? h0 : h1;
            lo = _mm256_or_si256(lo, _mm256_and_si256(shl256(h, 4 - 4 * (v % 2)), b45));
            hi = _mm256_or_si256(hi, _mm256_and_si256(shl256(h, 2 - 4 * (v % 2)), b45));
        }
        u[2 * v] = lo;
        u[2 * v + 1] = hi;
    }
}

INLINE __m256 u8s256(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

INLINE void scales256(const int qt, const uint8_t *rec, int j, int g, __m256 a[2], __m256 *c) {
    const struct qlayout *L = &LAYOUTS[qt];
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + L->d_at + 16 * g)));
    a[0] = a[1] = d;
    if (L->a_kind == A_DSC) a[0] = a[1] = _mm256_mul_ps(d, u8s256(rec + L->sc_at + 16 * j + 8 * g));
    for (int h = 0; L->a_kind == A_DSC16 && h < 2; h++) {
        const __m128i s = _mm_loadl_epi64((const __m128i *)(rec + L->sc_at + 16 * (2 * j + h) + 8 * g));
        a[h] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s)));
    }
    *c = _mm256_setzero_ps();
    if (L->c_kind == C_NONE) return;
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + L->m_at + 16 * g)));
    *c = m;
    if (L->c_kind == C_DMIN)
        *c = _mm256_xor_ps(_mm256_mul_ps(m, u8s256(rec + L->mn_at + 16 * j + 8 * g)), _mm256_set1_ps(-0.0f));
}

/* Σ over vectors v0 .. v0 + count - 1 of u · x: int16 pair sums (below 2^15: see the top),
 * two vectors' added before widening to int32. */
INLINE __m256i dot256(const int qt, const __m256i *u, const int8_t *x, int v0, int count) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s = _mm256_setzero_si256();
    for (int v = v0; v < v0 + count; v += 2) {
        const __m256i x0 = _mm256_set1_epi32(load32(x + 4 * v)), x1 = _mm256_set1_epi32(load32(x + 4 * v + 4));
        __m256i p0, p1;
        if (LAYOUTS[qt].bits == 8) {
            p0 = _mm256_maddubs_epi16(_mm256_sign_epi8(u[v], u[v]), _mm256_sign_epi8(x0, u[v]));
            p1 = _mm256_maddubs_epi16(_mm256_sign_epi8(u[v + 1], u[v + 1]), _mm256_sign_epi8(x1, u[v + 1]));
            s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones)));
            continue;
        }
        p0 = _mm256_maddubs_epi16(u[v], x0);
        p1 = _mm256_maddubs_epi16(u[v + 1], x1);
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones));
    }
    return s;
}

INLINE __m256 step256(const int qt, const __m256i *u, const __m256 a[2], __m256 c, const int8_t *x,
                      float dx, const int32_t *sx16, __m256 acc) {
    const struct qlayout *L = &LAYOUTS[qt];
    const int off = L->bits == 8 ? 0 : L->off, halves = L->a_kind == A_DSC16 ? 2 : 1;
    const __m256 dxv = _mm256_set1_ps(dx);
    for (int h = 0; h < halves; h++) {
        __m256i isum = dot256(qt, u, x, 8 / halves * h, 8 / halves);
        const int32_t sx = halves == 2 ? sx16[h] : sx16[0] + sx16[1];
        if (off) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(off * sx));
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(a[h], dxv), _mm256_cvtepi32_ps(isum)));
    }
    if (L->c_kind != C_NONE)
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(c, dxv), _mm256_set1_ps((float)(sx16[0] + sx16[1]))));
    return acc;
}

/* Rows rt .. rt + rr - 1 of the pass, lanes 8g .. 8g + 7, into out[r][8g ..]. */
INLINE void half256(const struct qcall *c, const uint8_t *pw, int64_t row0, int rr, int g, const int qt,
                    float out[R256][LANES]) {
    const struct qlayout *L = &LAYOUTS[qt];
    const int per = L->qk / 32;
    const int64_t nb = c->k / 32;
    __m256 acc[R256];
    for (int r = 0; r < R256; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *rec = pw + b / per * L->rec;
        __m256i u[8];
        __m256 a[2], off;
        unpack256(qt, rec, (int)(b % per), g, u);
        scales256(qt, rec, (int)(b % per), g, a, &off);
        for (int r = 0; r < R256 && r < rr; r++) {
            const int64_t row = row0 + r;
            acc[r] = step256(qt, u, a, off, c->xq + row * c->k + 32 * b, c->dx[row * nb + b],
                             c->sx16 + row * (c->k / 16) + 2 * b, acc[r]);
        }
    }
    for (int r = 0; r < rr; r++) _mm256_storeu_ps(out[r] + 8 * g, acc[r]);
}

INLINE void panel256(const struct qcall *c, int64_t p, int64_t r0, int rows, const int qt) {
    const uint8_t *pw = c->packed + p * c->panel_bytes;
    for (int rt = 0; rt < rows; rt += R256) {
        const int rr = rows - rt < R256 ? rows - rt : R256;
        float out[R256][LANES];
        half256(c, pw, r0 + rt, rr, 0, qt, out);
        half256(c, pw, r0 + rt, rr, 1, qt, out);
        for (int r = 0; r < rr; r++) quant_store(c, r0 + rt + r, p, out[r]);
    }
}

#define PANEL256(T) \
    static void panel256_##T(const struct qcall *c, int64_t p, int64_t r0, int rows) { panel256(c, p, r0, rows, T); }
PANEL256(Q8_0) PANEL256(Q4_0) PANEL256(Q4_1) PANEL256(Q5_0) PANEL256(Q5_1) PANEL256(Q4_K) PANEL256(Q5_K)
PANEL256(Q6_K)

panel_fn quant_avx2_kernel(int qt) {
    static const panel_fn kernels[QTYPES] = {panel256_Q8_0, panel256_Q4_0, panel256_Q4_1, panel256_Q5_0,
                                             panel256_Q5_1, panel256_Q4_K, panel256_Q5_K, panel256_Q6_K};
    return qt >= 0 && qt < QTYPES ? kernels[qt] : NULL;
}
#else
panel_fn quant_avx2_kernel(int qt) {
    (void)qt;
    return NULL;
}
#endif
