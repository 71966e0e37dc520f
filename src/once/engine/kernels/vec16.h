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

// 2^x of 16 lanes for x <= 0 (a softmax's shifted scores in log2 units): x = k + f with
// k = round(x), |f| <= 1/2; 2^f by its Taylor polynomial of degree 7 in f (relative error
// ~1e-8 before rounding), 2^k by building the float's exponent. Inputs below -126 give
// 2^-126, not 0: callers mask what must be exactly 0.
static inline v16f exp2_nonpositive16(v16f x) {
    x = max16(x, splat16(-126.f));
    const v16i k = __builtin_convertvector(x - 0.5f, v16i);  // truncation: nearest for x <= 0
    const v16f f = x - __builtin_convertvector(k, v16f);
    v16f y = 1.5252733804059840e-5f * f + 1.5403530393381608e-4f;
    y = y * f + 1.3333558146428443e-3f;
    y = y * f + 9.6181291076284772e-3f;
    y = y * f + 5.5504108664821580e-2f;
    y = y * f + 2.4022650695910071e-1f;
    y = y * f + 6.9314718055994531e-1f;
    y = y * f + 1.f;
    return y * (v16f)((k + 127) << 23);
}

#endif
