"""The decode attention kernel's device functions (engine.kernels.decode_attention owns the kernel and its launch):
one tile's block ids and K / V loads (tile_kv; gated by a scalar for the early tile loaded before a PDL wait), the
online softmax step on them (attend_kv; attend_tile is both), and the merge of a row's split partials
(merge_splits).
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.e4m3 import widen_e4m3_words
from engine.kernels.online_softmax import softmax_step, tile_scores


@triton.jit
def attend_tile(q, m_i, l_i, acc, kv_ptr, table_row, head_off, tile, end, stride_kv_blk, stride_kv_kv,
                stride_kv_tok, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_F32: tl.constexpr, V_WORDS: tl.constexpr,
                LAZY: tl.constexpr, SWAPPED: tl.constexpr):
    # One tile of BLOCK_N tokens from `tile` on: the online softmax's state (m_i, l_i [BLOCK_G], acc [BLOCK_G,
    # BLOCK_D]; SWAPPED: q and acc [BLOCK_D, BLOCK_G], online_softmax) updated with its keys and values. MASKED:
    # tokens at `end` and beyond (and head dims beyond HEAD_DIM) are masked; a whole tile skips every mask and select
    # (the sm_90 build's loop: 1,083 -> 898 instructions on an fp8 cache, 444 -> 383 on bf16).
    k, v = tile_kv(kv_ptr, table_row, head_off, tile, end, stride_kv_blk, stride_kv_kv, stride_kv_tok, HEAD_DIM,
                   BLOCK_D, BLOCK_SIZE, BLOCK_N, MASKED, V_WORDS, False, True)
    return attend_kv(q, m_i, l_i, acc, k, v, tile, end, qk_scale, BLOCK_D, BLOCK_N, MASKED, DOT_F32, V_WORDS, LAZY,
                     SWAPPED)


@triton.jit
def tile_kv(kv_ptr, table_row, head_off, tile, end, stride_kv_blk, stride_kv_kv, stride_kv_tok,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
            MASKED: tl.constexpr, V_WORDS: tl.constexpr, GATED: tl.constexpr, take):
    # The tile's block ids, then K [BLOCK_N, BLOCK_D] and V as stored (an fp8 cache's V as int32 words
    # [BLOCK_N, BLOCK_D / 4] with V_WORDS). GATED: every load also masked by the scalar `take` (none issued when it is
    # false; the kernel's early tile, loaded before its PDL wait).
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    toks = tile + offs_n  # [BLOCK_N]
    t_mask = toks < end
    if GATED:
        t_mask = t_mask & take
    if MASKED or GATED:
        blk = tl.load(table_row + toks // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
    else:
        blk = tl.load(table_row + toks // BLOCK_SIZE).to(tl.int64)
    row = blk * stride_kv_blk + (toks % BLOCK_SIZE) * stride_kv_tok + head_off  # [BLOCK_N]
    kv_mask = t_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    if MASKED or GATED:
        k = tl.load(kv_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    else:
        k = tl.load(kv_ptr + row[:, None] + offs_d[None, :])
    if V_WORDS:  # an fp8 cache's V rows as int32 words, widened before tl.dot transposes them (e4m3.py)
        offs_w = tl.arange(0, BLOCK_D // 4)
        words_ptr = (kv_ptr + stride_kv_kv + row[:, None]).to(tl.pointer_type(tl.int32)) + offs_w[None, :]
        if MASKED or GATED:
            v = tl.load(words_ptr, mask=t_mask[:, None] & (offs_w < HEAD_DIM // 4)[None, :], other=0)
        else:
            v = tl.load(words_ptr)
    elif MASKED or GATED:
        v = tl.load(kv_ptr + stride_kv_kv + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    else:
        v = tl.load(kv_ptr + stride_kv_kv + row[:, None] + offs_d[None, :])
    return k, v


@triton.jit
def attend_kv(q, m_i, l_i, acc, k, v, tile, end, qk_scale, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
              MASKED: tl.constexpr, DOT_F32: tl.constexpr, V_WORDS: tl.constexpr, LAZY: tl.constexpr,
              SWAPPED: tl.constexpr):
    # attend_tile's arithmetic on a tile's loaded K / V (tile_kv); LAZY: online_softmax's lagging max; SWAPPED: the
    # transposed step (q, acc and the scores transposed: online_softmax)
    if V_WORDS:
        v = widen_e4m3_words(v, BLOCK_N, BLOCK_D, not DOT_F32)  # [BLOCK_N, BLOCK_D] float16
    k = k.to(q.dtype)  # no-ops unless the cache is fp8 or q float32 (fp8 scales folded into qk_scale, v_scale)
    v = v.to(q.dtype)
    s = tile_scores(q, k, qk_scale, DOT_F32, SWAPPED)  # [BLOCK_G, BLOCK_N] ([BLOCK_N, BLOCK_G] SWAPPED)
    if MASKED:
        seen = tile + tl.arange(0, BLOCK_N) < end
        s = tl.where(seen[:, None] if SWAPPED else seen[None, :], s, float("-inf"))
    return softmax_step(s, v, m_i, l_i, acc, DOT_F32, LAZY, SWAPPED)  # m_i finite: a tile holds >= 1 valid token


@triton.jit
def merge_splits(part_out_ptr, part_lse_ptr, out_row_ptr, stride_oh, first_row, first_head, busy_splits,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 MERGE_G: tl.constexpr, MERGE_S: tl.constexpr):
    # The GROUP heads' outputs from the busy splits' partials, weighted by exp2(lse - max lse), MERGE_S splits at a
    # time ([MERGE_G, MERGE_S, D] fp32 tile). The partials were written by other programs: .cg loads read them from
    # L2, past this SM's L1.
    offs_g = tl.arange(0, MERGE_G)
    offs_s = tl.arange(0, MERGE_S)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    rows = first_row + offs_g[:, None] * NUM_SPLITS + offs_s[None, :]  # [MERGE_G, MERGE_S]
    m = tl.full([MERGE_G], float("-inf"), tl.float32)
    total = tl.zeros([MERGE_G], tl.float32)
    acc = tl.zeros([MERGE_G, BLOCK_D], tl.float32)
    for s0 in range(0, busy_splits, MERGE_S):  # one pass, rescaling by the running max like the online softmax
        mask = g_mask[:, None] & (s0 + offs_s < busy_splits)[None, :]
        lse = tl.load(part_lse_ptr + s0 + rows, mask=mask, other=float("-inf"), cache_modifier=".cg")
        parts = tl.load(part_out_ptr + (s0 + rows)[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                        mask=mask[:, :, None] & d_mask[None, None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 1))  # finite: every chunk has >= 1 busy split
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new[:, None])  # [MERGE_G, MERGE_S], 0 where masked
        total = total * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(parts * w[:, :, None], 1)
        m = m_new
    o = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_row_ptr + (first_head + offs_g)[:, None] * stride_oh + offs_d[None, :],
             o.to(out_row_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
