// Decode attention over a paged KV cache, for CPU.
//
// One query token per sequence attends to its whole context, read block by block through
// the block table, without first gathering the context into a contiguous tensor (which
// would copy the whole KV of every sequence on every step).
//
// Algorithm (split-K "flash decoding"):
//   1. The context of each sequence is cut into partitions of PART_BLOCKS blocks. One task
//      per (sequence, kv head, partition) runs an online softmax over its partition for all
//      query heads of that kv head's group at once, so each K/V row is read once per group,
//      and writes a partial (max, sum, accumulator).
//   2. One task per (sequence, query head) merges the partials, rescaling each by
//      exp(max_p - max).
// Layouts: q, out: (num_seqs, num_heads, head_dim); k_cache, v_cache: (num_blocks,
// block_size, num_kv_heads, head_dim); block_tables: (num_seqs, max_blocks_per_seq).

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 256

int paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                           const int32_t *block_tables, const int32_t *context_lens,
                           float *out, int num_seqs, int num_heads, int num_kv_heads,
                           int head_dim, int block_size, int max_blocks_per_seq,
                           int part_blocks, float scale, int num_threads) {
    const int group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK_SIZE)
        return -1;
    const long token_stride = (long)num_kv_heads * head_dim;
    const long block_stride = (long)block_size * token_stride;
    const int part_tokens = part_blocks * block_size;
    const int max_parts = (max_blocks_per_seq + part_blocks - 1) / part_blocks;
    // Partial results: per (seq, kv head, part, head in group): [max, sum, acc[head_dim]].
    const long partial_len = head_dim + 2;
    float *partials =
        malloc(sizeof(float) * num_seqs * num_kv_heads * max_parts * group * partial_len);
    if (!partials) return -2;

#pragma omp parallel for collapse(3) schedule(dynamic, 1) num_threads(num_threads)
    for (int s = 0; s < num_seqs; s++) {
        for (int g = 0; g < num_kv_heads; g++) {
            for (int p = 0; p < max_parts; p++) {
                const int ctx = context_lens[s];
                const int start = p * part_tokens;
                if (start >= ctx) continue;
                const int end = start + part_tokens < ctx ? start + part_tokens : ctx;
                float qs[MAX_GROUP][MAX_HEAD_DIM];
                float acc[MAX_GROUP][MAX_HEAD_DIM];
                float m[MAX_GROUP], l[MAX_GROUP];
                float scores[MAX_GROUP][MAX_BLOCK_SIZE];
                for (int h = 0; h < group; h++) {
                    const float *qh = q + ((long)s * num_heads + g * group + h) * head_dim;
                    for (int d = 0; d < head_dim; d++) {
                        qs[h][d] = qh[d] * scale;
                        acc[h][d] = 0.f;
                    }
                    m[h] = -FLT_MAX;
                    l[h] = 0.f;
                }
                for (int t0 = start; t0 < end; t0 += block_size) {
                    const int block_id = block_tables[(long)s * max_blocks_per_seq + t0 / block_size];
                    const int n = end - t0 < block_size ? end - t0 : block_size;
                    const float *kb = k_cache + block_id * block_stride + g * head_dim;
                    const float *vb = v_cache + block_id * block_stride + g * head_dim;
                    for (int i = 0; i < n; i++) {
                        const float *kr = kb + i * token_stride;
                        for (int h = 0; h < group; h++) {
                            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                            for (int d = 0; d < head_dim; d++) dot += qs[h][d] * kr[d];
                            scores[h][i] = dot;
                        }
                    }
                    for (int h = 0; h < group; h++) {
                        float block_max = m[h];
                        for (int i = 0; i < n; i++)
                            if (scores[h][i] > block_max) block_max = scores[h][i];
                        const float rescale = expf(m[h] - block_max);
                        l[h] *= rescale;
                        for (int d = 0; d < head_dim; d++) acc[h][d] *= rescale;
                        for (int i = 0; i < n; i++) {
                            const float w = expf(scores[h][i] - block_max);
                            const float *vr = vb + i * token_stride;
                            l[h] += w;
#pragma omp simd
                            for (int d = 0; d < head_dim; d++) acc[h][d] += w * vr[d];
                        }
                        m[h] = block_max;
                    }
                }
                for (int h = 0; h < group; h++) {
                    float *dst = partials +
                        ((((long)s * num_kv_heads + g) * max_parts + p) * group + h) * partial_len;
                    dst[0] = m[h];
                    dst[1] = l[h];
                    for (int d = 0; d < head_dim; d++) dst[2 + d] = acc[h][d];
                }
            }
        }
    }

#pragma omp parallel for collapse(2) num_threads(num_threads)
    for (int s = 0; s < num_seqs; s++) {
        for (int head = 0; head < num_heads; head++) {
            const int g = head / group, h = head % group;
            const int num_parts = (context_lens[s] + part_tokens - 1) / part_tokens;
            float global_max = -FLT_MAX;
            for (int p = 0; p < num_parts; p++) {
                const float *src = partials +
                    ((((long)s * num_kv_heads + g) * max_parts + p) * group + h) * partial_len;
                if (src[0] > global_max) global_max = src[0];
            }
            float total = 0.f;
            float result[MAX_HEAD_DIM];
            for (int d = 0; d < head_dim; d++) result[d] = 0.f;
            for (int p = 0; p < num_parts; p++) {
                const float *src = partials +
                    ((((long)s * num_kv_heads + g) * max_parts + p) * group + h) * partial_len;
                const float w = expf(src[0] - global_max);
                total += src[1] * w;
                for (int d = 0; d < head_dim; d++) result[d] += src[2 + d] * w;
            }
            float *o = out + ((long)s * num_heads + head) * head_dim;
            const float inv = total > 0.f ? 1.f / total : 0.f;
            for (int d = 0; d < head_dim; d++) o[d] = result[d] * inv;
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
