// Causal attention of a prefill chunk over the paged KV cache, in place, for CPU.
//
// The chunk's K/V are already in the cache; query i (absolute position num_prior + i)
// attends to keys 0 .. num_prior + i, read through the block table: no gather of the
// context into a contiguous tensor first. Flash attention shaped as small GEMMs: one task
// per (kv head, tile of QUERY_TILE rows); its queries are the tile's rows x the query
// heads of that kv head's group, packed once, transposed and pre-scaled (qt: head_dim
// rows of `padded` queries). The task walks the key tiles (KEY_TILE keys) its last row
// needs, and for each:
//   1. S^T = K . Q^T in register blocks of SCORE_KEYS keys x 32 queries: each step of d
//      loads two query vectors of qt and broadcasts one float per key straight from the
//      paged cache (no transposed copy of K); the column max is raised on the way;
//   2. an online softmax down the columns, 16 queries a vector: keys past a query's
//      position masked, the running max raised, P = 2^(S - max) in place of S, and the
//      factor that rescales its earlier output kept; all lane-wise, no horizontal
//      reduction;
//   3. O = O * factor + P . V in register blocks of 16 / (head_dim / 16) queries x
//      head_dim: each key, head_dim / 16 loads of its V row and one broadcast per query.
// Both products keep 16 accumulators and their operands in the 32 vector registers and
// run near the FMA units' rate; the next key tile is prefetched while one is computed.
// Layouts as in paged_decode_attention. q: (num_tokens, num_heads, head_dim), rows
// q_row_stride floats apart (a view into the fused qkv output); out: the same, contiguous.

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

#define QUERY_TILE 32
#define KEY_TILE 64
#define SCORE_KEYS 8  // keys per register block of S^T; KEY_TILE is a multiple

static inline void prefetch_rows(const float *const *rows, int n, int head_dim) {
    for (int j = 0; j < n; j++)
        for (int d = 0; d < head_dim; d += 16) __builtin_prefetch(rows[j] + d, 0, 1);
}

// st[j][q .. q + 16 QV) = k_j . q for SCORE_KEYS keys and QV vectors of 16 queries; qt
// is the task's queries transposed (head_dim rows of `stride` floats), st has rows of
// `stride` too. Each d: QV loads of qt, one broadcast per key, SCORE_KEYS x QV FMAs. The
// running column max `top` (per query, over every key scored so far) is raised as well.
static inline __attribute__((always_inline)) void score_block(const float *const *krow,
                                                              const float *qt, float *st,
                                                              float *top, int stride,
                                                              int head_dim, const int QV) {
    v16f acc[SCORE_KEYS][2];
    for (int j = 0; j < SCORE_KEYS; j++)
        for (int c = 0; c < QV; c++) acc[j][c] = splat16(0.f);
    for (int d = 0; d < head_dim; d++) {
        v16f qd[2];
        for (int c = 0; c < QV; c++) memcpy(&qd[c], qt + (long)d * stride + 16 * c, 64);
        for (int j = 0; j < SCORE_KEYS; j++) {
            const float kd = krow[j][d];
            for (int c = 0; c < QV; c++) acc[j][c] += kd * qd[c];
        }
    }
    for (int c = 0; c < QV; c++) {
        v16f most;
        memcpy(&most, top + 16 * c, 64);
        for (int j = 0; j < SCORE_KEYS; j++) {
            memcpy(st + (long)j * stride + 16 * c, &acc[j][c], 64);
            most = max16(most, acc[j][c]);
        }
        memcpy(top + 16 * c, &most, 64);
    }
}

// Online softmax of 16 queries over the tile's nk keys (rows of st, `stride` apart), in
// place: P = 2^(S - max) (S in log2 units) for what each query sees (key k0 + j up to its position pos),
// 0 for the rest; max m and sum l updated. Returns the factor earlier outputs scale by.
// `top` is the max over every scored key (score_block's); where the tile reaches past a
// query's position it may count keys the query does not see, so the max is taken again.
// Every operation is across the 16 queries, so no horizontal reduction is needed.
static inline v16f softmax_columns(float *st, int stride, int nk, int k0, v16i pos, int masked,
                                   v16f top, v16f *m, v16f *l) {
    if (masked) {
        top = *m;
        for (int j = 0; j < nk; j++) {
            v16f s;
            memcpy(&s, st + (long)j * stride, 64);
            top = max16(top, select16(pos >= k0 + j, s, splat16(-FLT_MAX)));
        }
    } else {
        top = max16(top, *m);
    }
    const v16f factor = exp2_nonpositive16(*m - top);  // *m = -FLT_MAX at first: 2^-126, times 0
    v16f sum = splat16(0.f);
    for (int j = 0; j < nk; j++) {
        v16f s;
        memcpy(&s, st + (long)j * stride, 64);
        v16f p = exp2_nonpositive16(s - top);
        if (masked) p = select16(pos >= k0 + j, p, splat16(0.f));
        sum += p;
        memcpy(st + (long)j * stride, &p, 64);
    }
    *l = *l * factor + sum;
    *m = top;
    return factor;
}

// o_b = o_b * factor_b + sum_j p[j][b] v_j over nk keys, for 16 / NC queries (o rows of
// head_dim = 16 NC floats). Each key: NC loads of its V row, one broadcast per query.
static inline __attribute__((always_inline)) void value_block(const float *pt, int stride,
                                                              const float *const *vrow, int nk,
                                                              float *o, const float *factor,
                                                              const int NC) {
    const int rows = 16 / NC;
    v16f acc[8][8];
    for (int b = 0; b < rows; b++)
        for (int c = 0; c < NC; c++) {
            memcpy(&acc[b][c], o + b * 16 * NC + 16 * c, 64);
            acc[b][c] *= factor[b];
        }
    for (int j = 0; j < nk; j++) {
        v16f v[8];
        for (int c = 0; c < NC; c++) memcpy(&v[c], vrow[j] + 16 * c, 64);
        for (int b = 0; b < rows; b++) {
            const float pj = pt[(long)j * stride + b];
            for (int c = 0; c < NC; c++) acc[b][c] += pj * v[c];
        }
    }
    for (int b = 0; b < rows; b++)
        for (int c = 0; c < NC; c++) memcpy(o + b * 16 * NC + 16 * c, &acc[b][c], 64);
}

// The rows of one key tile: K and V of keys k0 .. k0 + nk - 1 of kv head g, then repeats
// of the first key up to a multiple of SCORE_KEYS (scored, then masked away).
static void tile_rows(const float *k_cache, const float *v_cache, const int32_t *block_table,
                      int k0, int nk, int g, int head_dim, int block_size, long token_stride,
                      const float **krow, const float **vrow) {
    const long block_stride = block_size * token_stride;
    for (int j = 0; j < KEY_TILE; j++) {
        const int t = k0 + (j < nk ? j : 0);
        const long off = (long)block_table[t / block_size] * block_stride +
                         (t % block_size) * token_stride + (long)g * head_dim;
        krow[j] = k_cache + off;
        vrow[j] = v_cache + off;
    }
}

// What every task of one call shares.
struct problem {
    const float *q, *k_cache, *v_cache;
    const int32_t *block_table;
    float *out;
    int num_prior, num_heads, group, block_size;
    long token_stride, q_row_stride;
    float scale2;  // softmax scale x log2 e: scores in log2 units, so the softmax takes 2^x
};

// A task's result when the keys are split over parts: per query of the chunk (row-major
// (token, head)), the unnormalized output and its running max and sum.
struct partial {
    float *o, *m, *l;
};

// One task: kv head g, query rows row0 .. row0 + rows - 1, keys key_begin (a multiple of
// KEY_TILE) up to key_end or the rows' last position. Writes the normalized output into
// pr->out, or with `part` its unnormalized (o, m, l) there. Returns 0, or -2 without memory.
static inline __attribute__((always_inline)) int attend_tile(const struct problem *pr,
                                                             int row0, int rows, int g,
                                                             int key_begin, int key_end,
                                                             const struct partial *part,
                                                             const int NC) {
    const int head_dim = 16 * NC, group = pr->group;
    const int nq = rows * group;  // query i: row i / group, head g * group + i % group
    const int padded = (nq + 15) / 16 * 16;
    // qt: head_dim x padded (queries transposed, pre-scaled); st: KEY_TILE x padded;
    // o: padded x head_dim; then m, l, factor, top: padded each.
    float *work;
    const long floats = (long)padded * (2 * head_dim + KEY_TILE + 4);
    if (posix_memalign((void **)&work, 64, sizeof(float) * floats)) return -2;
    float *qt = work, *st = qt + (long)head_dim * padded, *o = st + (long)KEY_TILE * padded;
    float *m = o + (long)padded * head_dim, *l = m + padded, *factor = l + padded;
    float *top = factor + padded;
    for (int i = 0; i < padded; i++) {
        const float *src = pr->q + (long)(row0 + i / group) * pr->q_row_stride +
                           (long)(g * group + i % group) * head_dim;
        for (int d = 0; d < head_dim; d++)
            qt[(long)d * padded + i] = i < nq ? src[d] * pr->scale2 : 0.f;
        m[i] = -FLT_MAX, l[i] = 0.f;
    }
    memset(o, 0, sizeof(float) * padded * head_dim);
    const int num_prior = pr->num_prior;
    int last_key = num_prior + row0 + rows - 1;  // the tile's last row sees up to it
    if (last_key > key_end - 1) last_key = key_end - 1;
    const float *krow[KEY_TILE], *vrow[KEY_TILE], *next_k[KEY_TILE], *next_v[KEY_TILE];
    if (key_begin <= last_key) {
        const int nk0 = last_key + 1 - key_begin < KEY_TILE ? last_key + 1 - key_begin : KEY_TILE;
        tile_rows(pr->k_cache, pr->v_cache, pr->block_table, key_begin, nk0, g, head_dim,
                  pr->block_size, pr->token_stride, krow, vrow);
    }
    for (int k0 = key_begin; k0 <= last_key; k0 += KEY_TILE) {
        const int nk = last_key + 1 - k0 < KEY_TILE ? last_key + 1 - k0 : KEY_TILE;
        const int k1 = k0 + KEY_TILE;
        if (k1 <= last_key) {  // the next tile's rows, fetched while this one computes
            const int next_nk = last_key + 1 - k1 < KEY_TILE ? last_key + 1 - k1 : KEY_TILE;
            tile_rows(pr->k_cache, pr->v_cache, pr->block_table, k1, next_nk, g, head_dim,
                      pr->block_size, pr->token_stride, next_k, next_v);
            prefetch_rows(next_k, next_nk, head_dim);
            prefetch_rows(next_v, next_nk, head_dim);
        }
        // Queries before `first` (rows before the tile's first key) see none of it.
        const int first_row = k0 - num_prior - row0 > 0 ? k0 - num_prior - row0 : 0;
        const int first = first_row * group / 16 * 16;
        const int scored = (nk + SCORE_KEYS - 1) / SCORE_KEYS * SCORE_KEYS;
        for (int i = first; i < padded; i++) top[i] = -FLT_MAX;
        for (int j = 0; j < scored; j += SCORE_KEYS) {
            float *st_j = st + (long)j * padded;
            int i = first;
            for (; i + 32 <= padded; i += 32)
                score_block(krow + j, qt + i, st_j + i, top + i, padded, head_dim, 2);
            if (i < padded) score_block(krow + j, qt + i, st_j + i, top + i, padded, head_dim, 1);
        }
        // The tile reaches the chunk's rows, or has padding keys past the last.
        const int masked = k0 + nk - 1 > num_prior + row0 || nk < scored;
        const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        for (int i = first; i < padded; i += 16) {
            // Position of each query; padding queries get -1 and see nothing.
            const v16i idx = lane + i;
            v16i pos;
            for (int x = 0; x < 16; x++) pos[x] = idx[x] < nq ? num_prior + row0 + idx[x] / group : -1;
            v16f mv, lv, tv;
            memcpy(&mv, m + i, 64);
            memcpy(&lv, l + i, 64);
            memcpy(&tv, top + i, 64);
            const v16f f = softmax_columns(st + i, padded, nk, k0, pos, masked, tv, &mv, &lv);
            memcpy(m + i, &mv, 64);
            memcpy(l + i, &lv, 64);
            memcpy(factor + i, &f, 64);
        }
        for (int i = first; i < padded; i += 16 / NC)
            value_block(st + i, padded, vrow, nk, o + (long)i * head_dim, factor + i, NC);
        if (k1 <= last_key) {
            memcpy(krow, next_k, sizeof krow);
            memcpy(vrow, next_v, sizeof vrow);
        }
    }
    for (int i = 0; i < nq; i++) {
        const long query = (long)(row0 + i / group) * pr->num_heads + g * group + i % group;
        const float *src = o + (long)i * head_dim;
        if (part) {
            memcpy(part->o + query * head_dim, src, sizeof(float) * head_dim);
            part->m[query] = m[i], part->l[query] = l[i];
        } else {
            const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
            for (int d = 0; d < head_dim; d++) pr->out[query * head_dim + d] = src[d] * inv;
        }
    }
    free(work);
    return 0;
}

// How many parts to split the keys into, so a call with few (tile, kv head) tasks (a short
// chunk after a long prefix) still gives every thread several tasks to balance; parts of
// at least MIN_PART_KEYS keys, so each still amortizes its packing of the queries.
#define TASKS_PER_THREAD 4
#define MIN_PART_KEYS 512
static int key_parts(int tasks, int total_keys, int num_threads) {
    const int wanted = TASKS_PER_THREAD * num_threads;
    if (tasks >= wanted) return 1;
    int parts = (wanted + tasks - 1) / tasks;
    if (parts > total_keys / MIN_PART_KEYS) parts = total_keys / MIN_PART_KEYS;
    return parts > 1 ? parts : 1;
}

// out = the parts' outputs weighted by their share of the softmax: with M the largest of
// the parts' maxima, sum_p o_p 2^(m_p - M) / sum_p l_p 2^(m_p - M).
static void merge_parts(const struct partial *parts, int num_parts, float *out, long queries,
                        int head_dim, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long query = 0; query < queries; query++) {
        float top = -FLT_MAX, sum = 0.f;
        for (int p = 0; p < num_parts; p++)
            if (parts[p].m[query] > top) top = parts[p].m[query];
        float *dst = out + query * head_dim;
        for (int d = 0; d < head_dim; d++) dst[d] = 0.f;
        for (int p = 0; p < num_parts; p++) {
            if (parts[p].l[query] <= 0.f) continue;  // a part this query sees no key of
            const float w = exp2f(parts[p].m[query] - top);
            sum += parts[p].l[query] * w;
            const float *o = parts[p].o + query * head_dim;
            for (int d = 0; d < head_dim; d++) dst[d] += o[d] * w;
        }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int d = 0; d < head_dim; d++) dst[d] *= inv;
    }
}

// Returns 0; -1 for a head size it does not handle (64, 128 and 32 are); -2 without memory.
int paged_prefill_attention(const float *q, const float *k_cache, const float *v_cache,
                            const int32_t *block_table, float *out, int num_tokens,
                            int num_prior, int num_heads, int num_kv_heads, int head_dim,
                            int block_size, long q_row_stride, float scale, int num_threads) {
    if (head_dim != 32 && head_dim != 64 && head_dim != 128) return -1;
    const struct problem pr = {
        q, k_cache, v_cache, block_table, out, num_prior, num_heads, num_heads / num_kv_heads,
        block_size, (long)num_kv_heads * head_dim, q_row_stride, scale * 1.44269504088896341f,
    };
    const int num_tiles = (num_tokens + QUERY_TILE - 1) / QUERY_TILE;
    const int total_keys = num_prior + num_tokens;
    int num_parts = key_parts(num_tiles * num_kv_heads, total_keys, num_threads);
    const long queries = (long)num_tokens * num_heads;
    struct partial parts[64];
    if (num_parts > 64) num_parts = 64;
    float *partial_buffer = NULL;
    if (num_parts > 1) {
        partial_buffer = malloc(sizeof(float) * num_parts * queries * (head_dim + 2));
        if (!partial_buffer) num_parts = 1;  // unsplit: slower, not wrong
        for (int p = 0; p < num_parts && partial_buffer; p++) {
            float *base = partial_buffer + p * queries * (head_dim + 2);
            parts[p] = (struct partial){base, base + queries * head_dim,
                                        base + queries * (head_dim + 1)};
        }
    }
    // Part p: keys from p * part_keys, a whole number of key tiles.
    const int part_keys = ((total_keys + num_parts - 1) / num_parts + KEY_TILE - 1) / KEY_TILE *
                          KEY_TILE;
    const int tasks = num_tiles * num_kv_heads * num_parts;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int task = 0; task < tasks; task++) {
        const int tile = num_tiles - 1 - task / (num_kv_heads * num_parts);  // longest first
        const int g = task / num_parts % num_kv_heads, p = task % num_parts;
        const int row0 = tile * QUERY_TILE;
        const int rows = num_tokens - row0 < QUERY_TILE ? num_tokens - row0 : QUERY_TILE;
        const struct partial *part = num_parts > 1 ? &parts[p] : NULL;
        const int key_begin = p * part_keys, key_end = key_begin + part_keys;
        int rc;
#define ATTEND(NC) attend_tile(&pr, row0, rows, g, key_begin, key_end, part, NC)
        if (head_dim == 64)
            rc = ATTEND(4);
        else if (head_dim == 128)
            rc = ATTEND(8);
        else
            rc = ATTEND(2);
#undef ATTEND
        if (rc) failed = 1;
    }
    if (num_parts > 1 && !failed) merge_parts(parts, num_parts, out, queries, head_dim, num_threads);
    free(partial_buffer);
    return failed ? -2 : 0;
}
