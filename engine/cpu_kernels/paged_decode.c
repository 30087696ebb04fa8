/* Paged decode attention on the CPU: one query token per sequence attends to its context straight from the
 * paged KV cache, reading each key and value once (the torch path gathers the blocks into a copy, then SDPA reads
 * the copy: three passes over the KV). Built and loaded by paged_decode.py; semantics are
 * engine.model.torch_attention.paged_attention's decode branch (causal, optional sliding window, GQA as
 * transformers' repeat_kv: query head j uses KV head j / (H / KVH)). Accumulates in float32. */
#include <math.h>
#include <stdint.h>
#include <string.h>


static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Loads n elements (dtype 0: float32, 1: bfloat16) into dst as float32. */
static inline void load_row(float *dst, const void *src, int64_t n, int dtype) {
    if (dtype == 0) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    }
}

/* One token's K or V for every KV head, [KVH * D] float32, from the element offset `off` of its first head. */
static inline void load_kv_row(float *row, const char *kvb, int64_t off, int64_t s_head, int64_t num_kv_heads,
                               int64_t head_dim, int rows_contiguous, int64_t elem, int dtype) {
    if (rows_contiguous) {
        load_row(row, kvb + off * elem, num_kv_heads * head_dim, dtype);
    } else {
        for (int64_t h = 0; h < num_kv_heads; h++)
            load_row(row + h * head_dim, kvb + (off + h * s_head) * elem, head_dim, dtype);
    }
}

/* q: [B, H, D] contiguous, dtype. kv: the layer's cache, element strides (block, kv, token, head), D contiguous.
 * tables: [B, W] int32 block ids; ctx_lens: [B] int32 (context including the new token). out: [B, H, D] float32.
 * scratch: float32, at least H * max_ctx + (H + KVH) * D. window <= 0: none.
 * Per sequence, each key and value row (all KV heads of a token: one contiguous run) is read once. */
void paged_decode_attention(const void *q, const void *kv, int64_t s_block, int64_t s_kv, int64_t s_tok,
                            int64_t s_head, const int32_t *tables, int64_t width, const int32_t *ctx_lens,
                            int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t window, float scale, int dtype, float *out,
                            float *scratch) {
    const int64_t group = num_heads / num_kv_heads, elem = dtype == 0 ? 4 : 2;
    const char *qb = (const char *)q, *kvb = (const char *)kv;
    const int rows_contiguous = s_head == head_dim;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t ctx = ctx_lens[b];
        if (ctx <= 0) continue;
        const int64_t first = (window > 0 && ctx > window) ? ctx - window : 0, n = ctx - first;
        const int32_t *table = tables + b * width;
        float *scores = scratch, *qf = scores + num_heads * n, *row = qf + num_heads * head_dim;
        load_row(qf, qb + b * num_heads * head_dim * elem, num_heads * head_dim, dtype);
        for (int64_t t = 0; t < n; t++) {
            const int64_t pos = first + t;
            const int64_t off = table[pos / block_size] * s_block + (pos % block_size) * s_tok;
            load_kv_row(row, kvb, off, s_head, num_kv_heads, head_dim, rows_contiguous, elem, dtype);
            for (int64_t head = 0; head < num_heads; head++) {
                const float *qh = qf + head * head_dim, *kh = row + (head / group) * head_dim;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t d = 0; d < head_dim; d++) acc += qh[d] * kh[d];
                scores[head * n + t] = acc * scale;
            }
        }
        for (int64_t head = 0; head < num_heads; head++) {
            float *sc = scores + head * n, m = sc[0], sum = 0.0f;  /* n >= 1; no infinities (fast-math) */
#pragma omp simd reduction(max : m)
            for (int64_t t = 0; t < n; t++) m = sc[t] > m ? sc[t] : m;
#pragma omp simd  /* glibc's vector expf (libmvec: declared under -ffast-math) */
            for (int64_t t = 0; t < n; t++) sc[t] = expf(sc[t] - m);
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n; t++) sum += sc[t];
            const float inv = 1.0f / sum;
#pragma omp simd
            for (int64_t t = 0; t < n; t++) sc[t] *= inv;
        }
        float *o = out + b * num_heads * head_dim;
        for (int64_t e = 0; e < num_heads * head_dim; e++) o[e] = 0.0f;
        for (int64_t t = 0; t < n; t++) {
            const int64_t pos = first + t;
            const int64_t off = table[pos / block_size] * s_block + s_kv + (pos % block_size) * s_tok;
            load_kv_row(row, kvb, off, s_head, num_kv_heads, head_dim, rows_contiguous, elem, dtype);
            for (int64_t head = 0; head < num_heads; head++) {
                const float p = scores[head * n + t], *vh = row + (head / group) * head_dim;
                float *oh = o + head * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) oh[d] += p * vh[d];
            }
        }
    }
}
