"""Paged decode attention (one new token per sequence) as a Triton flash-decoding kernel, and its wrapper.

Owns `decode_attention`: the semantics of engine.attention.paged_attention's decode branch (the query sits at
position context_len - 1 and sees every cached key up to it, or the last `sliding_window` of them; GQA), read
straight from the paged cache through the block table, without gathering K/V. An fp8 cache (engine.kv_quant) is
widened to q's dtype as it is loaded, k_scale folded into the score scale and v_scale into the output.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine.kernels import check, interpreting
from engine.kernels.attention_args import check_kv_scales, check_paged_attention
from engine.kernels.pdl import pdl_args, wait_for_inputs

LOG2E = 1.4426950408889634
NO_PDL = {"PDL": False, "launch_pdl": False}
MERGE_TILE = 8192  # fp32 elements of the merge's [GROUP, splits, D] tile: 64 registers a thread at 4 warps


# Grid (KVH, NUM_SPLITS, B). Decode is memory-bound: every K/V byte of the context is read once, so one program owns
# one KV head and all GROUP = H/KVH query heads that share it (rows of a [BLOCK_G >= 16, D] Q tile, padded and
# masked, so tl.dot applies), and streams one contiguous slice of the context. Slices are whole paged blocks,
# cdiv(blocks, NUM_SPLITS) each but at least MIN_SPLIT_BLOCKS (one tile), computed from context_lens[b] on the
# device: NUM_SPLITS comes from shapes (a CUDA graph sizes it for the longest context), and a short context keeps
# only as many splits busy as it has tiles; the others find an empty slice and exit at once. A tile is BLOCK_N
# tokens spanning several paged blocks: each token's block id is read from the table, and its K row (D contiguous
# elements) is one coalesced load; BLOCK_N rows of K and V in flight per iteration (and num_stages ahead) keep HBM
# busy. The KV head is the fastest grid axis: programs running side by side read the interleaved heads of the same
# blocks, so together they sweep each block's contiguous [bs, KVH, D] span. Online softmax in fp32 with base-2
# exponentials (log2(e) folded into the scale). With one split the program normalises and writes the output itself.
# Otherwise each busy split writes its normalised partial output [B, H, S, D] and log2-sum-exp [B, H, S], then
# counts itself in on the (b, kvh) semaphore (release); the busy program that arrives last (acquire) merges the
# busy splits' partials for its GROUP heads and sets the semaphore back to 0, so the next call (next layer, next graph
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
    WINDOW: tl.constexpr, DOT_F32: tl.constexpr, WIDEN_F16: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)

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

    if NUM_SPLITS == 1 or split < busy_splits:  # an empty slice has nothing to read, write or count
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        heads = kvh * GROUP + offs_g  # [BLOCK_G]
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
        if DOT_F32:
            q = q.to(tl.float32)
        elif WIDEN_F16:  # an fp8 cache: e4m3 widens to float16 in one instruction (bfloat16 takes several)
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        table_row = tables_ptr + b * stride_tb
        head_off = kvh * stride_kv_head
        for tile in range(start, end, BLOCK_N):  # every tile holds >= 1 valid token, so m_i is finite after it
            toks = tile + offs_n  # [BLOCK_N]
            t_mask = toks < end
            blk = tl.load(table_row + toks // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
            row = blk * stride_kv_blk + (toks % BLOCK_SIZE) * stride_kv_tok + head_off  # [BLOCK_N]
            kv_mask = t_mask[:, None] & d_mask[None, :]
            k = tl.load(kv_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            v = tl.load(kv_ptr + stride_kv_kv + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            k = k.to(q.dtype)  # no-ops unless the cache is fp8 or q float32 (fp8 scales folded into qk_scale, v_scale)
            v = v.to(q.dtype)
            if DOT_F32:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(t_mask[None, :], s * qk_scale, float("-inf"))  # [BLOCK_G, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if DOT_F32:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

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
                _merge_splits(part_out_ptr, part_lse_ptr, out_ptr + b * stride_ob, stride_oh,
                              (b * NUM_HEADS + kvh * GROUP) * NUM_SPLITS, kvh * GROUP, busy_splits,
                              GROUP, HEAD_DIM, BLOCK_D, NUM_SPLITS, MERGE_G, MERGE_S)
                tl.atomic_xchg(sem, 0, sem="relaxed", scope="gpu")
    elif split == 0:  # no busy split at all (context 0, a padding row): zeros
        heads = kvh * GROUP + tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 tl.zeros([BLOCK_G, BLOCK_D], out_ptr.dtype.element_ty),
                 mask=(tl.arange(0, BLOCK_G) < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit
def _merge_splits(part_out_ptr, part_lse_ptr, out_row_ptr, stride_oh, first_row, first_head, busy_splits,
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


def _launch_config(dtype: torch.dtype, head_dim: int, fp8_cache: bool) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages). 16-bit, D <= 128: 64 tokens per tile (16 KiB each of K and V
    in bf16 at D = 128), 4 warps, pipelined loads (sm_90 build: ~104 registers, 39 KiB shared memory, so ~4 programs
    per SM). An fp8 cache (widened to float16): 128-token tiles, the same bytes a tile as bf16's 64, on five stages:
    the sm_90 build then gives K and V two shared buffers each (three or four stages give one), so each program has
    two tiles in flight; its ~201 registers fit two programs a SM. On an H200 (`gpu_run.sh fp8attn`, f331708,
    median of 3): batch 64 / 2k 0.105 ms (1 split) against 0.115 for three stages' best (4 splits); 16 / 8k 0.104
    (2 splits) against 0.110. fp32 (ieee dots) and wider heads: 32-token tiles on 8 warps, which is what avoids
    register spills."""
    if interpreting():
        return 32, 4, 1
    if dtype == torch.float32 or head_dim > 128:
        return 32, 8, 2
    return (128, 4, 5) if fp8_cache else (64, 4, 3)


SPLIT_CHOICES = (1, 2, 4, 8, 16, 32, 64)  # every value default_num_splits can return


def default_num_splits(batch: int, num_kv_heads: int, max_blocks: int, device: torch.device,
                       fp8_cache: bool = False) -> int:
    """Splits per sequence from shapes only (CUDA-graph safe): enough programs to fill every SM (programs_per_sm),
    no more splits than table blocks, at most 64. Always a power of two (SPLIT_CHOICES): the count is a constexpr,
    so steps of any shape compile one of seven variants, which start-up compiles (engine.runner.warmup) instead of
    the first requests."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return num_splits_for(batch, num_kv_heads, max_blocks, sms, fp8_cache)


def programs_per_sm(fp8_cache: bool) -> int:
    """The programs a split count aims for per SM: ~2, what fits a SM at once (registers) for either cache. On an
    H200 (`bash benchmarks/gpu_run.sh fp8attn`): a bf16 cache at batch 64 / 2k context 1 split, 0.137 ms against
    0.149 with 4 splits; 16 / 8k: 4 splits, 0.140 against 0.150 with 16 (2026-12-02); an fp8 cache on its five
    stages (f331708) 64 / 2k: 1 split 0.105 ms, 2 splits 0.117, 4 0.119; 16 / 8k: 2 splits 0.104, 1 split 0.133,
    4 0.108-0.160 (noisy)."""
    return 2


def num_splits_for(batch: int, num_kv_heads: int, max_blocks: int, sms: int, fp8_cache: bool = False) -> int:
    """default_num_splits on a device of `sms` streaming multiprocessors. A bf16 cache rounds the splits that fill
    every SM up to a power of two; an fp8 cache rounds down (16 / 8k on an H200: 2 splits, not 4), as its two tiles
    in flight a program already keep HBM busy."""
    fill = programs_per_sm(fp8_cache) * sms / max(batch * num_kv_heads, 1)
    want = 1 << max(int(fill).bit_length() - 1, 0) if fp8_cache else triton.next_power_of_2(math.ceil(fill))
    cap = min(max(max_blocks, 1), SPLIT_CHOICES[-1])
    return min(want, 1 << (cap.bit_length() - 1))


def decode_attention(q: torch.Tensor,             # [B, H, D]
                     kv_layer: torch.Tensor,      # [NB, 2, bs, KVH, D], strided layer view
                     block_tables: torch.Tensor,  # [B, max_blocks] int32
                     context_lens: torch.Tensor,  # [B] int32, 0 = padding row
                     scale: float, sliding_window: int | None = None,
                     num_splits: int | None = None, out: torch.Tensor | None = None,
                     semaphores: torch.Tensor | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0, launch: tuple[int, int, int] | None = None) -> torch.Tensor:  # [B, H, D]
    """Attention of each sequence's one new token (already in the cache) over its context; q's dtype out.
    `semaphores` [>= B, KVH] int32, all zero, is the splits' meeting point; the kernel leaves it zero again, so a
    caller can keep one (a CUDA graph's static buffer) instead of a fresh zeroed one per call. kv_layer holds q's
    dtype, or fp8 K / k_scale and V / v_scale (other caches ignore the scales). `launch` (BLOCK_N, num_warps,
    num_stages) overrides _launch_config (benchmarks time several)."""
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
    splits = num_splits or default_num_splits(batch, num_kv_heads, block_tables.shape[1], dev, fp8_cache)
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n, num_warps, num_stages = launch or _launch_config(q.dtype, head_dim, fp8_cache)
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
    _decode_split_kernel[(num_kv_heads, splits, batch)](
        q, kv_layer, block_tables, context_lens, part_out, part_lse, semaphores, out,
        q.stride(0), q.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        scale * k_scale * LOG2E, v_scale,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, BLOCK_G=max(16, merge_g),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        NUM_SPLITS=splits, MIN_SPLIT_BLOCKS=max(1, block_n // block_size), MERGE_G=merge_g,
        MERGE_S=max(1, min(triton.next_power_of_2(splits), MERGE_TILE // (merge_g * block_d))),
        WINDOW=sliding_window or 0, DOT_F32=dot_f32,
        WIDEN_F16=not dot_f32 and kv_layer.dtype == torch.float8_e4m3fn,
        num_warps=num_warps, num_stages=num_stages, **(NO_PDL if _shuns_pdl(num_stages) else pdl_args(dev, batch)),
    )
    return out


def _shuns_pdl(num_stages: int) -> bool:
    """Whether a launch of this many stages goes without programmatic dependent launch, which at <= 16 rows starts
    its programs early, where they wait. The five-stage build (an fp8 cache) holds ~73 KiB of shared memory a
    program: waiting early, it took a decode step of FP8 weights and fp8 KV at batch 16 / 8k context from 6.04 to
    7.01 ms on an H200 (`gpu_run.sh pdl`, 6caf790)."""
    return num_stages >= 5
