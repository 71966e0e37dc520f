// Decode attention over a paged KV cache, for CPU.
//
// One query token per sequence attends to its whole context, read block by block through
// the block table, without first gathering the context into a contiguous tensor (which
// would copy the whole KV of every sequence on every step).
//
// Algorithm (split-K "flash decoding"):
//   1. The context of each sequence is cut into partitions of part_blocks blocks. One task
//      per (sequence, partition) computes, for every query head, the scores over the
//      partition, their softmax numerators, and the weighted sum of V rows: a partial
//      (max, sum, accumulator). A task reads whole token rows (all kv heads), so K and V
//      stream through memory contiguously, one block after another.
//   2. One task per (sequence, query head) merges the partials, rescaling each by
//      exp(max_p - max).
// Several query rows per sequence (a speculative verification: the last committed token
// and k drafts, row r at context length ctx - (num_rows - 1 - r)) share one pass over the
// context: the rows become extra query heads of each kv head ("virtual heads", ordered
// kv head, row, head in group), so every K and V row is read once for all of them, and
// each virtual head masks the positions past its own row's length.
// Layouts: q, out: (num_seqs, num_rows, num_heads, head_dim); k_cache, v_cache:
// (num_blocks, block_size, num_kv_heads, head_dim); block_tables: (num_seqs,
// max_blocks_per_seq); context_lens: (num_seqs,) the length of each sequence's last row.

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

// How many blocks ahead of use the decode kernel prefetches.
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 1
#endif

// Scores of every query head against each K row of a partition. Rows are visited block by
// block (one block-table lookup per block, no division per token); each row holds all kv
// heads and is read once, contiguously. The next block's row at the same offset is
// prefetched: blocks are scattered in memory, so the hardware cannot guess it.
static inline __attribute__((always_inline)) void partition_scores(
    const float *qs, const float *k_cache, const int32_t *table, int start, int n,
    int block_size, long block_stride, long token_stride, int num_kv_heads, int group,
    int head_dim, int part_tokens, float *scores, const int NC) {
    const int first_block = start / block_size;
    const int num_blocks = (n + block_size - 1) / block_size;
    for (int b = 0; b < num_blocks; b++) {
        const float *blk = k_cache + (long)table[first_block + b] * block_stride;
        const int ahead = b + PREFETCH_BLOCKS;
        const float *next =
            ahead < num_blocks ? k_cache + (long)table[first_block + ahead] * block_stride : NULL;
        const int count = n - b * block_size < block_size ? n - b * block_size : block_size;
        for (int i = 0; i < count; i++) {
            const int j = b * block_size + i;
            const float *row = blk + i * token_stride;
            if (next)
                for (int c = 0; c < NC * num_kv_heads; c++)
                    __builtin_prefetch(next + i * token_stride + 16 * c);
            for (int g = 0; g < num_kv_heads; g++) {
                v16f kv[8];
                for (int c = 0; c < NC; c++) memcpy(&kv[c], row + g * head_dim + 16 * c, 64);
                for (int h = 0; h < group; h++) {
                    const float *qh = qs + (g * group + h) * head_dim;
                    v16f qc;
                    memcpy(&qc, qh, 64);
                    v16f acc = qc * kv[0];
                    for (int c = 1; c < NC; c++) {
                        memcpy(&qc, qh + 16 * c, 64);
                        acc += qc * kv[c];
                    }
                    scores[(g * group + h) * part_tokens + j] = hsum16(acc);
                }
            }
        }
    }
}

// acc[head] += sum_j p[head][j] * V[j] over a partition, for the query heads of kv head g
// (4 at a time, so 4 x NC accumulators stay in registers while the V rows stream past).
static inline __attribute__((always_inline)) void partition_values(
    float *acc, const float *v_cache, const int32_t *table, int start, int n, int block_size,
    long block_stride, long token_stride, int num_kv_heads, int g, int group, int head_dim,
    int part_tokens, const float *scores, const int NC) {
    const int first_block = start / block_size;
    const int num_blocks = (n + block_size - 1) / block_size;
    for (int h0 = 0; h0 < group; h0 += 4) {
        const int nh = group - h0 < 4 ? group - h0 : 4;
        v16f av[4][8];
        for (int h = 0; h < 4; h++)
            for (int c = 0; c < NC; c++) av[h][c] = (v16f){0};
        for (int b = 0; b < num_blocks; b++) {
            const float *blk = v_cache + (long)table[first_block + b] * block_stride + g * head_dim;
            // The first kv head's pass prefetches whole rows of the next block, so the
            // passes of the other kv heads over this partition find them in cache.
            const int ahead = b + PREFETCH_BLOCKS;
            const float *next = ahead < num_blocks && g == 0 && h0 == 0
                                    ? v_cache + (long)table[first_block + ahead] * block_stride
                                    : NULL;
            const int count = n - b * block_size < block_size ? n - b * block_size : block_size;
            for (int i = 0; i < count; i++) {
                const int j = b * block_size + i;
                const float *vr = blk + i * token_stride;
                if (next)
                    for (int c = 0; c < NC * num_kv_heads; c++)
                        __builtin_prefetch(next + i * token_stride + 16 * c);
                v16f vv[8];
                for (int c = 0; c < NC; c++) memcpy(&vv[c], vr + 16 * c, 64);
                for (int h = 0; h < nh; h++) {
                    const float w = scores[(g * group + h0 + h) * part_tokens + j];
                    for (int c = 0; c < NC; c++) av[h][c] += w * vv[c];
                }
            }
        }
        for (int h = 0; h < nh; h++)
            for (int c = 0; c < NC; c++)
                memcpy(acc + (g * group + h0 + h) * head_dim + 16 * c, &av[h][c], 64);
    }
}

// Virtual head vh = (g * num_rows + r) * group + h  <->  row r, real head g * group + h.
static inline long real_offset(int vh, int num_rows, int group, int num_heads, int head_dim) {
    const int g = vh / (num_rows * group), r = (vh / group) % num_rows, h = vh % group;
    return ((long)r * num_heads + g * group + h) * head_dim;
}

#define MERGE_PARALLEL_FLOATS 65536

int paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                           const int32_t *block_tables, const int32_t *context_lens,
                           float *out, int num_seqs, int num_rows, int real_heads,
                           int num_kv_heads, int head_dim, int block_size,
                           int max_blocks_per_seq, int part_blocks, float scale,
                           int num_threads) {
    // From here on the rows are heads: num_heads virtual heads, group of them per kv head.
    const int num_heads = real_heads * num_rows;
    const int real_group = real_heads / num_kv_heads;
    const int group = num_heads / num_kv_heads;
    const long seq_q = (long)num_heads * head_dim;  // floats of q (and out) per sequence
    const long token_stride = (long)num_kv_heads * head_dim;
    const long block_stride = (long)block_size * token_stride;
    const int part_tokens = part_blocks * block_size;
    const int max_parts = (max_blocks_per_seq + part_blocks - 1) / part_blocks;
    // Partial results: per (seq, part, head): [max, sum, acc[head_dim]].
    const long partial_len = head_dim + 2;
    float *partials = malloc(sizeof(float) * num_seqs * max_parts * num_heads * partial_len);
    if (!partials) return -2;
    int failed = 0;
    // Threads only where there is more than one partition to share: waking a sleeping
    // OpenMP thread costs more than a short context's whole attention (the wait policy is
    // passive, and on a VM the wake-up is an interrupt to a halted vCPU), and a batch-1
    // decode step opens this region once per layer.
    long work_items = 0;
    for (int s = 0; s < num_seqs; s++)
        work_items += (context_lens[s] + part_tokens - 1) / part_tokens;

#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads) \
    if (work_items > 1)
    for (int s = 0; s < num_seqs; s++) {
        for (int p = 0; p < max_parts; p++) {
            const int ctx = context_lens[s];
            const int start = p * part_tokens;
            if (start >= ctx) continue;
            const int n = (start + part_tokens < ctx ? start + part_tokens : ctx) - start;
            // qs, acc: (num_heads, head_dim); scores: (num_heads, part_tokens).
            float *work = malloc(sizeof(float) * num_heads * (2 * head_dim + part_tokens));
            if (!work) {
                failed = 1;
                continue;
            }
            float *qs = work, *acc = work + num_heads * head_dim;
            float *scores = acc + num_heads * head_dim;
            for (int vh = 0; vh < num_heads; vh++) {
                const float *src =
                    q + s * seq_q + real_offset(vh, num_rows, real_group, real_heads, head_dim);
                for (int d = 0; d < head_dim; d++) {
                    qs[vh * head_dim + d] = src[d] * scale;
                    acc[vh * head_dim + d] = 0.f;
                }
            }
            const int32_t *table = block_tables + (long)s * max_blocks_per_seq;
            const int vector_path = head_dim == 64 || head_dim == 128;
            // Pass 1: every query head against each K row; a kv head's row is loaded once
            // for all query heads of its group.
            if (vector_path && head_dim == 64)
                partition_scores(qs, k_cache, table, start, n, block_size, block_stride,
                             token_stride, num_kv_heads, group, head_dim, part_tokens, scores, 4);
            else if (vector_path)
                partition_scores(qs, k_cache, table, start, n, block_size, block_stride,
                             token_stride, num_kv_heads, group, head_dim, part_tokens, scores, 8);
            for (int j = 0; !vector_path && j < n; j++) {
                const int t = start + j;
                const long block_id = block_tables[(long)s * max_blocks_per_seq + t / block_size];
                const float *row = k_cache + block_id * block_stride + (t % block_size) * token_stride;
                for (int head = 0; head < num_heads; head++) {
                    const float *kr = row + (head / group) * head_dim;
                    const float *qh = qs + head * head_dim;
                    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                    for (int d = 0; d < head_dim; d++) dot += qh[d] * kr[d];
                    scores[head * part_tokens + j] = dot;
                }
            }
            // Softmax numerators; the exp loop is vectorized (libmvec) under -ffast-math.
            // A virtual head sees only its own row's context: the positions past it get
            // weight 0 (only the last partition has any).
            for (int head = 0; head < num_heads; head++) {
                float *sc = scores + head * part_tokens;
                const int row = (head / real_group) % num_rows;
                const int row_end = ctx - (num_rows - 1 - row) - start;
                const int m = row_end < n ? (row_end > 0 ? row_end : 0) : n;
                for (int j = m; j < n; j++) sc[j] = 0.f;
                float mx = -FLT_MAX;
                for (int j = 0; j < m; j++) mx = sc[j] > mx ? sc[j] : mx;
                float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                for (int j = 0; j < m; j++) {
                    const float e = expf(sc[j] - mx);
                    sc[j] = e;
                    sum += e;
                }
                float *dst = partials + (((long)s * max_parts + p) * num_heads + head) * partial_len;
                dst[0] = mx;
                dst[1] = sum;
            }
            // Pass 2: weighted sum of the V rows.
            for (int g = 0; vector_path && g < num_kv_heads; g++) {
                if (head_dim == 64)
                    partition_values(acc, v_cache, table, start, n, block_size, block_stride,
                                     token_stride, num_kv_heads, g, group, head_dim, part_tokens,
                                     scores, 4);
                else
                    partition_values(acc, v_cache, table, start, n, block_size, block_stride,
                                     token_stride, num_kv_heads, g, group, head_dim, part_tokens,
                                     scores, 8);
            }
            for (int j = 0; !vector_path && j < n; j++) {
                const int t = start + j;
                const long block_id = block_tables[(long)s * max_blocks_per_seq + t / block_size];
                const float *row = v_cache + block_id * block_stride + (t % block_size) * token_stride;
                for (int head = 0; head < num_heads; head++) {
                    const float *vr = row + (head / group) * head_dim;
                    const float w = scores[head * part_tokens + j];
                    float *ah = acc + head * head_dim;
#pragma omp simd
                    for (int d = 0; d < head_dim; d++) ah[d] += w * vr[d];
                }
            }
            for (int head = 0; head < num_heads; head++) {
                float *dst = partials + (((long)s * max_parts + p) * num_heads + head) * partial_len;
                for (int d = 0; d < head_dim; d++) dst[2 + d] = acc[head * head_dim + d];
            }
            free(work);
        }
    }
    if (failed) {
        free(partials);
        return -2;
    }

    // The merge reads (parts x head_dim) floats per head: threads only when that is a lot.
#pragma omp parallel for collapse(2) num_threads(num_threads) \
    if ((long)num_seqs * num_heads * max_parts * head_dim >= MERGE_PARALLEL_FLOATS)
    for (int s = 0; s < num_seqs; s++) {
        for (int head = 0; head < num_heads; head++) {
            const int row = (head / real_group) % num_rows;
            const int row_len = context_lens[s] - (num_rows - 1 - row);
            const int num_parts = (row_len + part_tokens - 1) / part_tokens;
            float global_max = -FLT_MAX;
            for (int p = 0; p < num_parts; p++) {
                const float *src = partials + (((long)s * max_parts + p) * num_heads + head) * partial_len;
                if (src[0] > global_max) global_max = src[0];
            }
            float *o = out + s * seq_q + real_offset(head, num_rows, real_group, real_heads, head_dim);
            for (int d = 0; d < head_dim; d++) o[d] = 0.f;
            float total = 0.f;
            for (int p = 0; p < num_parts; p++) {
                const float *src = partials + (((long)s * max_parts + p) * num_heads + head) * partial_len;
                const float w = expf(src[0] - global_max);
                total += src[1] * w;
                for (int d = 0; d < head_dim; d++) o[d] += src[2 + d] * w;
            }
            const float inv = total > 0.f ? 1.f / total : 0.f;
            for (int d = 0; d < head_dim; d++) o[d] *= inv;
        }
    }
    free(partials);
    return 0;
}

// y = x @ w^T (+ bias) for a handful of rows: the decode matmul at small batch.
//
// At one to four rows a matmul is a pass over the weights, so it is bound by memory
// bandwidth. MKL's sgemv reaches about 10 GB/s on this layout here; streaming each weight
// row once and dotting it with every input row (kept in L1) reaches about 30 GB/s.
// Output rows are split statically between threads. Layouts: x (B, K), w (N, K), y (B, N).
int small_batch_linear(const float *x, const float *w, const float *bias, float *y, int B, int N,
                       int K, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int n = 0; n < N; n++) {
        const float *wr = w + (long)n * K;
        for (int b = 0; b < B; b++) {
            const float *xb = x + (long)b * K;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int k = 0; k < K; k++) s += wr[k] * xb[k];
            y[(long)b * N + n] = s + (bias ? bias[n] : 0.f);
        }
    }
    return 0;
}

// Rows from which the elementwise kernels below split their rows between threads; under
// it the fork/join costs more than the work.
#define PARALLEL_ROWS 64

// RMSNorm, optionally adding a residual first (x += delta), in one pass over each row: at
// decode batch sizes each torch op costs more in dispatch than in arithmetic, and at
// prefill sizes the one pass beats torch's several (measured 42 vs 72 us at 512 rows).
// x, delta: (rows, dim); out = x / sqrt(mean(x^2) + eps) * weight.
int add_rms_norm(float *x, const float *delta, const float *weight, float *out, int rows,
                 int dim, float eps) {
#pragma omp parallel for if (rows >= PARALLEL_ROWS) schedule(static)
    for (int r = 0; r < rows; r++) {
        float *xr = x + (long)r * dim;
        float sum = 0.f;
        if (delta) {
            const float *dr = delta + (long)r * dim;
#pragma omp simd reduction(+ : sum)
            for (int i = 0; i < dim; i++) {
                xr[i] += dr[i];
                sum += xr[i] * xr[i];
            }
        } else {
#pragma omp simd reduction(+ : sum)
            for (int i = 0; i < dim; i++) sum += xr[i] * xr[i];
        }
        const float inv = 1.f / sqrtf(sum / dim + eps);
        float *o = out + (long)r * dim;
#pragma omp simd
        for (int i = 0; i < dim; i++) o[i] = xr[i] * inv * weight[i];
    }
    return 0;
}

// Rotary embedding in place on the first num_heads heads of each row (q and k heads are
// adjacent in the fused projection output): pairs (i, i + head_dim/2), as in Llama.
// x rows are row_stride floats apart; cos, sin: (rows, head_dim / 2).
int rope_in_place(float *x, const float *cos_t, const float *sin_t, int rows, long row_stride,
                  int num_heads, int head_dim) {
    const int half = head_dim / 2;
#pragma omp parallel for if (rows >= PARALLEL_ROWS) schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *c = cos_t + (long)r * half, *s = sin_t + (long)r * half;
        for (int h = 0; h < num_heads; h++) {
            float *x1 = x + r * row_stride + (long)h * head_dim, *x2 = x1 + half;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
    return 0;
}

// The SwiGLU gate of the MLP in one pass: out = silu(gate) * up, where each row of
// gate_up is [gate (inter) | up (inter)] as the fused gate/up matmul writes it.
// torch needs a chunk, a silu and a mul, each a pass over memory (146 us at 512 rows).
int silu_mul(const float *gate_up, float *out, int rows, int inter) {
#pragma omp parallel for if (rows >= PARALLEL_ROWS) schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (long)r * 2 * inter, *u = g + inter;
        float *o = out + (long)r * inter;
#pragma omp simd
        for (int i = 0; i < inter; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
    return 0;
}
