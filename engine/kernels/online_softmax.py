"""The flash-attention step both paged attention kernels share (engine.kernels.decode_attention, prefill_attention):
a tile's base-2 scores, then the online softmax's running max, sum and output updated with the tile. Each kernel
owns its loads and masks; these own only the math between them, in float32 (with DOT_F32, the Triton interpreter's
case and float32 models, the dots run in IEEE float32; otherwise in the operands' 16-bit type)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_scores(q, k, qk_scale, DOT_F32: tl.constexpr):
    # q [M, D] . k [N, D]^T -> [M, N] float32, times qk_scale (the softmax scale with log2(e) and k_scale folded in)
    if DOT_F32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s * qk_scale


@triton.jit
def softmax_step(s, v, m_i, l_i, acc, DOT_F32: tl.constexpr):
    # masked scores s [M, N] (-inf where not seen) and the tile's values v [N, D] into the running max m_i [M],
    # sum l_i [M] and output acc [M, D]; the caller keeps m_i finite (a tile with a visible key, or a finite start),
    # so a row with every key masked adds p = 0, not NaN
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc
