"""Quantizing activations to float8 e4m3 for FP8 linears (engine.model.fp8_linear), in the pass that makes them.

An FP8 linear multiplies e4m3 activations by e4m3 weights; the activations x [T, K] are quantized per row
("dynamic": scale = max(|x_row|) / 448, at least MIN_SCALE) or with the checkpoint's per-tensor `input_scale`
("static"), x_q = round_e4m3(x / scale), exactly as engine.model.fp8_linear.quantize_rows does in torch (the
division and the rounding are the same float32 operations: the results are bit for bit torch's). Three kernels,
each one pass over the activations, so quantizing costs no extra trip through device memory:
- `quantize_rows`: the rows as they are (the attention output before o_proj);
- `rms_norm_quant`: engine.kernels.rms_norm's RMSNorm (with its residual add), its bf16-rounded output quantized
  (before q/k/v and gate/up);
- `silu_mul_quant`: engine.kernels.silu_mul's SwiGLU, quantized (before down_proj); for a decode step's few rows
  a row is spread over many programs in two launches (its chunks' maxima, then the quantized chunks), since one
  program a row left the GPU nearly idle (8.4 us a layer at one row on an H200).
Each returns (x_q [T, K] float8_e4m3fn, scales [T, 1] float32). The device functions of a row's scale and of the
SwiGLU (row_scale, scale_from_maxima, swiglu, store_quantized_chunk) are shared with engine.kernels.fp8_mm_swiglu,
whose second launch quantizes like silu_mul_quant's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import check
from engine.kernels.e4m3 import FP8_MAX, to_e4m3
from engine.kernels.pdl import dependents_may_start, pdl_args, wait_for_inputs
from engine.kernels.rms_norm import DTYPES, MAX_N, check_norm_args, rms_norm_row

FP8 = torch.float8_e4m3fn
MIN_SCALE = 1.0 / (448.0 * 512.0)  # engine.model.fp8_linear.MIN_SCALE: a row of zeros still gets a finite scale
CHUNK = 4096  # silu_mul_quant: elements of one row per loop iteration
# silu_mul_quant: up to this many rows, each row is spread over many programs (two launches); one program a row
# left 68 of an H100's 132 SMs idle at 64 rows: the FP8 + fp8 KV step at batch 64 / 2k took 7.486 ms with 16 here,
# 7.410 with 64 (`STEPAB_ARGS="--only fp8 --set engine.kernels.fp8_quant.SPLIT_ROWS=64"`, 2026-12-06); more rows
# were not timed
SPLIT_ROWS = 64
SPLIT_CHUNK = 1024  # ... of this many elements each


@triton.jit
def row_scale(amax, static_ptr, STATIC: tl.constexpr, MIN: tl.constexpr):
    # the row's scale: the stored per-tensor one (static), or amax / 448 (dynamic), never below MIN
    if STATIC:
        return tl.load(static_ptr).to(tl.float32)
    else:
        return tl.maximum(amax / FP8_MAX, MIN)


@triton.jit
def scale_from_maxima(amax_ptr, row, PARTS, BLOCK_P: tl.constexpr, static_ptr, STATIC: tl.constexpr,
                      MIN: tl.constexpr):
    # a row's scale (row_scale) from its PARTS partial maxima amax [rows, PARTS], or the static one
    amax = 0.0
    if not STATIC:
        parts = tl.arange(0, BLOCK_P)
        amax = tl.max(tl.load(amax_ptr + row * PARTS + parts, mask=parts < PARTS, other=0.0), axis=0)
    return row_scale(amax, static_ptr, STATIC, MIN)


@triton.jit
def store_quantized_chunk(q_ptr, s_ptr, row, stride_q, cols, mask, h, scale, chunk):
    # h [CHUNK] float32 of the row's chunk at `cols` quantized by `scale`; chunk 0 also writes the scale
    tl.store(q_ptr + row * stride_q + cols, to_e4m3(h / scale), mask=mask)
    if chunk == 0:
        tl.store(s_ptr + row, scale)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, static_ptr, stride_x, stride_q, N: tl.constexpr,
                       BLOCK_N: tl.constexpr, STATIC: tl.constexpr, MIN: tl.constexpr, PDL: tl.constexpr,
                       PDL_LATE: tl.constexpr = False):
    # Grid (T,): one program per row, the row one tile (N <= MAX_N)
    wait_for_inputs(PDL, PDL_LATE)
    dependents_may_start(PDL, PDL_LATE)  # one short pass: no loop to wait for
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = row_scale(tl.max(tl.abs(x), axis=0), static_ptr, STATIC, MIN)
    tl.store(q_ptr + row * stride_q + cols, to_e4m3(x / scale), mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def _rms_norm_quant_kernel(x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, static_ptr, stride_x, stride_r, stride_q, eps,
                           N: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                           STATIC: tl.constexpr, MIN: tl.constexpr, PDL: tl.constexpr,
                           PDL_LATE: tl.constexpr = False):
    # Grid (T,): engine.kernels.rms_norm's row (the same rounding steps), then quantized in registers
    wait_for_inputs(PDL, PDL_LATE)
    dependents_may_start(PDL, PDL_LATE)  # one short pass: no loop to wait for
    row = tl.program_id(0).to(tl.int64)
    y, mask = rms_norm_row(x_ptr, r_ptr, w_ptr, row, stride_x, stride_r, eps, N, BLOCK_N, HAS_RESIDUAL)
    y = y.to(tl.float32)  # the normed row as the bf16 model has it
    scale = row_scale(tl.max(tl.abs(y), axis=0), static_ptr, STATIC, MIN)
    tl.store(q_ptr + row * stride_q + tl.arange(0, BLOCK_N), to_e4m3(y / scale), mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def swiglu(g, u, DTYPE: tl.constexpr):
    # engine.kernels.silu_mul's numerics: silu in fp32 rounded to the dtype, times up, rounded again
    s = (g / (1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)
    return (s * u).to(DTYPE).to(tl.float32)


@triton.jit
def _silu_mul_quant_kernel(gu_ptr, q_ptr, s_ptr, static_ptr, stride_gu, stride_q, INTER: tl.constexpr,
                           CHUNK: tl.constexpr, STATIC: tl.constexpr, MIN: tl.constexpr, PDL: tl.constexpr,
                           PDL_LATE: tl.constexpr = False):
    # Grid (T,): one program per row in two sweeps of CHUNK columns: the row's amax, then the quantized values (the
    # second sweep re-reads the row from L2: a row is 2 x INTER values, tens of KiB)
    wait_for_inputs(PDL, PDL_LATE)
    DTYPE = gu_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    base = gu_ptr + row * stride_gu
    amax = 0.0
    if not STATIC:
        for c0 in range(0, INTER, CHUNK):
            cols = c0 + tl.arange(0, CHUNK)
            mask = cols < INTER
            g = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(base + INTER + cols, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(swiglu(g, u, DTYPE)), axis=0))
    scale = row_scale(amax, static_ptr, STATIC, MIN)
    dependents_may_start(PDL, PDL_LATE)  # the first sweep read the row from HBM; the second finds it in L2
    for c0 in range(0, INTER, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        mask = cols < INTER
        g = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(base + INTER + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_q + cols, to_e4m3(swiglu(g, u, DTYPE) / scale), mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def _silu_chunk(gu_ptr, row, stride_gu, c0, INTER: tl.constexpr, CHUNK: tl.constexpr, DTYPE: tl.constexpr):
    # one chunk of a row's SwiGLU (float32 values of the dtype's rounding) and its columns' mask
    cols = c0 + tl.arange(0, CHUNK)
    mask = cols < INTER
    base = gu_ptr + row * stride_gu
    g = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(base + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    return swiglu(g, u, DTYPE), cols, mask


@triton.jit
def _silu_mul_amax_kernel(gu_ptr, amax_ptr, stride_gu, INTER: tl.constexpr, CHUNK: tl.constexpr,
                          CHUNKS: tl.constexpr, PDL: tl.constexpr, PDL_LATE: tl.constexpr = False):
    # Grid (T, CHUNKS): a few rows (a decode step) leave most SMs idle with one program a row; here each program
    # finds its chunk's max |silu(g) * u| (masked columns give silu(0) * 0 = 0), the quantizing launch the row's
    wait_for_inputs(PDL, PDL_LATE)
    dependents_may_start(PDL, PDL_LATE)  # one short pass: no loop to wait for
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    h, cols, mask = _silu_chunk(gu_ptr, row, stride_gu, chunk * CHUNK, INTER, CHUNK, gu_ptr.dtype.element_ty)
    tl.store(amax_ptr + row * CHUNKS + chunk, tl.max(tl.abs(h), axis=0))


@triton.jit
def _silu_mul_quant_split_kernel(gu_ptr, amax_ptr, q_ptr, s_ptr, static_ptr, stride_gu, stride_q,
                                 INTER: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                                 BLOCK_C: tl.constexpr, STATIC: tl.constexpr, MIN: tl.constexpr, PDL: tl.constexpr,
                                 PDL_LATE: tl.constexpr = False):
    # Grid (T, CHUNKS): the row's scale from its chunks' maxima, then this chunk quantized (SwiGLU recomputed)
    wait_for_inputs(PDL, PDL_LATE)
    dependents_may_start(PDL, PDL_LATE)  # one short pass: no loop to wait for
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    scale = scale_from_maxima(amax_ptr, row, CHUNKS, BLOCK_C, static_ptr, STATIC, MIN)
    h, cols, mask = _silu_chunk(gu_ptr, row, stride_gu, chunk * CHUNK, INTER, CHUNK, gu_ptr.dtype.element_ty)
    store_quantized_chunk(q_ptr, s_ptr, row, stride_q, cols, mask, h, scale, chunk)


def _outputs(t: int, k: int, device: torch.device, input_scale: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if input_scale is not None:
        check("input_scale", input_scale, 1, (torch.float32,), device)
        if input_scale.numel() != 1:
            raise ValueError(f"input_scale must hold one number, got shape {tuple(input_scale.shape)}")
    q = torch.empty((t, k), dtype=FP8, device=device)
    scales = torch.empty((t, 1), dtype=torch.float32, device=device)
    return q, scales, input_scale if input_scale is not None else scales  # an unused pointer when dynamic


def _warps(block: int) -> int:
    return min(16, max(1, block // 512))


def quantize_rows(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (x_q [T, K] e4m3, scales [T, 1] float32) with x ~= x_q * scales: per row, or with the static
    `input_scale` [1] float32."""
    check("x", x, 2, DTYPES, inner_contiguous=True)
    t, k = x.shape
    if not 0 < k <= MAX_N:
        raise ValueError(f"x's row length must be in [1, {MAX_N}], got {k}")
    q, scales, static = _outputs(t, k, x.device, input_scale)
    if t > 0:
        block = triton.next_power_of_2(k)
        _quant_rows_kernel[(t,)](x, q, scales, static, x.stride(0), q.stride(0), N=k, BLOCK_N=block,
                                 STATIC=input_scale is not None, MIN=MIN_SCALE, num_warps=_warps(block),
                                 **pdl_args(x.device, t, late=True))
    return q, scales


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                   input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """engine.kernels.rms_norm.rms_norm(x, weight, eps, residual), its output quantized: (x_q [T, N] e4m3,
    scales [T, 1] float32). With `residual` [T, N], x + residual is written into it in place first."""
    t, n = check_norm_args(x, weight, eps, residual)
    q, scales, static = _outputs(t, n, x.device, input_scale)
    if t > 0:
        block = triton.next_power_of_2(n)
        r = residual if residual is not None else x
        _rms_norm_quant_kernel[(t,)](x, r, weight, q, scales, static, x.stride(0), r.stride(0), q.stride(0),
                                     float(eps), N=n, BLOCK_N=block, HAS_RESIDUAL=residual is not None,
                                     STATIC=input_scale is not None, MIN=MIN_SCALE, num_warps=_warps(block),
                                     **pdl_args(x.device, t, late=True))
    return q, scales


def silu_mul_quant(gate_up: torch.Tensor, input_scale: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """engine.kernels.silu_mul.silu_and_mul(gate_up) quantized: gate_up [T, 2I] -> (x_q [T, I] e4m3, scales [T, 1])."""
    check("gate_up", gate_up, 2, DTYPES, inner_contiguous=True)
    t, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError(f"gate_up's last dimension must be even (gate then up), got {two_i}")
    inter = two_i // 2
    q, scales, static = _outputs(t, inter, gate_up.device, input_scale)
    if 0 < t <= SPLIT_ROWS and inter > 0:
        chunk = min(SPLIT_CHUNK, triton.next_power_of_2(inter))
        chunks = triton.cdiv(inter, chunk)
        amax = torch.empty((t, chunks), dtype=torch.float32, device=gate_up.device)
        if input_scale is None:
            _silu_mul_amax_kernel[(t, chunks)](gate_up, amax, gate_up.stride(0), INTER=inter, CHUNK=chunk,
                                               CHUNKS=chunks, num_warps=_warps(chunk),
                                               **pdl_args(gate_up.device, t, late=True))
        _silu_mul_quant_split_kernel[(t, chunks)](
            gate_up, amax, q, scales, static, gate_up.stride(0), q.stride(0), INTER=inter, CHUNK=chunk,
            CHUNKS=chunks, BLOCK_C=triton.next_power_of_2(chunks), STATIC=input_scale is not None, MIN=MIN_SCALE,
            num_warps=_warps(chunk), **pdl_args(gate_up.device, t, late=True))
    elif t > 0 and inter > 0:
        chunk = min(CHUNK, triton.next_power_of_2(inter))
        _silu_mul_quant_kernel[(t,)](gate_up, q, scales, static, gate_up.stride(0), q.stride(0), INTER=inter,
                                     CHUNK=chunk, STATIC=input_scale is not None, MIN=MIN_SCALE,
                                     num_warps=_warps(chunk), **pdl_args(gate_up.device, t, late=True))
    return q, scales
