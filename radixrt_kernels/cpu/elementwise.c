/* The model's elementwise steps on the CPU, each one call instead of the several kernels
 * PyTorch runs for it in eager mode: the residual add with RMS norm, the rotary embedding and
 * SiLU-and-mul.
 *
 * float32 or bfloat16 (is_bf16). Every bfloat16 result is rounded where PyTorch's eager ops
 * round it (the same ops as Hugging Face's Llama), so the outputs are those of the unfused
 * ops up to the order of a float32 sum and the last bit of a float32 exp. With AVX512-BF16
 * the rounding is one instruction (vcvtneps2bf16), which also flushes results below bf16's
 * normal range (|x| < 2^-126) to zero where PyTorch keeps them as denormals. Rows are split
 * over the caller's OpenMP threads (PyTorch's libgomp) when there is enough work.
 *
 * Each row is done VL values at a time (the build's vector width, common.h), then value by
 * value for the rest; the row bodies are inlined once per dtype (is_bf16 a constant there).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "parts.h"

#define NMAX 16384         /* widest row (a stack buffer) */
#define DMAX 1024          /* widest rotary head_dim */
#define PARALLEL_MIN 16384 /* elements below which one thread does the whole call */
#define INLINE static inline __attribute__((always_inline))

INLINE float round1(float x, int is_bf16) {
    return is_bf16 ? bf16_to_f32(f32_to_bf16(x)) : x;
}

INLINE void store1(void *p, int64_t i, float x, int is_bf16) {
    if (is_bf16)
        ((bf16 *)p)[i] = f32_to_bf16(x);
    else
        ((float *)p)[i] = x;
}

INLINE vf round_to(vf x, int is_bf16) {
    return is_bf16 ? vround(x) : x;
}

/* One row of radixrt_rms_norm: a pass for the sum of squares (writing s = x + residual into
 * residual), a pass for the output (reading s back from residual, or x). */
INLINE void rms_norm_row(const void *x, void *residual, void *out, const void *weight, int64_t n,
                         float eps, int is_bf16) {
    const size_t elem = is_bf16 ? 2 : 4;
    const void *s = residual != NULL ? residual : x;
    vf acc0 = {0}, acc1 = {0};
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        vf v = vload((const char *)x + i * elem, is_bf16);
        if (residual != NULL) {
            v = round_to(v + vload((const char *)residual + i * elem, is_bf16), is_bf16);
            vstore((char *)residual + i * elem, v, is_bf16);
        }
        if ((i / VL) % 2) acc1 += v * v; else acc0 += v * v;
    }
    float sq = vhsum(acc0 + acc1);
    for (; i < n; i++) {
        float v = load1(x, i, is_bf16);
        if (residual != NULL) {
            v = round1(v + load1(residual, i, is_bf16), is_bf16);
            store1(residual, i, v, is_bf16);
        }
        sq += v * v;
    }
    const float inv = 1.0f / sqrtf(sq / (float)n + eps);
    for (i = 0; i + VL <= n; i += VL) {
        const vf v = vload((const char *)s + i * elem, is_bf16);
        vstore((char *)out + i * elem, vload((const char *)weight + i * elem, is_bf16) * round_to(v * inv, is_bf16),
               is_bf16);
    }
    for (; i < n; i++) store1(out, i, load1(weight, i, is_bf16) * round1(load1(s, i, is_bf16) * inv, is_bf16), is_bf16);
}

/* out = weight · norm(s), s = x + residual (rounded; written back into residual) when residual
 * is not NULL, else s = x. norm(s) = s / sqrt(mean(s²) + eps) in float32, rounded; then the
 * product with the weight, rounded. x rows are x_stride elements apart; residual and out are
 * contiguous [t, n]; weight [n]. Returns -1 if n is too wide. */
int radixrt_rms_norm(const void *x, int64_t x_stride, void *residual, void *out, const void *weight,
                     int64_t t, int64_t n, float eps, int is_bf16, int num_threads) {
    if (n > NMAX || n <= 0) return -1;
#pragma omp parallel for num_threads(num_threads) if (t * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < t; r++)
        radixrt_norm_rows(x, x_stride, residual, out, n, weight, 1, r, r + 1, n, eps, is_bf16);
    return 0;
}

/* radixrt_rms_norm of each head of n values (no residual): x [t, heads, n] with token rows
 * x_stride elements apart and heads contiguous, into out laid out alike (token rows out_stride
 * apart; out may be x: the norm in place). */
int radixrt_rms_norm_heads(const void *x, int64_t x_stride, void *out, int64_t out_stride, const void *weight,
                           int64_t t, int64_t heads, int64_t n, float eps, int is_bf16, int num_threads) {
    if (n > NMAX || n <= 0 || heads <= 0) return -1;
#pragma omp parallel for num_threads(num_threads) if (t * heads * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < t * heads; r++)
        radixrt_norm_rows(x, x_stride, NULL, out, out_stride, weight, heads, r, r + 1, n, eps, is_bf16);
    return 0;
}

int radixrt_norm_rows(const void *x, int64_t x_stride, void *residual, void *out, int64_t out_stride,
                      const void *weight, int64_t heads, int64_t r0, int64_t r1, int64_t n, float eps, int is_bf16) {
    if (n > NMAX || n <= 0 || heads <= 0 || (heads > 1 && residual != NULL)) return -1;
    const size_t elem = is_bf16 ? 2 : 4;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t tok = r / heads, head = r % heads;
        const void *xr = (const char *)x + (tok * x_stride + head * n) * elem;
        void *o = (char *)out + (tok * out_stride + head * n) * elem;
        void *res = residual == NULL ? NULL : (char *)residual + r * n * elem;
        if (is_bf16)
            rms_norm_row(xr, res, o, weight, n, eps, 1);
        else
            rms_norm_row(xr, res, o, weight, n, eps, 0);
    }
    return 0;
}

/* One token of radixrt_rope: its heads, with its cos and sin± rows (float32). */
INLINE void rope_token(void *x, int64_t heads, int64_t d, const float *cos_row, const float *sin_row,
                       int is_bf16) {
    const size_t elem = is_bf16 ? 2 : 4;
    const int64_t half = d / 2;
    float c[DMAX] __attribute__((aligned(64))), s[DMAX] __attribute__((aligned(64)));
    for (int64_t i = 0; i < d; i++) { /* the tables in the dtype, once for all heads */
        c[i] = round1(cos_row[i], is_bf16);
        s[i] = round1(sin_row[i], is_bf16);
    }
    for (int64_t hd = 0; hd < heads; hd++) {
        char *row = (char *)x + hd * d * elem;
        int64_t i = 0;
        for (; i + VL <= half; i += VL) { /* x_a = x[i..], x_b = x[half + i..]: roll pairs them */
            const vf xa = vload(row + i * elem, is_bf16), xb = vload(row + (half + i) * elem, is_bf16);
            const vf ca = vload(c + i, 0), cb = vload(c + half + i, 0);
            const vf sa = vload(s + i, 0), sb = vload(s + half + i, 0);
            vstore(row + i * elem, round_to(xa * ca, is_bf16) + round_to(xb * sa, is_bf16), is_bf16);
            vstore(row + (half + i) * elem, round_to(xb * cb, is_bf16) + round_to(xa * sb, is_bf16),
                   is_bf16);
        }
        for (; i < half; i++) {
            const float xa = load1(row, i, is_bf16), xb = load1(row, half + i, is_bf16);
            store1(row, i, round1(xa * c[i], is_bf16) + round1(xb * s[i], is_bf16), is_bf16);
            store1(row, half + i, round1(xb * c[half + i], is_bf16) + round1(xa * s[half + i], is_bf16),
                   is_bf16);
        }
    }
}

/* Neox-style rotary embedding, in place: x[t, heads, d] (token rows x_stride elements apart,
 * heads contiguous) becomes x·cos + roll(x, d/2)·sin± at each token's position, with cos and
 * sin± (sin with its first half negated) float32 tables [positions, d] rounded to the dtype
 * first, and each product and the sum rounded. Returns -1 if d is odd or over DMAX. */
int radixrt_rope(void *x, int64_t x_stride, int64_t t, int64_t heads, int64_t d,
                 const int64_t *positions, const float *cos_table, const float *sin_table, int is_bf16,
                 int num_threads) {
    if (d <= 0 || d % 2 || d > DMAX) return -1;
#pragma omp parallel for num_threads(num_threads) if (t * heads * d >= PARALLEL_MIN)
    for (int64_t r = 0; r < t; r++)
        radixrt_rope_rows(x, x_stride, r, r + 1, heads, d, positions, cos_table, sin_table, is_bf16);
    return 0;
}

int radixrt_rope_rows(void *x, int64_t x_stride, int64_t r0, int64_t r1, int64_t heads, int64_t d,
                      const int64_t *positions, const float *cos_table, const float *sin_table, int is_bf16) {
    if (d <= 0 || d % 2 || d > DMAX) return -1;
    const size_t elem = is_bf16 ? 2 : 4;
    for (int64_t r = r0; r < r1; r++) {
        void *xr = (char *)x + r * x_stride * elem;
        const float *c = cos_table + positions[r] * d, *s = sin_table + positions[r] * d;
        if (is_bf16)
            rope_token(xr, heads, d, c, s, 1);
        else
            rope_token(xr, heads, d, c, s, 0);
    }
    return 0;
}

/* One row of radixrt_silu_mul. */
INLINE void silu_mul_row(const void *x, void *out, int64_t n, int is_bf16) {
    const size_t elem = is_bf16 ? 2 : 4;
    const char *gate = x, *up = (const char *)x + n * elem;
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        const vf g = vload(gate + i * elem, is_bf16);
        const vf silu = round_to(g * vrecipf(1.0f + vexpf(-g)), is_bf16);
        vstore((char *)out + i * elem, silu * vload(up + i * elem, is_bf16), is_bf16);
    }
    for (; i < n; i++) {
        const float g = load1(gate, i, is_bf16);
        store1(out, i, round1(g / (1.0f + expf(-g)), is_bf16) * load1(up, i, is_bf16), is_bf16);
    }
}

/* Rows r0 .. r1 - 1 of radixrt_silu_mul (parts.h). */
void radixrt_silu_mul_rows(const void *x, void *out, int64_t r0, int64_t r1, int64_t n, int is_bf16) {
    const size_t elem = is_bf16 ? 2 : 4;
    for (int64_t r = r0; r < r1; r++) {
        const void *xr = (const char *)x + 2 * r * n * elem;
        void *o = (char *)out + r * n * elem;
        if (is_bf16)
            silu_mul_row(xr, o, n, 1);
        else
            silu_mul_row(xr, o, n, 0);
    }
}

/* out[t, n] = silu(x[:, :n]) · x[:, n:] for x [t, 2n] (contiguous), silu(g) = g / (1 + e^-g)
 * rounded (1 / (1 + e^-g) as vrecip: within ~1 ulp of the division), then the product rounded. */
int radixrt_silu_mul(const void *x, void *out, int64_t t, int64_t n, int is_bf16, int num_threads) {
    if (n <= 0) return -1;
    const size_t elem = is_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) if (t * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < t; r++) {
        const void *xr = (const char *)x + 2 * r * n * elem;
        void *o = (char *)out + r * n * elem;
        if (is_bf16)
            silu_mul_row(xr, o, n, 1);
        else
            silu_mul_row(xr, o, n, 0);
    }
    return 0;
}
