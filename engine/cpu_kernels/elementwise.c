/* Fused elementwise ops of the decoder on bfloat16 rows, each one pass over its rows instead of torch's chain of
 * ops (RMSNorm: eight, each reading and writing the whole activation; SiLU-and-mul: three). Built and loaded by
 * elementwise.py. Semantics are engine.model.decoder's torch path, rounding included: every value torch rounds to
 * bfloat16 between two of its ops is rounded here too (round to nearest even), so the results differ from torch's
 * only where float sums in another order (the mean of squares) or expf's last bit tip a rounding. */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#ifdef __AVX512F__
#include <immintrin.h>
/* The same conversions on 16 lanes (hand-written: gcc's own vectorization of the scalar loops ran 2-3 cycles an
 * element, a sixth of a 2,048-token prefill step on `tiny`). */
__m512 _ZGVeN16v_expf(__m512);  /* glibc's vector expf (libmvec), the one the compiler calls for expf under simd */

static inline __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512i bf16_bits(__m512 f) {  /* f32_to_bf16 per lane, in the low 16 bits of each 32-bit lane */
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
}

static inline __m512 round_bf16x16(__m512 f) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(f), 16)); }

static inline void store_bf16x16(uint16_t *p, __m512 f) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(bf16_bits(f)));
}
#endif

/* x, residual: [rows, dim] bfloat16, contiguous; weight [dim]. With residual (non-NULL): x + residual is stored
 * into residual (the new residual stream) and normalized; else x is. out = weight * bf16(h * rsqrt(mean(h^2) + eps)),
 * h the float row. */
void rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out, int64_t rows,
                   int64_t dim, float eps) {
    float h[dim];
#ifdef __AVX512F__
    if (dim % 16 == 0) {
        for (int64_t r = 0; r < rows; r++) {
            const uint16_t *xr = x + r * dim;
            uint16_t *outr = out + r * dim, *res = residual == NULL ? NULL : residual + r * dim;
            __m512 sum = _mm512_setzero_ps();
            for (int64_t i = 0; i < dim; i += 16) {
                __m512 v = load_bf16x16(xr + i);
                if (res != NULL) {
                    v = round_bf16x16(_mm512_add_ps(v, load_bf16x16(res + i)));
                    store_bf16x16(res + i, v);
                }
                _mm512_storeu_ps(h + i, v);
                sum = _mm512_fmadd_ps(v, v, sum);
            }
            const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sum) / (float)dim + eps));
            for (int64_t i = 0; i < dim; i += 16)
                store_bf16x16(outr + i, _mm512_mul_ps(load_bf16x16(weight + i),
                                                      round_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(h + i), inv))));
        }
        return;
    }
#endif
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * dim;
        uint16_t *outr = out + r * dim;
        if (residual != NULL) {
            uint16_t *res = residual + r * dim;
            for (int64_t i = 0; i < dim; i++) {
                res[i] = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(res[i]));
                h[i] = bf16_to_f32(res[i]);
            }
        } else {
            for (int64_t i = 0; i < dim; i++) h[i] = bf16_to_f32(xr[i]);
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; i++) sum += h[i] * h[i];
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) outr[i] = f32_to_bf16(bf16_to_f32(weight[i]) * round_bf16(h[i] * inv));
    }
}

/* gate_up: [rows, 2 * inter] bfloat16 (gate, then up), contiguous; out: [rows, inter] = bf16(silu(gate)) * up. */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * inter, *u = g + inter;
        uint16_t *o = out + r * inter;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= inter; i += 16) {
            const __m512 xg = load_bf16x16(g + i);
            const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_setzero_ps(), xg));
            const __m512 act = round_bf16x16(_mm512_div_ps(xg, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
            store_bf16x16(o + i, _mm512_mul_ps(act, load_bf16x16(u + i)));
        }
#endif
        for (; i < inter; i++) {
            const float x = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(round_bf16(x / (1.0f + expf(-x))) * bf16_to_f32(u[i]));
        }
    }
}

/* RoPE and the KV store of one layer, after its fused q/k/v projection. qkv: [rows, (heads + 2 kv_heads) * dim]
 * bfloat16, contiguous (q heads, k heads, v heads); cos, sin: [rows, dim] bfloat16 (each token's angles). q and k
 * are rotated as torch's x * cos + rotate_half(x) * sin, each product and the sum rounded to bfloat16 as torch rounds
 * them (so the results are torch's bits); rotated q goes to q_out [rows, heads, dim], rotated k and v to the cache at
 * element offset (slot / block_size) * s_block + (slot % block_size) * s_tok + head * s_head (+ s_kv for v), dim
 * contiguous. A negative slot (a padding row) stores nothing. Returns 0, or -1 (nothing written from that row on)
 * where a slot is at or past num_blocks * block_size. */
int rope_store_bf16(const uint16_t *qkv, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                    const uint16_t *cos, const uint16_t *sin, const int32_t *slots, uint16_t *kv, int64_t num_blocks,
                    int64_t block_size, int64_t s_block, int64_t s_kv, int64_t s_tok, int64_t s_head,
                    uint16_t *q_out) {
    const int64_t half = dim / 2, width = (heads + 2 * kv_heads) * dim;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t slot = slots[r];
        if (slot >= num_blocks * block_size) return -1;
        const uint16_t *row = qkv + r * width, *c = cos + r * dim, *s = sin + r * dim;
        uint16_t *k_dst = slot < 0 ? NULL : kv + (slot / block_size) * s_block + (slot % block_size) * s_tok;
        for (int64_t head = 0; head < heads + kv_heads; head++) {
            const uint16_t *x = row + head * dim;
            uint16_t *dst = head < heads ? q_out + (r * heads + head) * dim
                                         : (k_dst == NULL ? NULL : k_dst + (head - heads) * s_head);
            if (dst == NULL) continue;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) {
                const float other = i < half ? -bf16_to_f32(x[i + half]) : bf16_to_f32(x[i - half]);
                dst[i] = f32_to_bf16(round_bf16(bf16_to_f32(x[i]) * bf16_to_f32(c[i]))
                                     + round_bf16(other * bf16_to_f32(s[i])));
            }
        }
        if (k_dst != NULL)
            for (int64_t head = 0; head < kv_heads; head++)
                memcpy(k_dst + s_kv + head * s_head, row + (heads + kv_heads + head) * dim, (size_t)dim * 2);
    }
    return 0;
}
