"""The gate/up projection of an FP8 decode step on FP8 tensor cores with SwiGLU in its epilogue, then the
quantization down_proj takes: two launches where fp8_mm and engine.kernels.fp8_quant's silu_mul_quant take three.

Owns `fp8_mm_swiglu_quant`: for the rows engine.kernels.fp8_gemm's fp8_mm takes (engine.model.fp8_linear: more than
GEMV_ROWS, at most MM_ROWS), gate_up = x_q @ w_q^T scaled (+ bias) and rounded exactly as fp8_mm rounds it, but a
program's BLOCK_N weight rows are BLOCK_N / 2 gate rows and the up rows of the same columns, so it applies SwiGLU
(engine.kernels.silu_mul's numerics) to its tile and writes h = silu(gate) * up [M, I] (half the bytes of gate_up)
with each token's largest |h| of the tile. The second launch takes a row's scale from those maxima and quantizes h:
the bytes of silu_mul_quant (its two launches re-read gate_up, the first only for the maxima), bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import check, interpreting
from engine.kernels.fp8_gemm import check_mm_args, meet_splits, mm_accumulate, mm_config, split_k_args
from engine.kernels.fp8_quant import MIN_SCALE, SPLIT_CHUNK, scale_from_maxima, store_quantized_chunk, swiglu
from engine.kernels.pdl import dependents_may_start, pdl_args, wait_for_inputs

FP8 = torch.float8_e4m3fn


@triton.jit
def _fp8_mm_swiglu_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, h_ptr, amax_ptr, part_ptr, sem_ptr, M, K, K_SPLIT,
                          INTER, stride_xm, stride_wn, stride_hm, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                          DOT_F32: tl.constexpr, PDL: tl.constexpr, PDL_LATE: tl.constexpr = False):
    # Grid (cdiv(I, BLOCK_N / 2), cdiv(M, BLOCK_M), SPLIT_K): program (p, t, s) sums gate rows p * BLOCK_N / 2 on
    # (BLOCK_N / 2 of them) and the up rows I further, for tokens t's tile, as fp8_mm sums a tile (split K alike)
    wait_for_inputs(PDL, PDL_LATE)
    PAIRS: tl.constexpr = BLOCK_N // 2
    first = tl.program_id(0) * PAIRS
    r = tl.arange(0, BLOCK_N)
    cols = first + r % PAIRS  # [BLOCK_N]: the output columns of the tile's gate rows, then of its up rows
    offs_n = (r // PAIRS) * INTER + cols
    n_mask = cols < INTER
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    acc = mm_accumulate(x_ptr, w_ptr, offs_n, n_mask, offs_m, m_mask, K, K_SPLIT, stride_xm, stride_wn, 0,
                        BLOCK_N, BLOCK_M, BLOCK_K, DOT_F32, False)
    dependents_may_start(PDL, PDL_LATE)
    if SPLIT_K == 1:
        _swiglu_epilogue(acc, xs_ptr, ws_ptr, bias_ptr, h_ptr, amax_ptr, offs_n, n_mask, offs_m, m_mask, first,
                         INTER, stride_hm, PAIRS, BLOCK_M, HAS_BIAS)
    else:
        total, last = meet_splits(acc, part_ptr, sem_ptr, SPLIT_K, BLOCK_N, BLOCK_M)
        if last:
            _swiglu_epilogue(total, xs_ptr, ws_ptr, bias_ptr, h_ptr, amax_ptr, offs_n, n_mask, offs_m, m_mask,
                             first, INTER, stride_hm, PAIRS, BLOCK_M, HAS_BIAS)


@triton.jit
def _swiglu_epilogue(acc, xs_ptr, ws_ptr, bias_ptr, h_ptr, amax_ptr, offs_n, n_mask, offs_m, m_mask, first, INTER,
                     stride_hm, PAIRS: tl.constexpr, BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr):
    # acc [2 PAIRS, BLOCK_M] scaled (+ bias) and rounded as fp8_mm's epilogue rounds gate_up, then h = silu(gate) *
    # up [PAIRS, BLOCK_M] written to h^T's columns and its per-token max |h| to amax [M, programs along I]
    DTYPE: tl.constexpr = h_ptr.dtype.element_ty
    ws = tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)
    acc = acc * ws[:, None] * tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    gate, up = tl.split(tl.permute(tl.reshape(acc.to(DTYPE).to(tl.float32), [2, PAIRS, BLOCK_M]), (1, 2, 0)))
    cols = first + tl.arange(0, PAIRS)
    h = tl.where((cols < INTER)[:, None], swiglu(gate, up, DTYPE), 0.0)  # [PAIRS, BLOCK_M]; silu(0) * 0 past I
    tl.store(h_ptr + offs_m[None, :] * stride_hm + cols[:, None], h.to(DTYPE),
             mask=(cols < INTER)[:, None] & m_mask[None, :])
    tl.store(amax_ptr + offs_m * tl.num_programs(0) + tl.program_id(0), tl.max(tl.abs(h), axis=0), mask=m_mask)


@triton.jit
def _quant_by_maxima_kernel(h_ptr, amax_ptr, q_ptr, s_ptr, static_ptr, stride_h, stride_q, N, PARTS,
                            CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, STATIC: tl.constexpr, MIN: tl.constexpr,
                            PDL: tl.constexpr, PDL_LATE: tl.constexpr = False):
    # Grid (M, cdiv(N, CHUNK)): the row's scale from its PARTS maxima (or the static one), then this chunk of h
    # quantized; chunk 0 writes the scale
    wait_for_inputs(PDL, PDL_LATE)
    dependents_may_start(PDL, PDL_LATE)  # one short pass: no loop to wait for
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    scale = scale_from_maxima(amax_ptr, row, PARTS, BLOCK_P, static_ptr, STATIC, MIN)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < N
    h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    store_quantized_chunk(q_ptr, s_ptr, row, stride_q, cols, mask, h, scale, chunk)


def fp8_mm_swiglu_quant(x: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor, w_scales: torch.Tensor,
                        bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
                        out_dtype: torch.dtype = torch.bfloat16, semaphores: torch.Tensor | None = None,
                        config: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, hidden] e4m3 with x_scales [M, 1] @ weight [2I, hidden] e4m3 ([gate; up]) ^T with w_scales [1, 2I]
    (+ bias) -> silu(gate) * up quantized for down_proj: (h_q [M, I] e4m3, scales [M, 1] float32), per row or with
    the static `input_scale` [1]. Equal, bit for bit, to fp8_gemm.fp8_mm(..., out_dtype) then
    fp8_quant.silu_mul_quant; `semaphores` as fp8_mm's; `config` (BLOCK_N, BLOCK_M, BLOCK_K, num_warps, num_stages,
    SPLIT_K) overrides fp8_gemm.mm_config's (its tiles are even)."""
    m, n, hidden = check_mm_args(x, x_scales, weight, w_scales, bias, out_dtype)
    if x.dtype != FP8:
        raise ValueError(f"x must be float8_e4m3fn (with its x_scales), got {x.dtype}")
    if n % 2:
        raise ValueError(f"weight must be [gate; up] with an even row count, got {tuple(weight.shape)}")
    if input_scale is not None:
        check("input_scale", input_scale, 1, (torch.float32,), x.device)
        if input_scale.numel() != 1:
            raise ValueError(f"input_scale must hold one number, got shape {tuple(input_scale.shape)}")
    inter = n // 2
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    block_n, block_m, block_k, warps, stages, split_k = config or mm_config(m, n, hidden, sms)
    if block_n % 2:
        raise ValueError(f"BLOCK_N must be even (gate rows and their up rows), got {block_n}")
    q = torch.empty((m, inter), dtype=FP8, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0 or inter == 0:
        return q, scales
    h = torch.empty((m, inter), dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(inter, block_n // 2), triton.cdiv(m, block_m), split_k)
    amax = torch.empty((m, grid[0]), dtype=torch.float32, device=x.device)
    k_split, part, sems = split_k_args(hidden, grid, block_n, block_m, block_k, semaphores, h)
    _fp8_mm_swiglu_kernel[grid](
        x, x_scales, weight, w_scales, bias if bias is not None else w_scales, h, amax, part, sems, m, hidden,
        k_split, inter, x.stride(0), weight.stride(0), h.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n,
        BLOCK_M=block_m, BLOCK_K=block_k, SPLIT_K=split_k, DOT_F32=interpreting(), num_warps=warps,
        num_stages=stages, **pdl_args(x.device, m, late=True))
    chunk = min(SPLIT_CHUNK, triton.next_power_of_2(inter))
    _quant_by_maxima_kernel[(m, triton.cdiv(inter, chunk))](
        h, amax, q, scales, input_scale if input_scale is not None else scales, h.stride(0), q.stride(0), inter,
        grid[0], CHUNK=chunk, BLOCK_P=triton.next_power_of_2(grid[0]), STATIC=input_scale is not None,
        MIN=MIN_SCALE, num_warps=min(16, max(1, chunk // 512)), **pdl_args(x.device, m, late=True))
    return q, scales
