/* Prefill attention on the CPU with AMX tiles: each prefill chunk of a step attends causally to its whole context
 * (cached prefix plus its own tokens) straight from the paged KV cache, bfloat16 in, float32 accumulation. Built
 * and loaded by prefill_attention.py; semantics are engine.model.torch_attention.paged_attention's prefill branch
 * (no sliding window; GQA as repeat_kv: query head h uses KV head h / (H / KVH)).
 *
 * Why: torch's CPU flash attention runs its blocks as many small GEMM calls; at head_dim 32 a 256-token prompt's
 * layer took ~350 us, a third of a `tiny` prefill step. Here, per (chunk, KV head), K and V are packed once into AMX's
 * pair-interleaved layout, then for each query head and block of 16 queries: S = Q K^T by tile dot products (one
 * 16 x 16 tile per 16 keys, only up to the block's last causal key), a float32 softmax over each row's keys (its
 * sum kept in float32, the probabilities rounded to bfloat16 for the second product, as torch's kernel does), and
 * O = P V accumulated in two 16 x 16 float32 tiles per 32 output dims, divided by the sum at the end.
 * head_dim: a multiple of 32, at most MAX_DIM. */
#include <stdint.h>
#include <string.h>
#include <math.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_DIM 256
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 2^t for t <= 0 (a softmax's exponents): 2^round(t) times a degree-5 Taylor polynomial of the rest (relative
 * error < 3e-6, far inside the bfloat16 rounding the probabilities get; the sums stay float32); -inf and underflow give 0. */
static inline __m512 exp2_neg(__m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(t, n);  /* [-0.5, 0.5] */
    __m512 p = _mm512_set1_ps(1.3333558146428443e-3f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.618129107628477e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.550410866482158e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.402265069591007e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.931471805599453e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Tiles: 0 scores (16 x 16 f32), 1 queries (16 x 32 bf16), 2 keys (16 pairs x 16 keys), 3 probabilities (16 x 32
 * bf16), 4 and 5 values (16 key pairs x 16 dims), 6 and 7 outputs (16 x 16 f32). All 16 rows of 64 bytes. */
static void configure(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

static inline __mmask16 lanes(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

/* K of one KV head for keys [0, ctx) as tiles of 16 keys: tile kb, dim chunk c: row p holds dims 2p, 2p+1 of
 * chunk c for each of the 16 keys, interleaved (key j: elements 2j and 2j+1). Keys past ctx: zeros. */
static void pack_keys(uint16_t *dst, const uint16_t *kv, const int32_t *table, int64_t ctx, int64_t ctx_pad,
                      int64_t dim, int64_t block_size, int64_t s_block, int64_t s_tok, int64_t head_off) {
    const int64_t chunks = dim / 32;
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));  /* word p of a key -> row p of its tile */
    if (ctx % 16) memset(dst + ctx / 16 * chunks * 512, 0, (size_t)(chunks * 512) * sizeof(uint16_t));
    memset(dst + round_up(ctx, 16) / 16 * chunks * 512, 0,
           (size_t)((ctx_pad - round_up(ctx, 16)) / 16 * chunks * 512) * sizeof(uint16_t));
    for (int64_t b0 = 0; b0 < ctx; b0 += block_size) {
        const uint16_t *block = kv + table[b0 / block_size] * s_block + head_off;
        for (int64_t t = b0; t < b0 + block_size && t < ctx; t++) {
            const uint16_t *k = block + (t - b0) * s_tok;
            for (int64_t c = 0; c < chunks; c++)  /* dims (2p, 2p+1) of the chunk as one word each: column t % 16 */
                _mm512_i32scatter_epi32(dst + (t / 16 * chunks + c) * 512 + 2 * (t % 16), rows,
                                        _mm512_loadu_si512(k + 32 * c), 4);
        }
    }
}

/* V of one KV head as tiles of 32 keys: tile kb, dim chunk c (16 dims): row p holds keys 2p, 2p+1 of the block,
 * interleaved per dim (dim j: elements 2j and 2j+1). Keys past ctx: zeros. */
static void pack_values(uint16_t *dst, const uint16_t *kv, const int32_t *table, int64_t ctx, int64_t ctx_pad,
                        int64_t dim, int64_t block_size, int64_t s_block, int64_t s_tok, int64_t head_off) {
    const int64_t chunks = dim / 16;
    __m512i pairs;  /* element 2j: dim j of the even key, 2j + 1: of the odd one */
    {
        int16_t idx[32];
        for (int j = 0; j < 16; j++) {
            idx[2 * j] = (int16_t)j;
            idx[2 * j + 1] = (int16_t)(32 + j);
        }
        pairs = _mm512_loadu_si512(idx);
    }
    const uint16_t *block = 0;
    for (int64_t t = 0; t < ctx_pad; t += 2) {  /* block_size is even: a pair never straddles two blocks */
        const int64_t off = t % block_size;
        if (off == 0 && t < ctx) block = kv + table[t / block_size] * s_block + head_off;
        const uint16_t *even = t < ctx ? block + off * s_tok : 0, *odd = t + 1 < ctx ? block + (off + 1) * s_tok : 0;
        for (int64_t c = 0; c < chunks; c++) {
            const __m512i a = even ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(even + 16 * c)))
                                   : _mm512_setzero_si512();
            const __m512i b = odd ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(odd + 16 * c)))
                                  : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + (t / 32 * chunks + c) * 512 + (t % 32) / 2 * 32,
                                _mm512_permutex2var_epi16(a, pairs, b));
        }
    }
}

/* One query head's block of m (<= 16) queries at positions first_pos .. first_pos + m - 1. */
static void attend_block(const uint16_t *q, int64_t q_stride, uint16_t *out, int64_t out_stride, int64_t m,
                         int64_t first_pos, const uint16_t *kpack, const uint16_t *vpack, int64_t dim, float scale,
                         float *scores, uint16_t *probs, uint16_t *qbuf, float *obuf, float *sums) {
    const int64_t chunks = dim / 32, keys = first_pos + m, kblocks = (keys + 15) / 16, width = round_up(keys, 32);
    const uint16_t *qtile = q;  /* a whole block of 16 rows loads straight from q; a partial one from a padded copy */
    int64_t qtile_stride = q_stride * 2, qtile_step = 32;
    if (m < 16) {
        memset(qbuf, 0, (size_t)(chunks * 512) * sizeof(uint16_t));
        for (int64_t i = 0; i < m; i++)
            for (int64_t c = 0; c < chunks; c++) memcpy(qbuf + c * 512 + i * 32, q + i * q_stride + 32 * c, 64);
        qtile = qbuf;
        qtile_stride = 64;
        qtile_step = 512;
    }
    if (chunks == 1) _tile_loadd(1, qtile, qtile_stride);
    for (int64_t kb = 0; kb < kblocks; kb++) {  /* S[:, 16 kb .. 16 kb + 15] */
        _tile_zero(0);
        for (int64_t c = 0; c < chunks; c++) {
            if (chunks > 1) _tile_loadd(1, qtile + c * qtile_step, qtile_stride);
            _tile_loadd(2, kpack + (kb * chunks + c) * 512, 64);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, scores + 16 * kb, width * 4);
    }
    const __m512 to_exp2 = _mm512_set1_ps(scale * 1.4426950408889634f);  /* e^(scale x) = 2^(x scale log2 e) */
    for (int64_t i = 0; i < 16; i++) {
        const float *sr = scores + i * width;
        uint16_t *p = probs + i * width;
        if (i >= m) {
            memset(p, 0, (size_t)width * sizeof(uint16_t));
            continue;
        }
        const int64_t n = first_pos + i + 1;  /* keys 0 .. first_pos + i */
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t k = 0; k < n; k += 16)
            mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes(n - k), sr + k));
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t k = n / 16 * 16 + (n % 16 ? 16 : 0); k < width; k += 16)  /* causally masked: zeros */
            _mm256_storeu_si256((__m256i *)(p + k), _mm256_setzero_si256());
        for (int64_t k = 0; k < n; k += 16) {
            const __mmask16 keep = lanes(n - k);
            const __m512 e = _mm512_maskz_mov_ps(keep, exp2_neg(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + k),
                                                                                             top), to_exp2)));
            sum = _mm512_add_ps(sum, e);
            _mm256_storeu_si256((__m256i *)(p + k), (__m256i)_mm512_cvtneps_pbh(e));
        }
        sums[i] = _mm512_reduce_add_ps(sum);
    }
    for (int64_t c = 0; c < dim / 32; c++) {  /* O[:, 32 c .. 32 c + 31] */
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t kb = 0; kb < width / 32; kb++) {
            _tile_loadd(3, probs + 32 * kb, width * 2);
            _tile_loadd(4, vpack + (kb * (dim / 16) + 2 * c) * 512, 64);
            _tile_loadd(5, vpack + (kb * (dim / 16) + 2 * c + 1) * 512, 64);
            _tile_dpbf16ps(6, 3, 4);
            _tile_dpbf16ps(7, 3, 5);
        }
        _tile_stored(6, obuf, 128);
        _tile_stored(7, obuf + 16, 128);
        for (int64_t i = 0; i < m; i++) {
            const __m512 inv = _mm512_set1_ps(1.0f / sums[i]);
            const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(obuf + 32 * i), inv);
            const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(obuf + 32 * i + 16), inv);
            _mm512_storeu_si512(out + i * out_stride + 32 * c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

/* Bytes of scratch one call needs for contexts up to max_ctx (the caller passes at least that much). */
int64_t prefill_attention_scratch(int64_t max_ctx, int64_t dim) {
    const int64_t pad = round_up(max_ctx, 32);
    return (pad / 16 * (dim / 32) * 512 + pad / 32 * (dim / 16) * 512 + 16 * pad + dim / 32 * 512) * 2
           + (16 * pad + 16 * 32 + 16) * 4 + 256;
}

/* 0 where AMX runs here (the tile data state granted to this process), else -1. */
int prefill_attention_ready(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

/* q, out: [T, H, D] bfloat16 contiguous (the step's rows; out's chunk rows are written). kv: the layer's cache,
 * element strides (block, kv, token, head), D contiguous. chunks: [C, 3] int32 (first row in q, length n, context
 * ctx: its queries are positions ctx - n .. ctx - 1); tables: [C, W] int32 block ids. Returns 0, or 1 for a head_dim
 * it does not take. */
int prefill_attention(const uint16_t *q, uint16_t *out, const uint16_t *kv, int64_t s_block, int64_t s_kv,
                      int64_t s_tok, int64_t s_head, const int32_t *chunks, int64_t num_chunks, const int32_t *tables,
                      int64_t width, int64_t num_heads, int64_t num_kv_heads, int64_t dim, int64_t block_size,
                      float scale, void *scratch) {
    if (dim % 32 != 0 || dim > MAX_DIM) return 1;
    int64_t max_ctx = 0;
    for (int64_t c = 0; c < num_chunks; c++) max_ctx = chunks[3 * c + 2] > max_ctx ? chunks[3 * c + 2] : max_ctx;
    const int64_t pad = round_up(max_ctx, 32), group = num_heads / num_kv_heads, row = num_heads * dim;
    uint16_t *kpack = (uint16_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    uint16_t *vpack = kpack + pad / 16 * (dim / 32) * 512;
    uint16_t *probs = vpack + pad / 32 * (dim / 16) * 512;
    uint16_t *qbuf = probs + 16 * pad;
    float *scores = (float *)(qbuf + dim / 32 * 512), *obuf = scores + 16 * pad, *sums = obuf + 16 * 32;
    configure();
    for (int64_t c = 0; c < num_chunks; c++) {
        const int64_t start = chunks[3 * c], n = chunks[3 * c + 1], ctx = chunks[3 * c + 2], cpad = round_up(ctx, 32);
        const int32_t *table = tables + c * width;
        for (int64_t g = 0; g < num_kv_heads; g++) {
            pack_keys(kpack, kv, table, ctx, cpad, dim, block_size, s_block, s_tok, g * s_head);
            pack_values(vpack, kv + s_kv, table, ctx, cpad, dim, block_size, s_block, s_tok, g * s_head);
            for (int64_t h = g * group; h < (g + 1) * group; h++)
                for (int64_t r0 = 0; r0 < n; r0 += 16)
                    attend_block(q + (start + r0) * row + h * dim, row, out + (start + r0) * row + h * dim,
                                 row, n - r0 < 16 ? n - r0 : 16, ctx - n + r0, kpack, vpack, dim, scale, scores,
                                 probs, qbuf, obuf, sums);
        }
    }
    _tile_release();
    return 0;
}
#else
int64_t prefill_attention_scratch(int64_t max_ctx, int64_t dim) { (void)max_ctx; (void)dim; return 0; }
int prefill_attention_ready(void) { return -1; }
int prefill_attention(const uint16_t *q, uint16_t *out, const uint16_t *kv, int64_t s_block, int64_t s_kv,
                      int64_t s_tok, int64_t s_head, const int32_t *chunks, int64_t num_chunks, const int32_t *tables,
                      int64_t width, int64_t num_heads, int64_t num_kv_heads, int64_t dim, int64_t block_size,
                      float scale, void *scratch) {
    (void)q; (void)out; (void)kv; (void)s_block; (void)s_kv; (void)s_tok; (void)s_head; (void)chunks;
    (void)num_chunks; (void)tables; (void)width; (void)num_heads; (void)num_kv_heads; (void)dim; (void)block_size;
    (void)scale; (void)scratch;
    return 1;
}
#endif
