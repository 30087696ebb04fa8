"""SwiGLU activation on a fused gate_up projection: silu(gate) * up (the Triton twin of the MLP's
`F.silu(gate_proj(x)) * up_proj(x)` in engine.model).

gate_up [T, 2 * I] holds gate in its first half and up in its second (a fused [gate; up] weight's output).
Numerics copy torch's two ops: silu computed in fp32 and rounded to the dtype, then the product computed in fp32
and rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import check
from engine.kernels.pdl import dependents_may_start, pdl_args, wait_for_inputs

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 1024  # elements of one row per program: 8 per thread at 4 warps, 16-byte vectors in bf16


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr, PDL_LATE: tl.constexpr = False):
    # Grid (T, cdiv(INTER, BLOCK)): each program reads BLOCK gate values and the BLOCK up values INTER columns later
    # in the same row and writes BLOCK outputs; purely bandwidth-bound, so the tile only has to be wide and contiguous.
    wait_for_inputs(PDL, PDL_LATE)
    DTYPE = out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    dependents_may_start(PDL, PDL_LATE)
    tl.store(out_ptr + row * stride_o + cols, swiglu(g, u, DTYPE), mask=mask)


@triton.jit
def swiglu(g, u, DTYPE: tl.constexpr):
    # silu(g) * u as torch's two ops round it (module docstring), from gate and up values already in DTYPE (held as
    # fp32); shared with the gated GEMVs (engine.kernels.skinny_gemm, fp8_gemm), which hand their sums rounded to DTYPE
    s = (g / (1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)
    return (s * u).to(DTYPE)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2 * I] -> out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:] in gate_up's dtype (`out` is
    allocated if None)."""
    check("gate_up", gate_up, 2, DTYPES, inner_contiguous=True)
    t, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError(f"gate_up's last dimension must be even (gate then up), got {two_i}")
    i = two_i // 2
    if out is None:
        out = torch.empty((t, i), dtype=gate_up.dtype, device=gate_up.device)
    else:
        check("out", out, 2, (gate_up.dtype,), gate_up.device, inner_contiguous=True)
        if tuple(out.shape) != (t, i):
            raise ValueError(f"out must be [{t}, {i}], got {tuple(out.shape)}")
    if t > 0 and i > 0:
        block = min(BLOCK, triton.next_power_of_2(i))
        _silu_mul_kernel[(t, triton.cdiv(i, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), INTER=i, BLOCK=block, num_warps=4,
            **pdl_args(gate_up.device, t),
        )
    return out
