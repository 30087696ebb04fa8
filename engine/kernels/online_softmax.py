"""The flash-attention step both paged attention kernels share (engine.kernels.decode_attention, prefill_attention):
a tile's base-2 scores, then the online softmax's running max, sum and output updated with the tile. Each kernel
owns its loads and masks; these own only the math between them, in float32 (with DOT_F32, the Triton interpreter's
case and float32 models, the dots run in IEEE float32; otherwise in the operands' 16-bit type). With LAZY the
running max may lag the true one by up to 2^LAZY_TAU: the state is rescaled only in a tile where some row's max
passes it by more than that, so most tiles skip the [M, D] rescale of acc (the result differs from the exact one
only by float rounding)."""

from __future__ import annotations

import triton
import triton.language as tl

LAZY_TAU = tl.constexpr(8.0)  # p <= 2^8 = 256: far inside float16 (P.V's operand) and float32


@triton.jit
def tile_scores(q, k, qk_scale, DOT_F32: tl.constexpr):
    # q [M, D] . k [N, D]^T -> [M, N] float32, times qk_scale (the softmax scale with log2(e) and k_scale folded in)
    if DOT_F32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s * qk_scale


@triton.jit
def softmax_step(s, v, m_i, l_i, acc, DOT_F32: tl.constexpr, LAZY: tl.constexpr = False):
    # masked scores s [M, N] (-inf where not seen) and the tile's values v [N, D] into the running max m_i [M],
    # sum l_i [M] and output acc [M, D]; the caller keeps m_i finite (a tile with a visible key, or a finite start),
    # so a row with every key masked adds p = 0, not NaN
    if LAZY:
        return _lazy_step(s, v, m_i, l_i, acc, DOT_F32)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _lazy_step(s, v, m_i, l_i, acc, DOT_F32: tl.constexpr):
    # softmax_step with a lagging max: one branch a tile (uniform across the program), taken when some row's tile
    # max passes its running max by more than LAZY_TAU (always on the first tile: m_i starts at -inf)
    m_tile = tl.max(s, 1)
    if tl.max(m_tile - m_i, 0) > LAZY_TAU:
        m_new = tl.maximum(m_i, m_tile)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha
        acc = acc * alpha[:, None]
        m_i = m_new
    p = tl.exp2(s - m_i[:, None])  # <= 2^LAZY_TAU
    l_i = l_i + tl.sum(p, 1)
    if DOT_F32:
        acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return m_i, l_i, acc
