// Causal attention of a prefill chunk over the paged KV cache, in place, for CPU.
//
// The chunk's K/V are already in the cache; query i (absolute position num_prior + i)
// attends to keys 0 .. num_prior + i, read through the block table: no gather of the
// context into a contiguous tensor first. Flash-attention style: one task per (kv head,
// tile of QUERY_TILE rows); its queries are the tile's rows x the query heads of that kv
// head's group. The task walks the key tiles its last row needs (16 keys each) with an
// online softmax per query:
//   1. transpose the 16 keys of kv head g into kt[d] (one lane per key), so a query's 16
//      scores are head_dim broadcast FMAs with no horizontal reduction; the transpose is
//      shared by every query of the task;
//   2. for QUERIES_AT_ONCE queries together (independent dependency chains: one query
//      alone waits on FMA latency): s = q . kt, keys past each query's position masked,
//      running (max, sum, acc) rescaled to a new max, acc += sum_j exp(s_j - max) v_j with
//      p_j broadcast from its lane.
// Layouts as in paged_decode_attention. q: (num_tokens, num_heads, head_dim), rows
// q_row_stride floats apart (a view into the fused qkv output); out: the same, contiguous.

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

#define QUERY_TILE 32
#define KEY_TILE 16
#define QUERIES_AT_ONCE 4

// A batch of QUERIES_AT_ONCE queries against one key tile. NC: vectors per head.
static inline __attribute__((always_inline)) void attend_key_tile(
    const float *const *qs, const int *valid, const v16f *kt, const float *const *vrow,
    float *m, float *l, float *const *acc, float scale, const int NC) {
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    v16f s[QUERIES_AT_ONCE], s_odd[QUERIES_AT_ONCE], p[QUERIES_AT_ONCE];
    for (int b = 0; b < QUERIES_AT_ONCE; b++) s[b] = s_odd[b] = splat16(0.f);
    for (int d = 0; d < 16 * NC; d += 2) {
        const v16f k0 = kt[d], k1 = kt[d + 1];
        for (int b = 0; b < QUERIES_AT_ONCE; b++) {
            s[b] += qs[b][d] * k0;
            s_odd[b] += qs[b][d + 1] * k1;
        }
    }
    v16f av[QUERIES_AT_ONCE][NC];
    for (int b = 0; b < QUERIES_AT_ONCE; b++) {
        const v16i in_past = lane < valid[b];
        const v16f sb = select16(in_past, (s[b] + s_odd[b]) * scale, splat16(-FLT_MAX));
        const float tile_max = hmax16(sb);
        for (int c = 0; c < NC; c++) memcpy(&av[b][c], acc[b] + 16 * c, 64);
        if (tile_max > m[b]) {
            const float corr = expf(m[b] - tile_max);
            l[b] *= corr;
            for (int c = 0; c < NC; c++) av[b][c] *= corr;
            m[b] = tile_max;
        }
        p[b] = select16(in_past, exp16(sb - m[b]), splat16(0.f));
        l[b] += hsum16(p[b]);
    }
    // p_j is 0 for keys past a query's position, so every key of the tile can be summed.
#define ACCUMULATE_KEY(j)                                                                  \
    {                                                                                      \
        v16f vv[NC];                                                                       \
        for (int c = 0; c < NC; c++) memcpy(&vv[c], vrow[j] + 16 * c, 64);                 \
        for (int b = 0; b < QUERIES_AT_ONCE; b++) {                                        \
            const v16f pj = __builtin_shufflevector(p[b], p[b], j, j, j, j, j, j, j, j, j, \
                                                    j, j, j, j, j, j, j);                  \
            for (int c = 0; c < NC; c++) av[b][c] += pj * vv[c];                           \
        }                                                                                  \
    }
    ACCUMULATE_KEY(0) ACCUMULATE_KEY(1) ACCUMULATE_KEY(2) ACCUMULATE_KEY(3)
    ACCUMULATE_KEY(4) ACCUMULATE_KEY(5) ACCUMULATE_KEY(6) ACCUMULATE_KEY(7)
    ACCUMULATE_KEY(8) ACCUMULATE_KEY(9) ACCUMULATE_KEY(10) ACCUMULATE_KEY(11)
    ACCUMULATE_KEY(12) ACCUMULATE_KEY(13) ACCUMULATE_KEY(14) ACCUMULATE_KEY(15)
#undef ACCUMULATE_KEY
    for (int b = 0; b < QUERIES_AT_ONCE; b++)
        for (int c = 0; c < NC; c++) memcpy(acc[b] + 16 * c, &av[b][c], 64);
}

// One task: kv head g, query rows row0 .. row0 + rows - 1. Returns 0, or -2 without memory.
static inline __attribute__((always_inline)) int attend_tile(
    const float *q, const float *k_cache, const float *v_cache, const int32_t *block_table,
    float *out, int row0, int rows, int g, int num_prior, int num_heads, int group,
    int block_size, long token_stride, long q_row_stride, float scale, const int NC) {
    const int head_dim = 16 * NC;
    const int nq = rows * group;
    const int padded = (nq + QUERIES_AT_ONCE - 1) / QUERIES_AT_ONCE * QUERIES_AT_ONCE;
    // acc: padded x head_dim, then m, l: padded each, then kt: head_dim x 16.
    float *work = malloc(sizeof(float) * (padded * (head_dim + 2) + head_dim * KEY_TILE));
    if (!work) return -2;
    float *acc = work, *m = acc + (long)padded * head_dim, *l = m + padded;
    v16f *kt = (v16f *)(l + padded);
    for (long i = 0; i < (long)padded * head_dim; i++) acc[i] = 0.f;
    for (int i = 0; i < padded; i++) m[i] = -FLT_MAX, l[i] = 0.f;
    const long block_stride = block_size * token_stride;
    const int last_key = num_prior + row0 + rows - 1;  // the tile's last row sees up to it
    for (int k0 = 0; k0 <= last_key; k0 += KEY_TILE) {
        const int nk = last_key + 1 - k0 < KEY_TILE ? last_key + 1 - k0 : KEY_TILE;
        const float *krow[KEY_TILE], *vrow[KEY_TILE];
        for (int j = 0; j < KEY_TILE; j++) {
            const int t = k0 + (j < nk ? j : 0);  // past the last key: any row, weight 0
            const long off = (long)block_table[t / block_size] * block_stride +
                             (t % block_size) * token_stride + (long)g * head_dim;
            krow[j] = k_cache + off;
            vrow[j] = v_cache + off;
        }
        float *ktf = (float *)kt;
        for (int j = 0; j < KEY_TILE; j++)
            for (int d = 0; d < head_dim; d++) ktf[d * KEY_TILE + j] = krow[j][d];
        // Rows before first_row see none of these keys.
        const int first_row = k0 - num_prior - row0 > 0 ? k0 - num_prior - row0 : 0;
        const int first = first_row * group / QUERIES_AT_ONCE * QUERIES_AT_ONCE;
        for (int qi = first; qi < padded; qi += QUERIES_AT_ONCE) {
            const float *qs[QUERIES_AT_ONCE];
            float *accs[QUERIES_AT_ONCE];
            int valid[QUERIES_AT_ONCE];
            for (int b = 0; b < QUERIES_AT_ONCE; b++) {
                const int query = qi + b < nq ? qi + b : nq - 1;  // padding repeats the last
                const int r = query / group, h = query % group;
                const int seen = num_prior + row0 + r - k0 + 1;  // keys of the tile it sees
                valid[b] = qi + b < nq ? (seen < nk ? (seen > 0 ? seen : 0) : nk) : 0;
                qs[b] = q + (long)(row0 + r) * q_row_stride + (long)(g * group + h) * head_dim;
                accs[b] = acc + (long)(qi + b) * head_dim;
            }
            attend_key_tile(qs, valid, kt, vrow, m + qi, l + qi, accs, scale, NC);
        }
    }
    for (int qi = 0; qi < nq; qi++) {
        const int r = qi / group, h = qi % group;
        const float inv = l[qi] > 0.f ? 1.f / l[qi] : 0.f;
        float *o = out + ((long)(row0 + r) * num_heads + g * group + h) * head_dim;
        for (int d = 0; d < head_dim; d++) o[d] = acc[(long)qi * head_dim + d] * inv;
    }
    free(work);
    return 0;
}

// Returns 0; -1 for a head size it does not handle (64, 128 and 32 are); -2 without memory.
int paged_prefill_attention(const float *q, const float *k_cache, const float *v_cache,
                            const int32_t *block_table, float *out, int num_tokens,
                            int num_prior, int num_heads, int num_kv_heads, int head_dim,
                            int block_size, long q_row_stride, float scale, int num_threads) {
    if (head_dim != 32 && head_dim != 64 && head_dim != 128) return -1;
    const int group = num_heads / num_kv_heads;
    const long token_stride = (long)num_kv_heads * head_dim;
    const int num_tiles = (num_tokens + QUERY_TILE - 1) / QUERY_TILE;
    int failed = 0;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
    for (int tile = num_tiles - 1; tile >= 0; tile--) {  // the longest (last) tiles first
        for (int g = 0; g < num_kv_heads; g++) {
            const int row0 = tile * QUERY_TILE;
            const int rows = num_tokens - row0 < QUERY_TILE ? num_tokens - row0 : QUERY_TILE;
            int rc;
#define ATTEND(NC)                                                                            \
    attend_tile(q, k_cache, v_cache, block_table, out, row0, rows, g, num_prior, num_heads, \
                group, block_size, token_stride, q_row_stride, scale, NC)
            if (head_dim == 64)
                rc = ATTEND(4);
            else if (head_dim == 128)
                rc = ATTEND(8);
            else
                rc = ATTEND(2);
#undef ATTEND
            if (rc) failed = 1;
        }
    }
    return failed ? -2 : 0;
}
