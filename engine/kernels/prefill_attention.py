"""Paged prefill attention (chunks of new tokens of several sequences) as a Triton flash-attention-2 kernel.

Owns `prefill_attention`: the semantics of engine.attention.paged_attention's prefill branch (query j of a chunk of
q_len new tokens sits at position context_len - q_len + j and attends causally to every key up to it, or the last
`sliding_window` of them; GQA). Keys and values, the cached prefix (chunked prefill, prefix-cache hit) and the new
tokens alike, are read from the paged cache through the block table. An fp8 cache (engine.kv_quant) is widened to
q's dtype as it is loaded, k_scale folded into the score scale and v_scale into the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import check, interpreting
from engine.kernels.attention_args import check_kv_scales, check_paged_attention
from engine.kernels.online_softmax import softmax_step, tile_scores

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(acc, l_i, m_i, q, kv_ptr, table_row, tile, hi, pos, offs_n, offs_d, d_mask, head_off,
                 stride_kv_blk, stride_kv_kv, stride_kv_tok, qk_scale,
                 BLOCK_SIZE: tl.constexpr, EVEN_D: tl.constexpr, MASKED: tl.constexpr, WINDOW: tl.constexpr,
                 DOT_F32: tl.constexpr):
    """One online-softmax step over keys tile .. tile + BLOCK_N. MASKED: apply causal, window and bounds (< hi)
    masks; otherwise the caller guarantees every key is visible to every row."""
    toks = tile + offs_n  # [BLOCK_N]
    if MASKED:
        t_mask = toks < hi
        blk = tl.load(table_row + toks // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
    else:
        blk = tl.load(table_row + toks // BLOCK_SIZE).to(tl.int64)
    ptrs = kv_ptr + (blk * stride_kv_blk + (toks % BLOCK_SIZE) * stride_kv_tok + head_off)[:, None] + offs_d[None, :]
    if MASKED:
        k = tl.load(ptrs, mask=t_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(ptrs + stride_kv_kv, mask=t_mask[:, None] & d_mask[None, :], other=0.0)
    elif EVEN_D:
        k = tl.load(ptrs)
        v = tl.load(ptrs + stride_kv_kv)
    else:
        k = tl.load(ptrs, mask=d_mask[None, :], other=0.0)
        v = tl.load(ptrs + stride_kv_kv, mask=d_mask[None, :], other=0.0)
    k = k.to(q.dtype)  # no-ops unless the cache is fp8 (its scales are folded into qk_scale and the output)
    v = v.to(q.dtype)
    s = tile_scores(q, k, qk_scale, DOT_F32)  # [BLOCK_M, BLOCK_N]
    if MASKED:
        allowed = (toks[None, :] <= pos[:, None]) & t_mask[None, :]
        if WINDOW > 0:
            allowed = allowed & (toks[None, :] > pos[:, None] - WINDOW)
        s = tl.where(allowed, s, float("-inf"))
    m_new, l_i, acc = softmax_step(s, v, m_i, l_i, acc, DOT_F32)  # m_i starts finite: a masked row adds p = 0
    return acc, l_i, m_new


# Grid (H, cdiv(max_query_len, BLOCK_M), N): one program = BLOCK_M queries of one head of one sequence (programs
# past the sequence's q_len exit at once). Per head rather than a GQA group packed into M: prefill is compute-bound
# (BLOCK_M flops per K/V byte), the H/KVH heads sharing a KV head are adjacent on grid axis 0 so they run together
# and re-read the same K/V tiles from L2, and a plain [BLOCK_M, D] Q tile keeps the causal tile skipping exact. The
# M axis runs backwards so the longest (last, most keys) blocks start first. Keys are visited in BLOCK_N tiles
# gathered through the block table (per-token block id, each K/V row D contiguous elements), QK^T and PV on tensor
# cores via tl.dot, online softmax in fp32 with base-2 exponentials. Only keys in [lo, hi) are visited (hi = last
# row's position + 1: tiles above the diagonal are skipped; lo = the first row's window start): the tiles that every
# row sees whole run without masks; the window-edge tiles before them and the diagonal tiles after them are masked.
# the block-table row stride varies with every step's widest table: specialising on it would compile new
# variants while serving (engine.runner.warmup)
@triton.jit(do_not_specialize=["stride_tb"])
def _prefill_kernel(
    q_ptr, kv_ptr, tables_ptr, qstart_ptr, lens_ptr, out_ptr,
    stride_qt, stride_qh,
    stride_kv_blk, stride_kv_kv, stride_kv_tok, stride_kv_head,
    stride_tb, stride_ot, stride_oh,
    qk_scale, v_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, DOT_F32: tl.constexpr,
):
    h = tl.program_id(0)
    m_block = tl.num_programs(1) - 1 - tl.program_id(1)
    n = tl.program_id(2)

    q_start = tl.load(qstart_ptr + n)
    q_len = tl.load(qstart_ptr + n + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    ctx = tl.load(lens_ptr + n)
    prefix = ctx - q_len  # tokens cached before this chunk

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    pos = prefix + offs_m  # [BLOCK_M] query positions
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if DOT_F32:
        q = q.to(tl.float32)

    first_pos = prefix + m_block * BLOCK_M
    last_pos = prefix + tl.minimum((m_block + 1) * BLOCK_M, q_len) - 1
    hi = last_pos + 1
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(first_pos - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    mid_hi = lo + (first_pos + 1 - lo) // BLOCK_N * BLOCK_N  # tiles below: every key <= first_pos
    mid_lo = lo
    if WINDOW > 0:  # tiles from here on: every key > last_pos - WINDOW
        mid_lo = tl.minimum(lo + tl.cdiv(tl.maximum(last_pos - WINDOW + 1 - lo, 0), BLOCK_N) * BLOCK_N, mid_hi)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = tables_ptr + n * stride_tb
    head_off = (h // GROUP) * stride_kv_head
    for tile in range(lo, mid_lo, BLOCK_N):  # window's lower edge
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, kv_ptr, table_row, tile, hi, pos, offs_n, offs_d, d_mask,
                                     head_off, stride_kv_blk, stride_kv_kv, stride_kv_tok, qk_scale,
                                     BLOCK_SIZE, HEAD_DIM == BLOCK_D, True, WINDOW, DOT_F32)
    for tile in range(mid_lo, mid_hi, BLOCK_N):  # seen whole by every row
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, kv_ptr, table_row, tile, hi, pos, offs_n, offs_d, d_mask,
                                     head_off, stride_kv_blk, stride_kv_kv, stride_kv_tok, qk_scale,
                                     BLOCK_SIZE, HEAD_DIM == BLOCK_D, False, WINDOW, DOT_F32)
    for tile in range(mid_hi, hi, BLOCK_N):  # the diagonal
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, kv_ptr, table_row, tile, hi, pos, offs_n, offs_d, d_mask,
                                     head_off, stride_kv_blk, stride_kv_kv, stride_kv_tok, qk_scale,
                                     BLOCK_SIZE, HEAD_DIM == BLOCK_D, True, WINDOW, DOT_F32)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # every real row sees its own key, so l_i > 0 there
    if kv_ptr.dtype.element_ty == tl.float8e4nv:  # an fp8 cache: its values are V / v_scale
        o = o * v_scale
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _launch_config(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). 16-bit, D <= 128: 128 x 64 tiles on 8 warps (two Hopper warpgroups
    of m64 wgmma), three K/V stages in flight (sm_90 build: ~176 registers, 96 KiB shared memory, no spills). Wider
    heads: 64 x 64, two stages (160 KiB shared memory). fp32 (ieee dots, a test/debug path): 64 x 32. The interpreter
    gets 16 x 16 tiles so that small tests cross tile boundaries."""
    if interpreting():
        return 16, 16, 4, 1
    if dtype == torch.float32:
        return 64, 32, 8, 2
    if head_dim > 128:
        return 64, 64, 8, 2
    return 128, 64, 8, 3


def prefill_attention(q: torch.Tensor,             # [T, H, D]
                      kv_layer: torch.Tensor,      # [NB, 2, bs, KVH, D], strided layer view
                      block_tables: torch.Tensor,  # [N, max_blocks] int32
                      query_start: torch.Tensor,   # [N + 1] int32, cumulative new-token counts
                      context_lens: torch.Tensor,  # [N] int32, context incl. the new tokens
                      max_query_len: int,
                      scale: float, sliding_window: int | None = None,
                      out: torch.Tensor | None = None, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each sequence's new tokens (already in the cache) over its whole context. kv_layer holds
    q's dtype, or fp8 K / k_scale and V / v_scale (other caches ignore the scales)."""
    check("context_lens", context_lens, 1, (torch.int32,), q.device, inner_contiguous=True)
    num_seqs = context_lens.shape[0]
    out = check_paged_attention(q, kv_layer, block_tables, num_seqs, sliding_window, out)
    k_scale, v_scale = check_kv_scales(kv_layer, k_scale, v_scale)
    check("query_start", query_start, 1, (torch.int32,), q.device, inner_contiguous=True)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    if query_start.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start must be [{num_seqs + 1}], got shape {tuple(query_start.shape)}")
    if not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be a non-negative int, got {max_query_len!r}")
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out

    block_m, block_n, num_warps, num_stages = _launch_config(q.dtype, head_dim)
    grid = (num_heads, triton.cdiv(max_query_len, block_m), num_seqs)
    _prefill_kernel[grid](
        q, kv_layer, block_tables, query_start, context_lens, out,
        q.stride(0), q.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        scale * k_scale * LOG2E, v_scale,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, WINDOW=sliding_window or 0,
        DOT_F32=interpreting() or q.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
