/* The sampler's draw on the CPU (engine.sampling.sampler): for each row, greedy argmax or the exponential race
 * argmax_v w_v / E_v, in one pass per row where the torch path runs ~20 ops over [S, V] (0.7 ms of a 4 ms `tiny`
 * decode step at temperature 1). Built and loaded by sampling.py; the same bits as the torch path: the noise E is
 * splitmix64 in 64-bit integers then -log in float64 rounded to float32, the weights w = exp(logits / temperature -
 * max) in float32, and exp and log are the very SLEEF functions torch's own vectorized ops call (linked from
 * libtorch_cpu), so no last-bit difference can move a draw. Built without fast-math: every division stays a
 * division, as torch's. Needs AVX-512 (F, DQ, BW, VL); elsewhere `sample_rows` reports that it cannot run. */
#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

__m512 Sleef_expf16_u10(__m512);    /* torch's Vectorized<float>::exp on AVX-512 */
__m512d Sleef_logd8_u10(__m512d);   /* torch's Vectorized<double>::log on AVX-512 */

#define GOLDEN 0x9E3779B97F4A7C15ULL
#define MIX1 0xBF58476D1CE4E5B9ULL
#define MIX2 0x94D049BB133111EBULL

/* Parameter columns of a packed row (engine.sampling.sampler._pack): key, top_k, greedy, then float64 bit patterns
 * of temperature, top_p, min_p. */
enum { KEY = 0, GREEDY = 2, TEMP = 3, COLUMNS = 6 };

static inline __m512i mix64(__m512i z) {
    z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 30));
    z = _mm512_mullo_epi64(z, _mm512_set1_epi64((long long)MIX1));
    z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 27));
    z = _mm512_mullo_epi64(z, _mm512_set1_epi64((long long)MIX2));
    return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

/* Exp(1) noise of vocabulary ids v0 .. v0 + 7 under `key`, as float32 (exp_noise in sampler.py). */
static inline __m256 noise8(uint64_t key, int64_t v0) {
    const __m512i ids = _mm512_add_epi64(_mm512_set1_epi64(v0 + 1), _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7));
    __m512i z = _mm512_add_epi64(_mm512_set1_epi64((long long)key),
                                 _mm512_mullo_epi64(ids, _mm512_set1_epi64((long long)GOLDEN)));
    z = _mm512_srli_epi64(mix64(z), 12);  /* 52 random bits */
    __m512d u = _mm512_add_pd(_mm512_cvtepu64_pd(z), _mm512_set1_pd(0.5));
    u = _mm512_mul_pd(u, _mm512_set1_pd(0x1p-52));
    return _mm512_cvtpd_ps(_mm512_sub_pd(_mm512_setzero_pd(), Sleef_logd8_u10(u)));
}

static inline __m512 noise16(uint64_t key, int64_t v0) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(noise8(key, v0)), noise8(key, v0 + 8), 1);
}

static inline __mmask16 lanes(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

/* The first index of the largest lane over a row's running (best value, best index) vectors. */
static inline int64_t first_max(__m512 best, __m512i best_idx) {
    const float top = _mm512_reduce_max_ps(best);
    const __mmask16 at = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    return (int64_t)_mm512_mask_reduce_min_epi32(at, best_idx);
}

/* The row's first maximal index; -1 if it holds a NaN (the caller falls back: torch's argmax picks the NaN). */
static int64_t argmax_row(const float *x, int64_t vocab) {
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __mmask16 first = lanes(vocab);
    __m512 best = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), first, x);  /* all -inf: index 0 still wins */
    __m512i best_idx = _mm512_mask_mov_epi32(_mm512_set1_epi32(0x7fffffff), first, idx);
    __mmask16 nan = _mm512_mask_cmp_ps_mask(first, best, best, _CMP_UNORD_Q);
    for (int64_t v = 16; v < vocab; v += 16) {
        idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
        const __mmask16 m = lanes(vocab - v);
        const __m512 val = _mm512_maskz_loadu_ps(m, x + v);
        nan |= _mm512_mask_cmp_ps_mask(m, val, val, _CMP_UNORD_Q);
        const __mmask16 up = _mm512_mask_cmp_ps_mask(m, val, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, up, val);
        best_idx = _mm512_mask_mov_epi32(best_idx, up, idx);
    }
    return nan ? -1 : first_max(best, best_idx);
}

/* One row's race (sampler.py's _sample for a random row); -1 where torch's ops would meet a NaN or an infinite max
 * (then every weight is NaN and torch's argmax picks index 0: the caller falls back to torch). */
static int64_t race_row(const float *x, int64_t vocab, uint64_t key, float temperature, const uint8_t *keep) {
    const __m512 t = _mm512_set1_ps(temperature);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (int64_t v = 0; v < vocab; v += 16) {
        const __mmask16 m = lanes(vocab - v);
        const __m512 s = _mm512_div_ps(_mm512_maskz_loadu_ps(m, x + v), t);
        nan |= _mm512_mask_cmp_ps_mask(m, s, s, _CMP_UNORD_Q);
        mx = _mm512_mask_max_ps(mx, m, mx, s);
    }
    const float top = _mm512_reduce_max_ps(mx);
    if (nan || !isfinite(top)) return -1;
    const __m512 topv = _mm512_set1_ps(top);
    __m512 best = _mm512_set1_ps(-1.0f);  /* every ratio is >= 0: lane 0 of the first chunk always wins a start */
    __m512i best_idx = _mm512_set1_epi32(0x7fffffff), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                                               12, 13, 14, 15);
    for (int64_t v = 0; v < vocab; v += 16) {
        const __mmask16 m = lanes(vocab - v);
        const __m512 s = _mm512_div_ps(_mm512_maskz_loadu_ps(m, x + v), t);
        __m512 w = Sleef_expf16_u10(_mm512_sub_ps(s, topv));
        if (keep != 0) {
            const __m128i k = _mm_maskz_loadu_epi8(m, keep + v);
            w = _mm512_maskz_mov_ps(_mm512_mask_cmpneq_epi32_mask(m, _mm512_cvtepu8_epi32(k), _mm512_setzero_si512()),
                                    w);
        }
        const __m512 r = _mm512_div_ps(w, noise16(key, v));
        const __mmask16 up = _mm512_mask_cmp_ps_mask(m, r, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, up, r);
        best_idx = _mm512_mask_mov_epi32(best_idx, up, idx);
        idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
    }
    return first_max(best, best_idx);
}

/* logits [rows, vocab] float32 contiguous; packed [rows, 6] int64 (NULL: every row greedy); keep [rows, vocab] bool
 * (NULL: no filter) -> tokens [rows] int64. Returns 0, or 1 where some row needs torch's path (a NaN or an
 * infinite maximum: nothing written is to be used), or 2 without AVX-512 here. */
int sample_rows(const float *logits, int64_t rows, int64_t vocab, const int64_t *packed, const uint8_t *keep,
                int64_t *tokens) {
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * vocab;
        int64_t token;
        if (packed == 0 || packed[r * COLUMNS + GREEDY]) {
            token = argmax_row(x, vocab);
        } else {
            double temperature;
            __builtin_memcpy(&temperature, &packed[r * COLUMNS + TEMP], sizeof temperature);
            token = race_row(x, vocab, (uint64_t)packed[r * COLUMNS + KEY], (float)temperature,
                             keep == 0 ? 0 : keep + r * vocab);
        }
        if (token < 0) return 1;
        tokens[r] = token;
    }
    return 0;
}
#else
int sample_rows(const float *logits, int64_t rows, int64_t vocab, const int64_t *packed, const unsigned char *keep,
                int64_t *tokens) {
    (void)logits; (void)rows; (void)vocab; (void)packed; (void)keep; (void)tokens;
    return 2;
}
#endif
