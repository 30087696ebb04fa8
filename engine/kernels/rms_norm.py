"""RMSNorm over the last dimension, optionally fused with the residual add before it (the Triton twin of
engine.model.RMSNorm, plus the `x + sublayer(x)` of the decoder layer).

Numerics copy the torch model: h = x + residual rounded to x's dtype (the model adds in bf16), normed in fp32
(h * rsqrt(mean(h^2) + eps)), rounded to the dtype, then multiplied by the weight and rounded again (torch's
`weight * h.to(dtype)`). Only the order of the fp32 sum of squares differs from torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import check
from engine.kernels.pdl import dependents_may_start, pdl_args, wait_for_inputs

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_N = 65536  # one row is one register tile; wider rows would spill (models use N <= 8192)


@triton.jit
def rms_norm_row(x_ptr, r_ptr, w_ptr, row, stride_x, stride_r, eps,
                 N: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    # One row, the whole row one tile of next_power_of_2(N) (N <= 8192 in practice, i.e. at most 32 fp32 values per
    # thread at 8 warps), so x is read once and nothing is recomputed. With a residual the rounded sum is written back
    # into the residual stream before it is normed. Returns the normed row in x's dtype [BLOCK_N] and its mask.
    # Shared with engine.kernels.fp8_quant (the same row, then quantized).
    DTYPE = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(DTYPE)
        tl.store(r_ptr + row * stride_r + cols, h, mask=mask)
    h = h.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(h * h, axis=0) / N + eps)
    normed = (h * rstd).to(DTYPE).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return (w * normed).to(DTYPE), mask


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr,
    stride_x, stride_r, stride_o, eps,
    N: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr, PDL_LATE: tl.constexpr = False,
):
    # Grid (T,): one program per row (rms_norm_row)
    wait_for_inputs(PDL, PDL_LATE)
    dependents_may_start(PDL, PDL_LATE)  # one short pass: no loop to wait for
    row = tl.program_id(0).to(tl.int64)
    y, mask = rms_norm_row(x_ptr, r_ptr, w_ptr, row, stride_x, stride_r, eps, N, BLOCK_N, HAS_RESIDUAL)
    tl.store(out_ptr + row * stride_o + tl.arange(0, BLOCK_N), y, mask=mask)


def check_norm_args(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
                    ) -> tuple[int, int]:
    """(T, N) of x [T, N]; ValueError naming the argument unless weight [N] and residual [T, N] (or None) match it
    and eps >= 0. Shared with engine.kernels.fp8_quant.rms_norm_quant."""
    check("x", x, 2, DTYPES, inner_contiguous=True)
    t, n = x.shape
    if not 0 < n <= MAX_N:
        raise ValueError(f"x's row length must be in [1, {MAX_N}], got {n}")
    check("weight", weight, 1, (x.dtype,), x.device, inner_contiguous=True)
    if weight.shape[0] != n:
        raise ValueError(f"weight must have {n} entries (x's row length), got {weight.shape[0]}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if residual is not None:
        check("residual", residual, 2, (x.dtype,), x.device, inner_contiguous=True)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    return t, n


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [T, N], weight [N] (x's dtype). Without residual: returns weight * norm(x) [T, N]. With residual [T, N]:
    h = x + residual (in x's dtype) is written into `residual` in place and (weight * norm(h), residual) is
    returned. `out` [T, N] receives the normed rows (allocated if None; it may be x itself)."""
    t, n = check_norm_args(x, weight, eps, residual)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        check("out", out, 2, (x.dtype,), x.device, inner_contiguous=True)
        if out.shape != x.shape:
            raise ValueError(f"out must have x's shape {tuple(x.shape)}, got {tuple(out.shape)}")
        if residual is not None and out.data_ptr() == residual.data_ptr():
            raise ValueError("out must not be residual (residual receives x + residual, out the normed rows)")
    if t > 0:
        block_n = triton.next_power_of_2(n)
        r = residual if residual is not None else x  # an unused pointer when there is no residual
        _rms_norm_kernel[(t,)](
            x, r, weight, out,
            x.stride(0), r.stride(0), out.stride(0), float(eps),
            N=n, BLOCK_N=block_n, HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block_n // 512)), **pdl_args(x.device, t),
        )
    return out if residual is None else (out, residual)
