/* Paged decode attention on the CPU: one query token per sequence attends to its context straight from the
 * paged KV cache, reading each key and value once (the torch path gathers the blocks into a copy, then SDPA reads
 * the copy: three passes over the KV). Built and loaded by paged_decode.py; semantics are
 * engine.model.torch_attention.paged_attention's decode branch (causal, optional sliding window, GQA as
 * transformers' repeat_kv: query head j uses KV head j / (H / KVH)). Accumulates in float32.
 *
 * Three bodies: where the compiler targets AVX-512 and head_dim is a multiple of 16 (at most MAX_DIM), a vector
 * body that scores 16 tokens at a time and sums their 16 partial-sum vectors with one transpose-add (one horizontal
 * reduction per token was most of the time), and for a bfloat16 cache on CPUs with AVX512-BF16 (head_dim a multiple
 * of 32) the same shape of body on the raw bfloat16 lanes; elsewhere a portable loop the compiler vectorizes as it
 * can.
 *
 * The cache may also hold float8 e4m3 (kv_dtype 2, an fp8 cache: engine.kv_quant) while q and out are float32 or
 * bfloat16: its bytes are widened through a 256-entry float32 table the caller passes (`lut`), by the portable body
 * or, with AVX-512, the float32 vector body (a gather from the table); the caller folds k_scale into `scale`, and
 * `v_scale` multiplies each output row before it is written. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define MAX_DIM 256
#define MAX_GROUP 16


static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Bytes per element of dtype 0 (float32), 1 (bfloat16), 2 (float8 e4m3). */
static inline int64_t elem_bytes(int dtype) { return dtype == 0 ? 4 : dtype == 1 ? 2 : 1; }

/* Loads n elements (dtype 0: float32, 1: bfloat16, 2: float8 e4m3 through lut) into dst as float32. */
static inline void load_row(float *dst, const void *src, int64_t n, int dtype, const float *lut) {
    if (dtype == 0) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == 2) {
        const uint8_t *s = (const uint8_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = lut[s[i]];
    } else {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    }
}

/* The element offset of context position `pos` (its first KV head) in a sequence's blocks. */
static inline int64_t token_offset(const int32_t *table, int64_t pos, int64_t block_size, int64_t s_block,
                                   int64_t s_tok) {
    return table[pos / block_size] * s_block + (pos % block_size) * s_tok;
}

/* Softmax over each head's n scores in place (n >= 1; no infinities under fast-math). */
static void softmax_rows(float *scores, int64_t num_heads, int64_t n) {
    for (int64_t head = 0; head < num_heads; head++) {
        float *sc = scores + head * n, m = sc[0], sum = 0.0f;
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
}

/* Portable body for one sequence: scores [H, n], qf [H * D] (scaled), row [KVH * D] scratch. */
static void attend_portable(const float *qf, const char *kvb, const int32_t *table, int64_t first, int64_t n,
                            int64_t s_block, int64_t s_kv, int64_t s_tok, int64_t s_head, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int dtype, const float *lut,
                            float *scores, float *row, float *o) {
    const int64_t group = num_heads / num_kv_heads, elem = elem_bytes(dtype);
    for (int64_t t = 0; t < n; t++) {
        const int64_t off = token_offset(table, first + t, block_size, s_block, s_tok);
        for (int64_t g = 0; g < num_kv_heads; g++)
            load_row(row + g * head_dim, kvb + (off + g * s_head) * elem, head_dim, dtype, lut);
        for (int64_t head = 0; head < num_heads; head++) {
            const float *qh = qf + head * head_dim, *kh = row + (head / group) * head_dim;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < head_dim; d++) acc += qh[d] * kh[d];
            scores[head * n + t] = acc;
        }
    }
    softmax_rows(scores, num_heads, n);
    for (int64_t e = 0; e < num_heads * head_dim; e++) o[e] = 0.0f;
    for (int64_t t = 0; t < n; t++) {
        const int64_t off = token_offset(table, first + t, block_size, s_block, s_tok) + s_kv;
        for (int64_t g = 0; g < num_kv_heads; g++)
            load_row(row + g * head_dim, kvb + (off + g * s_head) * elem, head_dim, dtype, lut);
        for (int64_t head = 0; head < num_heads; head++) {
            const float p = scores[head * n + t], *vh = row + (head / group) * head_dim;
            float *oh = o + head * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) oh[d] += p * vh[d];
        }
    }
}

#ifdef __AVX512F__
/* 16 float32 from float32, bfloat16 or float8 e4m3 (through lut) memory. */
static inline __m512 load16(const char *p, int dtype, const float *lut) {
    if (dtype == 0) return _mm512_loadu_ps(p);
    if (dtype == 2) return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)), lut, 4);
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* Lane i of the result = the sum of v[i]'s 16 lanes (a transpose-add: 15 adds for 16 sums). */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)  /* lane l of 128-bit chunk k: pairs of v[2i], v[2i+1] interleaved */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* each 128-bit chunk: partial sums of v[4i .. 4i+3] in order */
        __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)  /* chunks 0+1 and 2+3 of b[2i], then of b[2i+1] */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    /* chunk k of c[i]: partial sums (over two of the four chunks) of v[8i .. 8i+7]; folding once more leaves
     * chunk k holding the whole sums of v[4k .. 4k+3], in order */
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

/* Vector body for one sequence (head_dim a multiple of 16, at most MAX_DIM; group at most MAX_GROUP). */
static inline __attribute__((always_inline)) void attend_avx512(
        const float *qf, const char *kvb, const int64_t *offsets, int64_t n, int64_t s_kv, int64_t s_head,
        int64_t num_heads, int64_t num_kv_heads, const int64_t head_dim, const int dtype, const float *lut,
        float *scores, float *o) {
    const int64_t group = num_heads / num_kv_heads, elem = elem_bytes(dtype), dv = head_dim / 16;
    __m512 part[16];
    for (int64_t g = 0; g < num_kv_heads; g++) {
        for (int64_t j = 0; j < group; j++) {
            const int64_t head = g * group + j;
            __m512 qv[MAX_DIM / 16];
            for (int64_t v = 0; v < dv; v++) qv[v] = _mm512_loadu_ps(qf + head * head_dim + 16 * v);
            for (int64_t t0 = 0; t0 < n; t0 += 16) {
                const int64_t m = n - t0 < 16 ? n - t0 : 16;
                for (int64_t i = 0; i < 16; i++) {
                    if (i >= m) { part[i] = _mm512_setzero_ps(); continue; }
                    const char *k = kvb + (offsets[t0 + i] + g * s_head) * elem;
                    __m512 acc = _mm512_mul_ps(qv[0], load16(k, dtype, lut));
                    for (int64_t v = 1; v < dv; v++)
                        acc = _mm512_fmadd_ps(qv[v], load16(k + 16 * v * elem, dtype, lut), acc);
                    part[i] = acc;
                }
                _mm512_mask_storeu_ps(scores + head * n + t0, (__mmask16)((1u << m) - 1), sum16(part));
            }
        }
    }
    softmax_rows(scores, num_heads, n);
    for (int64_t g = 0; g < num_kv_heads; g++) {
        for (int64_t j0 = 0; j0 < group; j0 += 2) {  /* two query heads' outputs in registers at a time */
            const int64_t h0 = g * group + j0, two = group - j0 >= 2;
            __m512 acc0[MAX_DIM / 16], acc1[MAX_DIM / 16];
            for (int64_t v = 0; v < dv; v++) acc0[v] = acc1[v] = _mm512_setzero_ps();
            const float *p0 = scores + h0 * n, *p1 = scores + (h0 + two) * n;
            for (int64_t t = 0; t < n; t++) {
                const char *vr = kvb + (offsets[t] + s_kv + g * s_head) * elem;
                const __m512 w0 = _mm512_set1_ps(p0[t]), w1 = _mm512_set1_ps(p1[t]);
                for (int64_t v = 0; v < dv; v++) {
                    const __m512 x = load16(vr + 16 * v * elem, dtype, lut);
                    acc0[v] = _mm512_fmadd_ps(w0, x, acc0[v]);
                    acc1[v] = _mm512_fmadd_ps(w1, x, acc1[v]);
                }
            }
            for (int64_t v = 0; v < dv; v++) {
                _mm512_storeu_ps(o + h0 * head_dim + 16 * v, acc0[v]);
                if (two) _mm512_storeu_ps(o + (h0 + 1) * head_dim + 16 * v, acc1[v]);
            }
        }
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* bfloat16 body for one sequence (head_dim a multiple of 32, at most MAX_DIM), without widening the cache to float32
 * first: a score is one dot-product instruction per 32 dims on the raw bfloat16 q and key (products exact in float32,
 * pairs summed in float32), scaled afterwards; values are split into their even and odd elements by a shift and a
 * mask (no shuffle), so the outputs accumulate as even and odd halves, interleaved once at the end. The float32 body
 * spent most of its time widening bfloat16 lanes on the one shuffle port. */
static inline __attribute__((always_inline)) void attend_bf16(
        const uint16_t *q, float scale, const char *kvb, const int64_t *offsets, int64_t n, int64_t s_kv,
        int64_t s_head, int64_t num_heads, int64_t num_kv_heads, const int64_t head_dim, float *scores, float *o) {
    const int64_t group = num_heads / num_kv_heads, dw = head_dim / 32;
    const uint16_t *kv = (const uint16_t *)kvb;
    const __m512i odd_mask = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m512 scale_v = _mm512_set1_ps(scale);
    __m512 part[16];
    for (int64_t t0 = 0; t0 < n; t0 += 16) {  /* 16 tokens' keys (all heads) stay in L1 while every head scores */
        const int64_t m = n - t0 < 16 ? n - t0 : 16;
        for (int64_t head = 0; head < num_heads; head++) {
            const int64_t g = head / group;
            __m512bh qv[MAX_DIM / 32];
            for (int64_t w = 0; w < dw; w++) qv[w] = (__m512bh)_mm512_loadu_si512(q + head * head_dim + 32 * w);
            for (int64_t i = 0; i < 16; i++) {
                if (i >= m) { part[i] = _mm512_setzero_ps(); continue; }
                const uint16_t *k = kv + offsets[t0 + i] + g * s_head;
                __m512 acc = _mm512_setzero_ps();
                for (int64_t w = 0; w < dw; w++)
                    acc = _mm512_dpbf16_ps(acc, qv[w], (__m512bh)_mm512_loadu_si512(k + 32 * w));
                part[i] = acc;
            }
            _mm512_mask_storeu_ps(scores + head * n + t0, (__mmask16)((1u << m) - 1),
                                  _mm512_mul_ps(sum16(part), scale_v));
        }
    }
    softmax_rows(scores, num_heads, n);
    for (int64_t g = 0; g < num_kv_heads; g++) {
        for (int64_t j0 = 0; j0 < group; j0 += 2) {  /* two query heads' outputs in registers at a time */
            const int64_t h0 = g * group + j0, two = group - j0 >= 2;
            __m512 even0[MAX_DIM / 32], odd0[MAX_DIM / 32], even1[MAX_DIM / 32], odd1[MAX_DIM / 32];
            for (int64_t w = 0; w < dw; w++) even0[w] = odd0[w] = even1[w] = odd1[w] = _mm512_setzero_ps();
            const float *p0 = scores + h0 * n, *p1 = scores + (h0 + two) * n;
            for (int64_t t = 0; t < n; t++) {
                const uint16_t *vr = kv + offsets[t] + s_kv + g * s_head;
                const __m512 w0 = _mm512_set1_ps(p0[t]), w1 = _mm512_set1_ps(p1[t]);
                for (int64_t w = 0; w < dw; w++) {
                    const __m512i x = _mm512_loadu_si512(vr + 32 * w);
                    const __m512 ev = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
                    const __m512 od = _mm512_castsi512_ps(_mm512_and_si512(x, odd_mask));
                    even0[w] = _mm512_fmadd_ps(w0, ev, even0[w]);
                    odd0[w] = _mm512_fmadd_ps(w0, od, odd0[w]);
                    even1[w] = _mm512_fmadd_ps(w1, ev, even1[w]);
                    odd1[w] = _mm512_fmadd_ps(w1, od, odd1[w]);
                }
            }
            for (int64_t w = 0; w < dw; w++) {
                float e[16], d[16];
                for (int64_t r = 0; r < 1 + two; r++) {
                    _mm512_storeu_ps(e, r ? even1[w] : even0[w]);
                    _mm512_storeu_ps(d, r ? odd1[w] : odd0[w]);
                    float *dst = o + (h0 + r) * head_dim + 32 * w;
                    for (int i = 0; i < 16; i++) { dst[2 * i] = e[i]; dst[2 * i + 1] = d[i]; }
                }
            }
        }
    }
}
#endif

/* One sequence's attention into o [H * D] float32 (scratch: scores, q, a row, token offsets; see below). */
static void attend_row(const char *qb, const char *kvb, int64_t b, int64_t first, int64_t n, const int32_t *table,
                       int64_t s_block, int64_t s_kv, int64_t s_tok, int64_t s_head, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int dtype,
                       int kv_dtype, const float *lut, float *o, float *scratch) {
    const int64_t elem = elem_bytes(dtype);
    float *scores = scratch, *qf = scores + num_heads * n, *row = qf + num_heads * head_dim;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (dtype == 1 && kv_dtype == 1 && head_dim % 32 == 0 && head_dim <= MAX_DIM) {
        int64_t *offsets = (int64_t *)(row + num_kv_heads * head_dim);
        for (int64_t t = 0; t < n; t++) offsets[t] = token_offset(table, first + t, block_size, s_block, s_tok);
        const uint16_t *qr = (const uint16_t *)qb + b * num_heads * head_dim;
#define BODY(D) attend_bf16(qr, scale, kvb, offsets, n, s_kv, s_head, num_heads, num_kv_heads, D, scores, o)
        if (head_dim == 32) BODY(32);
        else if (head_dim == 64) BODY(64);
        else if (head_dim == 128) BODY(128);
        else BODY(head_dim);
#undef BODY
        return;
    }
#endif
    load_row(qf, qb + b * num_heads * head_dim * elem, num_heads * head_dim, dtype, lut);
    for (int64_t e = 0; e < num_heads * head_dim; e++) qf[e] *= scale;
#ifdef __AVX512F__
    const int vector = head_dim % 16 == 0 && head_dim <= MAX_DIM && num_heads / num_kv_heads <= MAX_GROUP;
    int64_t *offsets = (int64_t *)(row + num_kv_heads * head_dim);
    if (vector)
        for (int64_t t = 0; t < n; t++) offsets[t] = token_offset(table, first + t, block_size, s_block, s_tok);
#define BODY(D, T) attend_avx512(qf, kvb, offsets, n, s_kv, s_head, num_heads, num_kv_heads, D, T, lut, scores, o)
    if (vector && head_dim == 32 && kv_dtype == 1) BODY(32, 1);
    else if (vector && head_dim == 64 && kv_dtype == 1) BODY(64, 1);
    else if (vector && head_dim == 128 && kv_dtype == 1) BODY(128, 1);
    else if (vector && head_dim == 32 && kv_dtype == 0) BODY(32, 0);
    else if (vector && head_dim == 64 && kv_dtype == 0) BODY(64, 0);
    else if (vector && head_dim == 128 && kv_dtype == 0) BODY(128, 0);
    else if (vector) BODY(head_dim, kv_dtype);
    else
#undef BODY
#endif
        attend_portable(qf, kvb, table, first, n, s_block, s_kv, s_tok, s_head, num_heads, num_kv_heads,
                        head_dim, block_size, kv_dtype, lut, scores, row, o);
}

static inline uint16_t to_bf16(float f) {  /* round to nearest even, as torch's float -> bfloat16 */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* q, out: [B, H, D] contiguous, dtype (0: float32, 1: bfloat16). kv: the layer's cache, of kv_dtype (q's, or 2:
 * float8 e4m3 widened through lut [256], k_scale folded into scale, outputs multiplied by v_scale), element strides (block, kv,
 * token, head), D contiguous. tables: [B, W] int32 block ids; ctx_lens: [B] int32 (context including the new token;
 * 0: a padding row, written as zeros). scratch: float32, at least H * D + H * max_ctx + (H + KVH) * D + 2 * max_ctx
 * (the float32 output row first; the last part holds int64 token offsets, x86 loads them unaligned). window <= 0:
 * none. */
void paged_decode_attention(const void *q, const void *kv, int64_t s_block, int64_t s_kv, int64_t s_tok,
                            int64_t s_head, const int32_t *tables, int64_t width, const int32_t *ctx_lens,
                            int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t window, float scale, int dtype, int kv_dtype,
                            const float *lut, float v_scale, void *out, float *scratch) {
    const int64_t size = num_heads * head_dim;
    float *o = scratch;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t ctx = ctx_lens[b];
        if (ctx > 0) {
            const int64_t first = (window > 0 && ctx > window) ? ctx - window : 0;
            attend_row((const char *)q, (const char *)kv, b, first, ctx - first, tables + b * width, s_block, s_kv,
                       s_tok, s_head, num_heads, num_kv_heads, head_dim, block_size, scale, dtype, kv_dtype, lut, o,
                       scratch + size);
            if (v_scale != 1.0f)
                for (int64_t e = 0; e < size; e++) o[e] *= v_scale;
        } else {
            for (int64_t e = 0; e < size; e++) o[e] = 0.0f;
        }
        if (dtype == 0) {
            memcpy((float *)out + b * size, o, (size_t)size * sizeof(float));
        } else {
            uint16_t *dst = (uint16_t *)out + b * size;
            for (int64_t e = 0; e < size; e++) dst[e] = to_bf16(o[e]);
        }
    }
}
