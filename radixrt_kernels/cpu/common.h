/* What the CPU kernels share: bfloat16 conversions and float32 vectors (GCC vector
 * extensions: AVX-512 code where the CPU has it, narrower vectors elsewhere). */
#ifndef RADIXRT_CPU_COMMON_H
#define RADIXRT_CPU_COMMON_H

#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

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

/* Value i at p (float32, or bf16 when is_bf16) as float32. */
static inline __attribute__((always_inline)) float load1(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const bf16 *)p)[i]) : ((const float *)p)[i];
}

typedef float v16 __attribute__((vector_size(64)));                /* 16 float32 lanes */
typedef int32_t v16i __attribute__((vector_size(64)));

typedef uint16_t v16h __attribute__((vector_size(32))); /* 16 bf16 values */
typedef uint32_t v16u __attribute__((vector_size(64)));

/* 16 bf16 values as float32 (their bits shifted up). GCC widens a vector of 16 uint16 in four
 * shuffles; the AVX-512 zero extension is one. */
static inline v16 widen16(v16h h) {
#ifdef __AVX512F__
    return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16);
#else
    return (v16)(__builtin_convertvector(h, v16u) << 16);
#endif
}

/* 16 values at p (float32, or bf16 when is_bf16) as float32. */
static inline v16 load16(const void *p, int is_bf16) {
    v16 x;
    if (is_bf16) {
        v16h h;
        memcpy(&h, p, sizeof h);
        x = widen16(h);
    } else {
        memcpy(&x, p, sizeof x);
    }
    return x;
}

/* x rounded to bf16 values (nearest even; NaN stays NaN). With AVX512-BF16 one instruction
 * (vcvtneps2bf16), which also flushes denormals (|x| < 2^-126) to zero. */
static inline v16h to_bf16(v16 x) {
#ifdef __AVX512BF16__
    return (v16h)_mm512_cvtneps_pbh((__m512)x);
#else
    const v16u bits = (v16u)x, nan = (bits & 0x7fffffffu) > 0x7f800000u;
    const v16u rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return __builtin_convertvector((rounded & ~nan) | (((bits | 0x400000u) >> 16) & nan), v16h);
#endif
}

/* x rounded to bf16 precision (see to_bf16), still as float32. */
static inline v16 round16(v16 x) {
    return widen16(to_bf16(x));
}

/* 16 float32 values to p (rounded to bf16 when is_bf16). */
static inline void store16(void *p, v16 x, int is_bf16) {
    if (is_bf16) {
        const v16h h = to_bf16(x);
        memcpy(p, &h, sizeof h);
    } else {
        memcpy(p, &x, sizeof x);
    }
}

/* mask ? a : b per lane (mask lanes all ones or all zeros, as comparisons give) */
static inline v16 vselect(v16i mask, v16 a, v16 b) {
    return (v16)(((v16i)a & mask) | ((v16i)b & ~mask));
}

#ifdef __AVX512F__
/* e^r ≈ 1 + r + r²/2! + ... + r^degree/degree! per lane (Horner; degree <= 7, a constant at
 * each call, so the loop unrolls). */
static inline v16 taylor_exp(v16 r, int degree) {
    static const float inverse_factorial[8] = {1.0f, 1.0f, 1.0f / 2, 1.0f / 6, 1.0f / 24, 1.0f / 120,
                                               1.0f / 720, 1.0f / 5040};
    v16 p = (v16){0} + inverse_factorial[degree];
    for (int i = degree - 1; i >= 0; i--) p = p * r + inverse_factorial[i];
    return p;
}

/* e^x per lane (relative error ~2e-7; lanes below -87.3 give 0, so e^-inf = 0; x clamped
 * to 88 above): x = n·ln2 + r, n rounded to nearest (|r| <= ln2/2), e^r by its degree-6
 * Taylor polynomial, times 2^n by vscalefps (no result below the normal range: a denormal
 * would cost a microcode assist per lane). Builds without AVX-512 have vexpf below. */
static inline v16 vexp(v16 x) {
    const __mmask16 lo = _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
    const __m512 xc = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-87.3f), (__m512)x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const v16 r = (v16)_mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f),
                                        _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), xc));
    return (v16)_mm512_maskz_scalef_ps(~lo, (__m512)taylor_exp(r, 6), n);
}

/* 1 / d per lane: the 14-bit estimate refined once (within ~1 ulp of a division, at a
 * fraction of its cost). */
static inline v16 vrecip(v16 d) {
    const v16 r = (v16)_mm512_rcp14_ps((__m512)d);
    return r * (2.0f - d * r);
}
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef int32_t v4i __attribute__((vector_size(16)));

/* Horizontal max and sum of the 16 lanes, as trees (a chain of 15 would be latency-bound). */
static inline float hmax(v16 x) {
    const v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7);
    const v8 b = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    const v8 c = (v8)(((v8i)a & (a > b)) | ((v8i)b & ~(a > b)));
    const v4 d = __builtin_shufflevector(c, c, 0, 1, 2, 3), e = __builtin_shufflevector(c, c, 4, 5, 6, 7);
    const v4 f = (v4)(((v4i)d & (d > e)) | ((v4i)e & ~(d > e)));
    const float g = f[0] > f[1] ? f[0] : f[1], h = f[2] > f[3] ? f[2] : f[3];
    return g > h ? g : h;
}

static inline float hsum(v16 x) {
    const v8 c = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7)
               + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    const v4 f = __builtin_shufflevector(c, c, 0, 1, 2, 3) + __builtin_shufflevector(c, c, 4, 5, 6, 7);
    return (f[0] + f[2]) + (f[1] + f[3]);
}

/* The build's widest float32 vector: VL lanes (16 with AVX-512, 8 with AVX, else 4). Without
 * AVX-512 GCC keeps a 64-byte v16 in memory and moves it piecewise, so hot loops there are
 * written on vf; with AVX-512 vf is v16 and its functions are v16's. */
#ifdef __AVX512F__
#define VL 16
typedef v16 vf;
typedef v16i vfi;
#define vload load16
#define vstore store16
#define vsel vselect
#define vexpf vexp
#define vrecipf vrecip
#define vround round16
#define vhsum hsum
#else
#if defined(__AVX__)
#define VL 8
#else
#define VL 4
#endif
typedef float vf __attribute__((vector_size(4 * VL)));
typedef int32_t vfi __attribute__((vector_size(4 * VL)));
typedef uint32_t vfu __attribute__((vector_size(4 * VL)));
typedef uint16_t vfh __attribute__((vector_size(2 * VL)));

/* VL values at p (float32, or bf16 when is_bf16) as float32. */
static inline vf vload(const void *p, int is_bf16) {
    vf x;
    if (is_bf16) {
        vfh h;
        memcpy(&h, p, sizeof h);
        x = (vf)(__builtin_convertvector(h, vfu) << 16);
    } else {
        memcpy(&x, p, sizeof x);
    }
    return x;
}

/* VL float32 values to p (rounded to bf16 as to_bf16 rounds when is_bf16). */
static inline void vstore(void *p, vf x, int is_bf16) {
    if (is_bf16) {
        const vfu bits = (vfu)x, nan = (vfu)((bits & 0x7fffffffu) > 0x7f800000u);
        const vfu rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
        const vfh h = __builtin_convertvector((rounded & ~nan) | (((bits | 0x400000u) >> 16) & nan), vfh);
        memcpy(p, &h, sizeof h);
    } else {
        memcpy(p, &x, sizeof x);
    }
}

static inline vf vsel(vfi mask, vf a, vf b) {
    return (vf)(((vfi)a & mask) | ((vfi)b & ~mask));
}

/* x rounded to bf16 precision, as round16 rounds, still as float32. */
static inline vf vround(vf x) {
    const vfu bits = (vfu)x, nan = (vfu)((bits & 0x7fffffffu) > 0x7f800000u);
    const vfu rounded = ((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16) << 16;
    return (vf)((rounded & ~nan) | ((bits | 0x400000u) & 0xffff0000u & nan));
}

static inline float vhsum(vf x) {
    float s = 0.0f;
    for (int i = 0; i < VL; i++) s += x[i];
    return s;
}

static inline vf vrecipf(vf d) {
    return 1.0f / d;
}

/* e^x per lane, as vexp (lanes below -87.3 give 0; x clamped to 88 above): x = n·ln2 + r, n
 * truncated toward zero (|r| <= ln2), e^r by its degree-7 Taylor polynomial (Horner), 2^n
 * added to the exponent. */
static inline vf vexpf(vf x) {
    static const float inverse_factorial[8] = {1.0f, 1.0f, 1.0f / 2, 1.0f / 6, 1.0f / 24, 1.0f / 120,
                                               1.0f / 720, 1.0f / 5040};
    const vfi lo = x < -87.3f;
    const vf zero = {0}, floor = zero - 87.3f, ceiling = zero + 88.0f;
    x = vsel(lo, floor, vsel(x > 88.0f, ceiling, x));
    const vfi n = __builtin_convertvector(x * 1.44269504088896341f, vfi);
    const vf nf = __builtin_convertvector(n, vf);
    const vf r = (x - nf * 0.693145751953125f) - nf * 1.428606765330187e-06f;
    vf p = zero + inverse_factorial[7];
    for (int i = 6; i >= 0; i--) p = p * r + inverse_factorial[i];
    return vsel(lo, zero, (vf)((vfi)p + (n << 23)));
}
#endif

#ifdef HAVE_AMX
/* 1 if the OS grants this process AMX state (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA:
 * Linux hands it out on request), asked once. */
static inline int amx_permitted(void) {
    static int ready = -1; /* -1 unknown, 0 refused, 1 granted */
    if (ready < 0) ready = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return ready;
}

/* All eight tile registers as 16 rows × 64 bytes (the calling thread's configuration). The
 * configuration is static data: GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes,
 * so stores that fill the rest of a stack copy may be dropped. */
static inline void amx_configure(void) {
    static const struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg = {.palette = 1,
             .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
             .rows = {16, 16, 16, 16, 16, 16, 16, 16}};
    _tile_loadconfig(&cfg);
}
#endif

#endif
