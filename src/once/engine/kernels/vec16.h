// 16-lane float vectors for the CPU kernels: GCC's portable vector types (one AVX-512
// register where available) and the reductions and exp the attention kernels share.
#ifndef ONCE_VEC16_H
#define ONCE_VEC16_H

#include <stdint.h>

// aligned(4): loads and stores of these types may sit at any float boundary.
typedef float v16f __attribute__((vector_size(64), aligned(4)));

typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

// Tree reduction of 16 lanes: 4 shuffle+add levels instead of a 15-add chain.
static inline float hsum16(v16f v) {
    v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));

static inline v16f splat16(float x) { return (v16f){0} + x; }

static inline v16f select16(v16i mask, v16f a, v16f b) {  // lanes of mask: -1 -> a, 0 -> b
    return (v16f)(((v16i)a & mask) | ((v16i)b & ~mask));
}

static inline v16f max16(v16f a, v16f b) { return select16(a > b, a, b); }

static inline float hmax16(v16f v) {
    v = max16(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = max16(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = max16(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = max16(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return v[0];
}

// exp of 16 lanes: x = k ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes' degree-6 polynomial
// (relative error ~1e-7), 2^k by building the float's exponent. Inputs below -87 give
// ~1e-38, not 0: callers mask what must be exactly 0.
static inline v16f exp16(v16f x) {
    x = max16(x, splat16(-87.33654f));
    x = select16(x > splat16(88.37626f), splat16(88.37626f), x);
    const v16f half = select16(x < splat16(0.f), splat16(-0.5f), splat16(0.5f));
    const v16i ki = __builtin_convertvector(x * 1.44269504088896341f + half, v16i);
    const v16f k = __builtin_convertvector(ki, v16f);
    const v16f r = x - k * 0.693359375f + k * 2.12194440e-4f;
    v16f y = 1.9875691500e-4f * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.f;
    return y * (v16f)((ki + 127) << 23);
}

#endif
