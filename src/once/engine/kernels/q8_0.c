// Matmuls over Q8_0 weights (llama.cpp's 8-bit format), fp32 activations, for CPU.
//
// A weight (N, K) is stored as q: int8 (N, K) and scales: fp16 (N, K / 32), one scale per
// block of 32 along K; w[n][k] = scales[n][k / 32] * q[n][k]. y = x W^T + bias for x
// (B, K), y (B, N).
//
// Algorithm: each thread takes a run of output rows (tiles of TILE_N rows, so a tile's
// weights, at most TILE_N x K bytes, stay in L2 across the chunks of x below). For every
// chunk of up to 8 rows of x, R output rows at a time go through all K: per block, each
// of the R weight rows is widened to fp32 once (int8 -> int32 -> float, times its scale)
// and that dequantized block is FMA'd into every x row of the chunk, so the widening is
// paid once per chunk and R x chunk independent accumulators hide the FMA latency:
//
//           x chunk (nb rows)      weight tile (TILE_N rows)
//   acc[r][b] += sum over blocks j of (scale[r][j] * q[r][j*32 .. j*32+31]) . x[b][j*32 ..]
//
// At decode sizes (B <= 8) there is one chunk and the pass over the weights is one stream
// of a quarter of fp32's bytes: the step is bound by memory bandwidth, which is the point.

#include <stdint.h>
#include <string.h>

#include "vec16.h"

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define Q8_0_BLOCK 32
#define MAX_CHUNK_ROWS 8
#define TILE_N 32

typedef int8_t v16b __attribute__((vector_size(16), aligned(1)));

static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    // IEEE binary16 -> binary32 by hand: rebias the exponent (15 -> 127), widen the
    // mantissa; subnormal halves are mantissa x 2^-24; inf/nan keep an all-ones exponent.
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    uint32_t bits;
    float f;
    if (exponent == 0) {
        f = (float)mantissa * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    if (exponent == 31)
        bits = sign | 0x7f800000u | (mantissa << 13);
    else
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    memcpy(&f, &bits, 4);
    return f;
#endif
}

// 16 int8 weights widened to floats. GCC 12 turns __builtin_convertvector from int8 (to
// int32 or float) into 16 scalar conversions, so AVX-512 gets its two instructions
// (vpmovsxbd, vcvtdq2ps) by name; other CPUs take the portable, slower form.
static inline v16f widen16(const int8_t *q) {
#ifdef __AVX512F__
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    v16f out;
    memcpy(&out, &f, 64);
    return out;
#else
    v16b b;
    memcpy(&b, q, 16);
    return __builtin_convertvector(__builtin_convertvector(b, v16i), v16f);
#endif
}

// a * b + c as one FMA. Under -ffast-math GCC reassociates acc + a*b + c*d into
// acc + (a*b + c*d): a mul, an FMA and an add where two FMAs do; the intrinsic is opaque.
static inline v16f fma16(v16f a, v16f b, v16f c) {
#ifdef __AVX512F__
    __m512 va, vb, vc;
    memcpy(&va, &a, 64);
    memcpy(&vb, &b, 64);
    memcpy(&vc, &c, 64);
    const __m512 r = _mm512_fmadd_ps(va, vb, vc);
    v16f out;
    memcpy(&out, &r, 64);
    return out;
#else
    return a * b + c;
#endif
}

// R weight rows against nb rows of x (R, nb compile-time after inlining: the loops unroll
// and acc stays in registers). out[r * out_stride + b] gets the dot of row r with x row b.
static inline __attribute__((always_inline)) void dot_rows(
    const float *x, const int8_t *q, const uint16_t *scales, int K, float *out, long out_stride,
    const int R, const int nb) {
    const int num_blocks = K / Q8_0_BLOCK;
    v16f acc[4][MAX_CHUNK_ROWS];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < nb; b++) acc[r][b] = (v16f){0};
    for (int j = 0; j < num_blocks; j++) {
        const long k = (long)j * Q8_0_BLOCK;
        for (int r = 0; r < R; r++) {
            const float d = half_to_float(scales[(long)r * num_blocks + j]);
            const int8_t *qr = q + (long)r * K + k;
            // The next group of R rows (the same offset, R rows on) is fetched while this
            // one computes: the widening makes the loop too slow for the hardware
            // prefetcher alone to keep the stream ahead.
            __builtin_prefetch(qr + (long)R * K);
            const v16f w0 = widen16(qr) * d, w1 = widen16(qr + 16) * d;
            for (int b = 0; b < nb; b++) {
                v16f x0, x1;
                memcpy(&x0, x + (long)b * K + k, 64);
                memcpy(&x1, x + (long)b * K + k + 16, 64);
                acc[r][b] = fma16(w1, x1, fma16(w0, x0, acc[r][b]));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < nb; b++) out[r * out_stride + b] = hsum16(acc[r][b]);
}

// Output rows [n0, n1) for one chunk of nb x rows: R rows at a time, the rest one by one.
static inline __attribute__((always_inline)) void chunk_rows(
    const float *x, const int8_t *q, const uint16_t *scales, int n0, int n1, int K,
    float *dots, const int R, const int nb) {
    const int num_blocks = K / Q8_0_BLOCK;
    int n = n0;
    for (; n + R <= n1; n += R)
        dot_rows(x, q + (long)n * K, scales + (long)n * num_blocks, K, dots + (n - n0) * nb,
                 nb, R, nb);
    for (; n < n1; n++)
        dot_rows(x, q + (long)n * K, scales + (long)n * num_blocks, K, dots + (n - n0) * nb,
                 nb, 1, nb);
}

// Fewer x rows leave registers for more weight rows: 4 weight rows up to 2 x rows, else 2.
static void chunk_dispatch(const float *x, const int8_t *q, const uint16_t *scales, int n0,
                           int n1, int K, float *dots, int nb) {
    switch (nb) {
        case 1: chunk_rows(x, q, scales, n0, n1, K, dots, 4, 1); break;
        case 2: chunk_rows(x, q, scales, n0, n1, K, dots, 4, 2); break;
        case 3: chunk_rows(x, q, scales, n0, n1, K, dots, 2, 3); break;
        case 4: chunk_rows(x, q, scales, n0, n1, K, dots, 2, 4); break;
        case 5: chunk_rows(x, q, scales, n0, n1, K, dots, 2, 5); break;
        case 6: chunk_rows(x, q, scales, n0, n1, K, dots, 2, 6); break;
        case 7: chunk_rows(x, q, scales, n0, n1, K, dots, 2, 7); break;
        default: chunk_rows(x, q, scales, n0, n1, K, dots, 2, 8); break;
    }
}

// y = x W^T (+ bias). K must be a multiple of 32 (the caller keeps other weights in fp32).
int q8_0_linear(const float *x, const int8_t *q, const uint16_t *scales, const float *bias,
                float *y, int B, int N, int K, int num_threads) {
    if (K % Q8_0_BLOCK) return -1;
    const int num_tiles = (N + TILE_N - 1) / TILE_N;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int t = 0; t < num_tiles; t++) {
        const int n0 = t * TILE_N, n1 = n0 + TILE_N < N ? n0 + TILE_N : N;
        float dots[TILE_N * MAX_CHUNK_ROWS];  // (tile row, chunk row)
        for (int b0 = 0; b0 < B; b0 += MAX_CHUNK_ROWS) {
            const int nb = B - b0 < MAX_CHUNK_ROWS ? B - b0 : MAX_CHUNK_ROWS;
            chunk_dispatch(x + (long)b0 * K, q, scales, n0, n1, K, dots, nb);
            for (int n = n0; n < n1; n++)
                for (int b = 0; b < nb; b++)
                    y[(long)(b0 + b) * N + n] = dots[(n - n0) * nb + b] + (bias ? bias[n] : 0.f);
        }
    }
    return 0;
}

// The fp32 weight (N, K) back from its Q8_0 form, for the prefill path's GEMM.
int q8_0_dequantize(const int8_t *q, const uint16_t *scales, float *w, int N, int K,
                    int num_threads) {
    if (K % Q8_0_BLOCK) return -1;
    const int num_blocks = K / Q8_0_BLOCK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int n = 0; n < N; n++) {
        for (int j = 0; j < num_blocks; j++) {
            const long k = (long)n * K + (long)j * Q8_0_BLOCK;
            const float d = half_to_float(scales[(long)n * num_blocks + j]);
            const v16f w0 = widen16(q + k) * d, w1 = widen16(q + k + 16) * d;
            memcpy(w + k, &w0, 64);
            memcpy(w + k + 16, &w1, 64);
        }
    }
    return 0;
}
