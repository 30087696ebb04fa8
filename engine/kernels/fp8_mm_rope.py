"""The qkv projection of an FP8 decode step on FP8 tensor cores, with RoPE and the KV-cache store in its epilogue.

Owns `fp8_mm_rope_store`: for the rows engine.kernels.fp8_gemm's fp8_mm takes (engine.model.fp8_linear: more than
GEMV_ROWS, at most MM_ROWS), qkv = x_q @ w_q^T scaled (+ bias) exactly as fp8_mm computes and rounds it, then the q
and k heads rotated as engine.kernels.rope.rope_and_store rotates them, and every token's k and v stored into its
cache slot: one launch where fp8_mm and rope_and_store take two (~4 us a layer at 8B batch 64 and 70B batch 4 on an
H100: docs/benchmark-log.md, 2026-12-06). engine.kernels.qkv_rope does the same for the GEMV steps.

RoPE rotates column j of a head with column j + D/2, which a tile of contiguous weight rows would hold in two
programs. Here a program's BLOCK_N weight rows are BLOCK_N / 2 columns of a head's first half and their partners of
the second, so each pair is rotated where it is summed; the weight itself is stored as loaded (a row is K-contiguous
either way, so the loads cost the same).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import interpreting
from engine.kernels.fp8_gemm import (
    FP8_MM_CONFIGS,
    check_mm_args,
    meet_splits,
    mm_accumulate,
    mm_config,
    split_k_args,
)
from engine.kernels.kv_store import check_kv_args, check_scales, to_cache
from engine.kernels.pdl import dependents_may_start, pdl_args, wait_for_inputs
from engine.kernels.rope import check_rope_args, rotate_halves, round_to


@triton.jit
def _fp8_mm_rope_store_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, y_ptr, part_ptr, sem_ptr, pos_ptr, cos_ptr, sin_ptr, kv_ptr, slots_ptr,
    k_scale, v_scale, M, K, K_SPLIT, stride_xm, stride_wn, stride_ym, stride_p, stride_cb, stride_ckv, stride_cs,
    stride_ch, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_F32: tl.constexpr, PDL: tl.constexpr, PDL_LATE: tl.constexpr = False,
):
    # Grid ((H + 2 KVH) * D / BLOCK_N, cdiv(M, BLOCK_M), SPLIT_K): program (p, t, s) sums, for tokens t's tile, the
    # weight rows of head p // (D / BLOCK_N): its columns j (j from (p % (D / BLOCK_N)) * BLOCK_N / 2, BLOCK_N / 2 of
    # them) and j + D / 2, as engine.kernels.fp8_gemm's fp8_mm sums a tile (split K meets the same way).
    wait_for_inputs(PDL, PDL_LATE)
    PAIRS: tl.constexpr = BLOCK_N // 2
    HALF: tl.constexpr = D // 2
    head = tl.program_id(0) // (D // BLOCK_N)
    first = (tl.program_id(0) % (D // BLOCK_N)) * PAIRS
    r = tl.arange(0, BLOCK_N)
    offs_n = head * D + (r // PAIRS) * HALF + first + r % PAIRS  # [BLOCK_N]: the pairs' first halves, then seconds
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    acc = mm_accumulate(x_ptr, w_ptr, offs_n, r < BLOCK_N, offs_m, m_mask, K, K_SPLIT, stride_xm, stride_wn, 0,
                        BLOCK_N, BLOCK_M, BLOCK_K, DOT_F32, False)
    dependents_may_start(PDL, PDL_LATE)
    if SPLIT_K == 1:
        _rope_store_epilogue(acc, xs_ptr, ws_ptr, bias_ptr, y_ptr, pos_ptr, cos_ptr, sin_ptr, kv_ptr, slots_ptr,
                             k_scale, v_scale, offs_n, offs_m, m_mask, head, first, stride_ym, stride_p, stride_cb,
                             stride_ckv, stride_cs, stride_ch, H, KVH, HALF, PAIRS, BS, BLOCK_M, HAS_BIAS)
    else:
        total, last = meet_splits(acc, part_ptr, sem_ptr, SPLIT_K, BLOCK_N, BLOCK_M)
        if last:
            _rope_store_epilogue(total, xs_ptr, ws_ptr, bias_ptr, y_ptr, pos_ptr, cos_ptr, sin_ptr, kv_ptr,
                                 slots_ptr, k_scale, v_scale, offs_n, offs_m, m_mask, head, first, stride_ym,
                                 stride_p, stride_cb, stride_ckv, stride_cs, stride_ch, H, KVH, HALF, PAIRS, BS,
                                 BLOCK_M, HAS_BIAS)


@triton.jit
def _rope_store_epilogue(acc, xs_ptr, ws_ptr, bias_ptr, y_ptr, pos_ptr, cos_ptr, sin_ptr, kv_ptr, slots_ptr,
                         k_scale, v_scale, offs_n, offs_m, m_mask, head, first, stride_ym, stride_p, stride_cb,
                         stride_ckv, stride_cs, stride_ch, H: tl.constexpr, KVH: tl.constexpr, HALF: tl.constexpr,
                         PAIRS: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr):
    # acc [2 PAIRS, BLOCK_M] scaled (+ bias) and rounded as fp8_mm's epilogue rounds its output, the halves rotated
    # (q and k heads) with rope.py's numerics, written to y, and k / v stored at the tokens' slots (negative: not)
    DTYPE: tl.constexpr = y_ptr.dtype.element_ty
    acc = acc * tl.load(ws_ptr + offs_n)[:, None] * tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n).to(tl.float32)[:, None]
    y = round_to(acc, DTYPE)
    x1, x2 = tl.split(tl.permute(tl.reshape(y, [2, PAIRS, BLOCK_M]), (1, 2, 0)))  # [PAIRS, BLOCK_M] each
    j = first + tl.arange(0, PAIRS)  # [PAIRS]: the columns of the first half
    pos = tl.load(pos_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)  # [BLOCK_M]
    table = pos[None, :] * stride_p + j[:, None]  # [PAIRS, BLOCK_M]
    c1 = round_to(tl.load(cos_ptr + table), DTYPE)
    c2 = round_to(tl.load(cos_ptr + table + HALF), DTYPE)
    s1 = round_to(tl.load(sin_ptr + table), DTYPE)
    s2 = round_to(tl.load(sin_ptr + table + HALF), DTYPE)
    r1, r2 = rotate_halves(x1, x2, c1, s1, c2, s2, DTYPE)
    rotates = head < H + KVH  # q or k; v passes through
    o1 = tl.where(rotates, r1, x1)
    o2 = tl.where(rotates, r2, x2)
    out = y_ptr + offs_m[None, :] * stride_ym + (head * 2 * HALF + j)[:, None]
    tl.store(out, o1.to(DTYPE), mask=m_mask[None, :])
    tl.store(out + HALF, o2.to(DTYPE), mask=m_mask[None, :])

    slot = tl.load(slots_ptr + offs_m, mask=m_mask, other=-1).to(tl.int64)  # [BLOCK_M]
    token = (slot // BS) * stride_cb + ((head - H) // KVH) * stride_ckv + (slot % BS) * stride_cs \
        + ((head - H) % KVH) * stride_ch
    dst = kv_ptr + token[None, :] + j[:, None]
    # head >= H tested on a block: the interpreter mistypes (scalar mask) & (block mask)
    store = (m_mask & (slot >= 0) & ((tl.zeros([BLOCK_M], tl.int32) + head) >= H))[None, :]
    cache_scale = tl.where(head < H + KVH, k_scale, v_scale)  # an fp8 cache's (ignored by others)
    tl.store(dst, to_cache(o1.to(DTYPE), cache_scale, kv_ptr.dtype.element_ty), mask=store)
    tl.store(dst + HALF, to_cache(o2.to(DTYPE), cache_scale, kv_ptr.dtype.element_ty), mask=store)


def rope_launch(head_dim: int, m: int, n: int, k: int, sms: int) -> tuple[int, ...] | None:
    """fp8_mm's launch for these shapes (fp8_gemm.mm_config, never its wide tiles), or None where its tile does not
    divide the head into pairs."""
    config = mm_config(m, n, k, sms, wide=False)
    return config if _pairs_in_head(head_dim, config[0]) else None


def fits_head(head_dim: int) -> bool:
    """Whether every launch rope_launch may pick divides a head of `head_dim` into pairs (the tiles depend on M
    alone without wide ones); otherwise the projection and RoPE stay two launches (engine.model.decoder_layer)."""
    tiles = [16] if interpreting() else [row[1] for row in FP8_MM_CONFIGS]
    return all(_pairs_in_head(head_dim, tile) for tile in tiles)


def _pairs_in_head(head_dim: int, block_n: int) -> bool:
    # a tile of block_n weight rows holds whole pairs (j, j + D/2) of one head: an even divisor of D
    return head_dim % block_n == 0 and block_n % 2 == 0


def fp8_mm_rope_store(x: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor, w_scales: torch.Tensor,
                      bias: torch.Tensor | None, num_heads: int, num_kv_heads: int, positions: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor, slots: torch.Tensor,
                      k_scale: float = 1.0, v_scale: float = 1.0, out_dtype: torch.dtype = torch.bfloat16,
                      semaphores: torch.Tensor | None = None, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """x [M, hidden] e4m3 with x_scales [M, 1] @ weight [(H + 2 KVH) D, hidden] e4m3 ^T with w_scales [1, N] (+ bias)
    -> qkv [M, (H + 2 KVH) D] in out_dtype, q and k rotated by cos/sin [P, D] (float32) at positions [M], k and v
    stored into kv_layer [NB, 2, bs, KVH, D] at slots [M] (negative: not stored; an fp8 cache stores k / k_scale and
    v / v_scale). Equal, bit for bit, to fp8_gemm.fp8_mm then rope.rope_and_store on its q, k, v views. Raises
    ValueError where no launch fits the head (rope_launch); `semaphores` as fp8_mm's; `config` (BLOCK_N, BLOCK_M,
    BLOCK_K, num_warps, num_stages, SPLIT_K) overrides rope_launch's (tests split K where it picks none)."""
    m, n, hidden = check_mm_args(x, x_scales, weight, w_scales, bias, out_dtype)
    if x.dtype != torch.float8_e4m3fn:
        raise ValueError(f"x must be float8_e4m3fn (with its x_scales), got {x.dtype}")
    check_scales(k_scale, v_scale)
    heads = num_heads + 2 * num_kv_heads
    if n % heads:
        raise ValueError(f"weight must be [(H + 2 KVH) x D, {hidden}] with H = {num_heads}, KVH = {num_kv_heads}, "
                         f"got {tuple(weight.shape)}")
    d = n // heads
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    q, k, v = out.view(m, heads, d).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    check_rope_args(q, k, positions, cos, sin)
    check_kv_args(k, v, kv_layer, slots)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    config = config or rope_launch(d, m, n, hidden, sms)
    if config is None or d % config[0] or config[0] % 2:
        raise ValueError(f"no fp8_mm launch has an even tile that divides head_dim {d} (launch {config})")
    if m == 0:
        return out
    block_n, block_m, block_k, warps, stages, split_k = config
    grid = (n // block_n, triton.cdiv(m, block_m), split_k)
    k_split, part, sems = split_k_args(hidden, grid, block_n, block_m, block_k, semaphores, out)
    _fp8_mm_rope_store_kernel[grid](
        x, x_scales, weight, w_scales, bias if bias is not None else w_scales, out, part, sems, positions, cos, sin,
        kv_layer, slots, float(k_scale), float(v_scale), m, hidden, k_split, x.stride(0), weight.stride(0),
        out.stride(0), cos.stride(0), kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        H=num_heads, KVH=num_kv_heads, D=d, BS=kv_layer.shape[2], HAS_BIAS=bias is not None, BLOCK_N=block_n,
        BLOCK_M=block_m, BLOCK_K=block_k, SPLIT_K=split_k, DOT_F32=interpreting(), num_warps=warps,
        num_stages=stages, **pdl_args(x.device, m, late=True))
    return out
