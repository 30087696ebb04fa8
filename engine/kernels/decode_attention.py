"""Paged decode attention (one new token per sequence) as a Triton flash-decoding kernel, and its wrapper.

Owns `decode_attention`: the semantics of engine.attention.paged_attention's decode branch (the query sits at
position context_len - 1 and sees every cached key up to it, or the last `sliding_window` of them; GQA), read
straight from the paged cache through the block table, without gathering K/V. An fp8 cache (engine.kv_quant) is
widened to q's dtype as it is loaded, k_scale folded into the score scale and v_scale into the output. How it is
launched (tile, warps, stages, splits) is engine.kernels.decode_launch's. Under programmatic dependent launch each
slice's first tile is loaded before the kernel waits for the one before it, when all its tokens are older than the
row's new one (EARLY_KV).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import check, interpreting
from engine.kernels.attention_args import check_kv_scales, check_paged_attention
from engine.kernels.decode_launch import AttentionLaunch, default_num_splits, launch_config, shuns_pdl
from engine.kernels.decode_tiles import attend_kv, attend_tile, merge_splits, tile_kv
from engine.kernels.pdl import dependents_may_start, pdl_args, wait_for_inputs

LOG2E = 1.4426950408889634
NO_PDL = {"PDL": False, "PDL_LATE": False, "launch_pdl": False}
# Under PDL, each slice's first tile is requested before the kernel waits for the one before (the kernel's EARLY_KV).
# An fp8 cache's batch-1 step 1.8-2.0% faster with it, bf16's within 1% either way (H100 / H200, 2026-12-06:
# benchmarks/attention_stages.py --early-kv off).
EARLY_KV = True
# fp32 elements of the merge's [GROUP, splits, D] tile at 4 warps (scaled by the launch's warps): 64 registers a thread;
# a one-warp program merging 16 splits at once spilled 90 registers (sm_90 build)
MERGE_TILE = 8192


# Grid (KVH, NUM_SPLITS, B). Decode is memory-bound: every K/V byte of the context is read once, so one program owns one
# KV head and all GROUP = H/KVH query heads that share it (rows of a [BLOCK_G >= 16, D] Q tile, padded and masked, so
# tl.dot applies; columns of a [D, BLOCK_G >= 8] one when the launch is swapped), and streams one contiguous slice of
# the context. Slices are whole paged blocks, cdiv(blocks, NUM_SPLITS) each but at least MIN_SPLIT_BLOCKS (one tile),
# computed from context_lens[b] on the device: NUM_SPLITS comes from shapes (a CUDA graph sizes it for the longest
# context), and a short context keeps only as many splits busy as it has tiles; the others find an empty slice and exit
# at once. A tile is BLOCK_N tokens spanning several paged blocks: each token's block id is read from the table, and its
# K row (D contiguous elements) is one coalesced load; BLOCK_N rows of K and V in flight per iteration (and num_stages
# ahead) keep HBM busy. The KV head is the fastest grid axis: programs running side by side read the interleaved heads
# of the same blocks, so together they sweep each block's contiguous [bs, KVH, D] span. Online softmax in fp32 with
# base-2 exponentials (log2(e) folded into the scale). With one split the program normalises and writes the output
# itself. Otherwise each busy split writes its normalised partial output [B, H, S, D] and log2-sum-exp [B, H, S], then
# counts itself in on the (b, kvh) semaphore (release); the busy program that arrives last (acquire) merges the busy
# splits' partials for its GROUP heads and sets the semaphore back to 0, so the next call (next layer, next graph
# replay) finds it zeroed. That saves a second launch, which at batch 1 costs more than the merge itself.
# the block-table row stride varies with every step's widest table: specialising on it would compile new
# variants while serving (engine.runner.warmup)
@triton.jit(do_not_specialize=["stride_tb"])
def _decode_split_kernel(
    q_ptr, kv_ptr, tables_ptr, lens_ptr, part_out_ptr, part_lse_ptr, sem_ptr, out_ptr,
    stride_qb, stride_qh,
    stride_kv_blk, stride_kv_kv, stride_kv_tok, stride_kv_head,
    stride_tb, stride_ob, stride_oh,
    qk_scale, v_scale,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, MIN_SPLIT_BLOCKS: tl.constexpr, MERGE_G: tl.constexpr, MERGE_S: tl.constexpr,
    WINDOW: tl.constexpr, DOT_F32: tl.constexpr, WIDEN_F16: tl.constexpr, V_WORDS: tl.constexpr,
    WHOLE_TILES: tl.constexpr, PDL: tl.constexpr, EARLY_KV: tl.constexpr = False, LAZY: tl.constexpr = False,
    PDL_LATE: tl.constexpr = False, SWAPPED: tl.constexpr = False,
):
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    if not EARLY_KV:
        wait_for_inputs(PDL, PDL_LATE)

    ctx = tl.load(lens_ptr + b)
    first_tok = 0
    if WINDOW > 0:
        first_tok = tl.maximum(ctx - WINDOW, 0)  # keys at positions <= (ctx - 1) - WINDOW are out of the window
    first_blk = first_tok // BLOCK_SIZE
    num_blocks = tl.cdiv(ctx, BLOCK_SIZE) - first_blk
    blocks_per_split = tl.maximum(tl.cdiv(num_blocks, NUM_SPLITS), MIN_SPLIT_BLOCKS)
    busy_splits = tl.cdiv(num_blocks, blocks_per_split)  # the others' slices are empty
    start = (first_blk + split * blocks_per_split) * BLOCK_SIZE
    end = tl.minimum(start + blocks_per_split * BLOCK_SIZE, ctx)
    start = tl.maximum(start, first_tok)
    table_row = tables_ptr + b * stride_tb
    head_off = kvh * stride_kv_head
    if EARLY_KV:  # under PDL (WHOLE_TILES): the slice's first tile requested before the wait when every one of its
        # tokens is older than the step's own (at context_lens - 1, written by the kernel just before this one);
        # context_lens and the table are the step's inputs, the older K / V earlier steps' (engine.kernels.pdl)
        early = ((NUM_SPLITS == 1) | (split < busy_splits)) & (start + BLOCK_N <= end) & (start + BLOCK_N < ctx)
        k_early, v_early = tile_kv(kv_ptr, table_row, head_off, start, end, stride_kv_blk, stride_kv_kv,
                                   stride_kv_tok, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, False, V_WORDS, True,
                                   early)
        wait_for_inputs(PDL, PDL_LATE)

    if NUM_SPLITS == 1 or split < busy_splits:  # an empty slice has nothing to read, write or count
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        heads = kvh * GROUP + offs_g  # [BLOCK_G]
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        if SWAPPED:  # q^T: the MMAs' 16-row side is the tile's tokens (online_softmax)
            q = tl.load(q_ptr + b * stride_qb + heads[None, :] * stride_qh + offs_d[:, None],
                        mask=g_mask[None, :] & d_mask[:, None], other=0.0)  # [BLOCK_D, BLOCK_G]
        else:
            q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                        mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
        if DOT_F32:
            q = q.to(tl.float32)
        elif WIDEN_F16:  # an fp8 cache: e4m3 widens to float16 in one instruction (bfloat16 takes several)
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_D, BLOCK_G] if SWAPPED else [BLOCK_G, BLOCK_D], tl.float32)
        if WHOLE_TILES:
            whole_end = start + (end - start) // BLOCK_N * BLOCK_N
            first = start
            if EARLY_KV:
                if early:  # the loop's first tile, from the registers it was loaded into
                    m_i, l_i, acc = attend_kv(q, m_i, l_i, acc, k_early, v_early, start, end, qk_scale, BLOCK_D,
                                              BLOCK_N, HEAD_DIM != BLOCK_D, DOT_F32, V_WORDS, LAZY, SWAPPED)
                    first = start + BLOCK_N
            for tile in range(first, whole_end, BLOCK_N):  # whole tiles, no masks (when the head fills BLOCK_D)
                m_i, l_i, acc = attend_tile(q, m_i, l_i, acc, kv_ptr, table_row, head_off, tile, end,
                                            stride_kv_blk, stride_kv_kv, stride_kv_tok, qk_scale, HEAD_DIM, BLOCK_D,
                                            BLOCK_SIZE, BLOCK_N, HEAD_DIM != BLOCK_D, DOT_F32, V_WORDS, LAZY,
                                            SWAPPED)
            # the last, partial tile: an `if`, as a second loop would be pipelined too (one warp: 233 -> 255 registers)
            if whole_end < end:
                m_i, l_i, acc = attend_tile(q, m_i, l_i, acc, kv_ptr, table_row, head_off, whole_end, end,
                                            stride_kv_blk, stride_kv_kv, stride_kv_tok, qk_scale, HEAD_DIM, BLOCK_D,
                                            BLOCK_SIZE, BLOCK_N, True, DOT_F32, V_WORDS, LAZY, SWAPPED)
        else:  # every tile masked (the kernel before whole tiles: benchmarks time it as the reference)
            for tile in range(start, end, BLOCK_N):
                m_i, l_i, acc = attend_tile(q, m_i, l_i, acc, kv_ptr, table_row, head_off, tile, end,
                                            stride_kv_blk, stride_kv_kv, stride_kv_tok, qk_scale, HEAD_DIM, BLOCK_D,
                                            BLOCK_SIZE, BLOCK_N, True, DOT_F32, V_WORDS, LAZY, SWAPPED)

        dependents_may_start(PDL, PDL_LATE)  # the slice is read: the output and the splits' merge are left
        if SWAPPED:
            acc = tl.trans(acc)  # [BLOCK_G, BLOCK_D], once a program
        has = l_i > 0  # false only for context 0 with one split
        l_safe = tl.where(has, l_i, 1.0)
        o = acc / l_safe[:, None]  # acc is 0 where empty -> zeros
        if kv_ptr.dtype.element_ty == tl.float8e4nv:  # an fp8 cache: its values are V / v_scale
            o = o * v_scale
        if NUM_SPLITS == 1:
            tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
        else:
            row_ids = (b * NUM_HEADS + heads) * NUM_SPLITS + split  # [BLOCK_G] rows of [B, H, S]
            tl.store(part_out_ptr + row_ids[:, None] * HEAD_DIM + offs_d[None, :], o,
                     mask=g_mask[:, None] & d_mask[None, :])
            tl.store(part_lse_ptr + row_ids, m_i + tl.log2(l_safe), mask=g_mask)
            tl.debug_barrier()  # every thread's partial stores precede the release below
            sem = sem_ptr + b * NUM_KV_HEADS + kvh
            if tl.atomic_add(sem, 1, sem="acq_rel", scope="gpu") == busy_splits - 1:
                merge_splits(part_out_ptr, part_lse_ptr, out_ptr + b * stride_ob, stride_oh,
                             (b * NUM_HEADS + kvh * GROUP) * NUM_SPLITS, kvh * GROUP, busy_splits,
                             GROUP, HEAD_DIM, BLOCK_D, NUM_SPLITS, MERGE_G, MERGE_S)
                tl.atomic_xchg(sem, 0, sem="relaxed", scope="gpu")
    elif split == 0:  # no busy split at all (context 0, a padding row): zeros
        heads = kvh * GROUP + tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 tl.zeros([BLOCK_G, BLOCK_D], out_ptr.dtype.element_ty),
                 mask=(tl.arange(0, BLOCK_G) < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :])


def decode_attention(q: torch.Tensor,             # [B, H, D]
                     kv_layer: torch.Tensor,      # [NB, 2, bs, KVH, D], strided layer view
                     block_tables: torch.Tensor,  # [B, max_blocks] int32
                     context_lens: torch.Tensor,  # [B] int32, 0 = padding row
                     scale: float, sliding_window: int | None = None,
                     num_splits: int | None = None, out: torch.Tensor | None = None,
                     semaphores: torch.Tensor | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0, launch: AttentionLaunch | None = None,
                     early_kv: bool | None = None) -> torch.Tensor:  # [B, H, D]
    """Attention of each sequence's one new token (already in the cache) over its context; q's dtype out.
    `semaphores` [>= B, KVH] int32, all zero, is the splits' meeting point; the kernel leaves it zero again, so a
    caller can keep one (a CUDA graph's static buffer) instead of a fresh zeroed one per call. kv_layer holds q's
    dtype, or fp8 K / k_scale and V / v_scale (other caches ignore the scales). `launch` overrides
    launch_config (benchmarks time several). `early_kv` None: EARLY_KV under PDL (whole tiles only); True / False
    force the early first tile on or off (tests run it without PDL, where the wait is a no-op)."""
    out = check_paged_attention(q, kv_layer, block_tables, q.shape[0], sliding_window, out)
    k_scale, v_scale = check_kv_scales(kv_layer, k_scale, v_scale)
    dev = q.device
    check("context_lens", context_lens, 1, (torch.int32,), dev, inner_contiguous=True)
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    if context_lens.shape[0] != batch:
        raise ValueError(f"context_lens must be [{batch}], got shape {tuple(context_lens.shape)}")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be None or a positive int, got {num_splits!r}")
    if batch == 0:
        return out

    fp8_cache = kv_layer.dtype == torch.float8_e4m3fn
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    launch = AttentionLaunch(*(launch or launch_config(q.dtype, head_dim, fp8_cache, batch * num_kv_heads)))
    block_n, num_warps, num_stages, whole_tiles, v_words, lazy, swapped = launch
    splits = num_splits or default_num_splits(batch, num_kv_heads, block_tables.shape[1], dev, fp8_cache,
                                              max(1, block_n // block_size))
    if splits > 1:
        part_out = torch.empty((batch, num_heads, splits, head_dim), dtype=torch.float32, device=dev)
        part_lse = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=dev)
        if semaphores is None:
            semaphores = torch.zeros((batch, num_kv_heads), dtype=torch.int32, device=dev)
        else:
            check("semaphores", semaphores, 2, (torch.int32,), dev)
            if semaphores.shape[0] < batch or semaphores.shape[1] != num_kv_heads or not semaphores.is_contiguous():
                raise ValueError(f"semaphores must be a contiguous [>= {batch}, {num_kv_heads}] int32 tensor, got "
                                 f"shape {tuple(semaphores.shape)}")
    else:  # the program writes `out` directly; the scratch pointers are unused
        part_out = part_lse = semaphores = out
    merge_g = triton.next_power_of_2(group)
    dot_f32 = interpreting() or q.dtype == torch.float32
    pdl = NO_PDL if shuns_pdl(launch) else pdl_args(dev, batch)
    _decode_split_kernel[(num_kv_heads, splits, batch)](
        q, kv_layer, block_tables, context_lens, part_out, part_lse, semaphores, out,
        q.stride(0), q.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        scale * k_scale * LOG2E, v_scale,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group,
        # the MMA's rows (16) or, swapped, its columns (8): a group of fewer heads is padded with masked ones
        BLOCK_G=max(8 if swapped else 16, merge_g),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        NUM_SPLITS=splits, MIN_SPLIT_BLOCKS=max(1, block_n // block_size), MERGE_G=merge_g,
        MERGE_S=max(1, min(triton.next_power_of_2(splits), MERGE_TILE * num_warps // 4 // (merge_g * block_d))),
        WINDOW=sliding_window or 0, DOT_F32=dot_f32,
        WIDEN_F16=not dot_f32 and fp8_cache, V_WORDS=v_words and fp8_cache and _whole_words(kv_layer),
        WHOLE_TILES=whole_tiles, SWAPPED=swapped,
        EARLY_KV=whole_tiles and (EARLY_KV and pdl["PDL"] if early_kv is None else early_kv), LAZY=lazy,
        num_warps=num_warps, num_stages=num_stages, **pdl,
    )
    return out


def _whole_words(kv_layer: torch.Tensor) -> bool:
    """Whether an fp8 layer's V rows can be read as int32 words: 4-byte aligned rows of whole words."""
    return kv_layer.shape[4] % 4 == 0 and kv_layer.data_ptr() % 4 == 0 and all(
        st % 4 == 0 for st in kv_layer.stride()[:4])
