"""The flash-attention step both paged attention kernels share (engine.kernels.decode_attention, prefill_attention):
a tile's base-2 scores, then the online softmax's running max, sum and output updated with the tile. Each kernel
owns its loads and masks; these own only the math between them, in float32 (with DOT_F32, the Triton interpreter's
case and float32 models, the dots run in IEEE float32; otherwise in the operands' 16-bit type). With LAZY the
running max may lag the true one by up to 2^LAZY_TAU: the state is rescaled only in a tile where some row's max
passes it by more than that, so most tiles skip the [M, D] rescale of acc (the result differs from the exact one
only by float rounding).

SWAPPED (the decode kernel's AttentionLaunch.swapped, engine.kernels.decode_launch: its fp8 cache's one-warp launch):
the same step on the transposed tile, scores [N, M] = K . q^T and output acc [D, M] += V^T . P^T, so that the MMA's
16-row side is the tile's tokens, not a GQA group of 4-8 query heads padded to 16 (half the MMAs, half acc's
registers)."""

from __future__ import annotations

import triton
import triton.language as tl

LAZY_TAU = tl.constexpr(8.0)  # p <= 2^8 = 256: far inside float16 (P.V's operand) and float32


@triton.jit
def tile_scores(q, k, qk_scale, DOT_F32: tl.constexpr, SWAPPED: tl.constexpr = False):
    # q [M, D] . k [N, D]^T -> [M, N] float32, times qk_scale (the softmax scale with log2(e) and k_scale folded in);
    # SWAPPED: k [N, D] . q [D, M] (q given transposed) -> [N, M]
    if DOT_F32:
        k = k.to(tl.float32)
        s = tl.dot(k, q, input_precision="ieee") if SWAPPED else tl.dot(q, tl.trans(k), input_precision="ieee")
    elif SWAPPED:
        s = tl.dot(k, q)
    else:
        s = tl.dot(q, tl.trans(k))
    return s * qk_scale


@triton.jit
def _plus_pv(p, v, acc, DOT_F32: tl.constexpr, SWAPPED: tl.constexpr, INTO: tl.constexpr):
    # acc + P . V with p [M, N], v [N, D], acc [M, D]; SWAPPED: acc^T + V^T . P^T with p [N, M], acc [D, M].
    # INTO: the MMA accumulates into acc (the lazy step's form); otherwise its product is added to acc after
    if DOT_F32:
        v = v.to(tl.float32)
    else:
        p = p.to(v.dtype)
    a, b = (tl.trans(v), p) if SWAPPED else (p, v)
    if INTO:
        return tl.dot(a, b, acc, input_precision="ieee") if DOT_F32 else tl.dot(a, b, acc)
    return acc + (tl.dot(a, b, input_precision="ieee") if DOT_F32 else tl.dot(a, b))


@triton.jit
def softmax_step(s, v, m_i, l_i, acc, DOT_F32: tl.constexpr, LAZY: tl.constexpr = False,
                 SWAPPED: tl.constexpr = False):
    # masked scores s [M, N] (-inf where not seen) and the tile's values v [N, D] into the running max m_i [M],
    # sum l_i [M] and output acc [M, D] (SWAPPED: s [N, M], acc [D, M]); the caller keeps m_i finite (a tile with a
    # visible key, or a finite start), so a row with every key masked adds p = 0, not NaN
    # the scores' axis of keys, where a per-query vector [M] is broadcast: [M, 1], or [1, M] when transposed
    KEYS: tl.constexpr = 0 if SWAPPED else 1
    if LAZY:
        m_tile = tl.max(s, KEYS)
        if tl.max(m_tile - m_i, 0) > LAZY_TAU:  # one branch a tile, uniform across the program (always on the first)
            m_new = tl.maximum(m_i, m_tile)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha
            acc = acc * tl.expand_dims(alpha, KEYS)
            m_i = m_new
        p = tl.exp2(s - tl.expand_dims(m_i, KEYS))  # <= 2^LAZY_TAU
        return m_i, l_i + tl.sum(p, KEYS), _plus_pv(p, v, acc, DOT_F32, SWAPPED, True)
    m_new = tl.maximum(m_i, tl.max(s, KEYS))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - tl.expand_dims(m_new, KEYS))
    l_i = l_i * alpha + tl.sum(p, KEYS)
    return m_new, l_i, _plus_pv(p, v, acc * tl.expand_dims(alpha, KEYS), DOT_F32, SWAPPED, False)
