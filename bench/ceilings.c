/* This CPU's ceilings, for the benchmarks (bench/ceilings.py): the register-only throughput of
 * float32 FMA and of vdpbf16ps, and the speed of a read-only stream from memory.
 *
 * Built with the CPU kernels' compiler, flags and headers (radixrt_kernels/cpu/common.h: the
 * build's vectors vf of VL lanes), so a ceiling is measured on the vectors the kernels use.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

/* Register-only throughput loops (a benchmark's ceilings): `iters` rounds of 12 independent
 * accumulators per thread, by FMA (kind 0: 32 flops per instruction with AVX-512) or vdpbf16ps
 * (kind 1: 64 flops per instruction). Returns a sum of the results (so nothing is optimized
 * away), or -1 for a kind this build lacks. */
double radixrt_peak(int kind, int64_t iters, int num_threads) {
    double total = 0;
#ifndef __AVX512BF16__
    if (kind == 1) return -1;
#endif
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        if (kind == 0) { /* 12 chains of the build's vectors, 16 / VL rounds: 12 × 32 flops a round */
            vf a[12];
            for (int j = 0; j < 12; j++) a[j] = (vf){0} + 1e-3f * (float)j;
            const vf s = (vf){0} + 0.999f, t = (vf){0} + 1e-7f;
            for (int64_t it = 0; it < iters; it++)
                for (int h = 0; h < 16 / VL; h++)
                    for (int j = 0; j < 12; j++) a[j] = a[j] * s + t;
            for (int j = 0; j < 12; j++) total += vhsum(a[j]);
        }
#ifdef __AVX512BF16__
        else {
            v16 a[12];
            for (int j = 0; j < 12; j++) a[j] = (v16){0} + 1e-3f * (float)j;
            const v16 s = (v16){0} + 0.999f, t = (v16){0} + 1e-7f;
            const __m512bh u = _mm512_cvtne2ps_pbh((__m512)s, (__m512)s);
            const __m512bh v = _mm512_cvtne2ps_pbh((__m512)t, (__m512)t);
            for (int64_t it = 0; it < iters; it++)
                for (int j = 0; j < 12; j++) a[j] = (v16)_mm512_dpbf16_ps((__m512)a[j], u, v);
            for (int j = 0; j < 12; j++) total += hsum(a[j]);
        }
#endif
    }
    return total;
}

/* Read `bytes` at p once (threads split it; 64-byte lines); returns a sum of what was read. */
double radixrt_stream_read(const void *p, int64_t bytes, int num_threads) {
    double total = 0;
    const int64_t lines = bytes / 64;
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t l0 = lines * id / threads, l1 = lines * (id + 1) / threads;
        vf s[2][16 / VL] = {{{0}}}; /* two lines a step, each as 16 / VL vectors */
        for (int64_t l = l0; l + 1 < l1; l += 2)
            for (int u = 0; u < 2; u++)
                for (int h = 0; h < 16 / VL; h++) {
                    vf a;
                    memcpy(&a, (const char *)p + (l + u) * 64 + h * 4 * VL, sizeof a);
                    s[u][h] += a;
                }
        for (int u = 0; u < 2; u++)
            for (int h = 0; h < 16 / VL; h++) total += vhsum(s[u][h]);
    }
    return total;
}
