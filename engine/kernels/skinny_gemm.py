"""y = x @ W^T (+ bias) for a few rows of x: the projections of a small decode batch, as a Triton GEMV.

With M <= MAX_M rows (decode at batch 1-8), a projection only streams its weight matrix once; cuBLAS serves such
shapes with split-K kernels plus a separate reduction, and a SwiGLU before the down projection would be one more
launch. Here one kernel reads each weight byte once, and can compute its input on the fly from a fused gate_up
projection's output (`silu_mul_input`), numerically as engine.kernels.silu_mul does, so the MLP's activation needs
no kernel and no intermediate tensor of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import check, interpreting

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_M = 16


# Grid (cdiv(N, BLOCK_N),): one program owns BLOCK_N output columns (rows of W) for all M rows of x and walks the
# K dimension BLOCK_K at a time, K contiguous (16-byte loads; evicted first from L2 since nothing reads W again).
# A decode GEMV is bound by how many bytes are in flight, not by arithmetic: tiles are wide (thousands of elements,
# dozens per thread, often the whole row in one iteration), so each program issues all its loads before it waits,
# and thousands of small programs keep every SM's memory pipe full, with no split-K and no second kernel. Each of
# the M input rows (tiny, served from L2) is multiplied with the tile and reduced along K into column m of the
# [BLOCK_M, BLOCK_N] fp32 accumulator. With SILU_MUL, x is gate_up [M, 2K] and the input is
# round(round(silu(gate)) * up), rounded to the activation dtype as the torch MLP does.
@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    DTYPE = y_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32)  # [BLOCK_N, BLOCK_K]
        for m in tl.static_range(BLOCK_M):
            x_row = x_ptr + tl.minimum(m, M - 1) * stride_xm  # rows past M repeat the last; never stored
            if SILU_MUL:
                g = tl.load(x_row + ks, mask=k_mask, other=0.0).to(tl.float32)
                u = tl.load(x_row + K + ks, mask=k_mask, other=0.0).to(tl.float32)
                s = (g / (1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)
                x = (s * u).to(DTYPE).to(tl.float32)  # [BLOCK_K]
            else:
                x = tl.load(x_row + ks, mask=k_mask, other=0.0).to(tl.float32)
            part = tl.sum(w * x[None, :], axis=1)  # [BLOCK_N]
            acc = tl.where(offs_m[:, None] == m, acc + part[None, :], acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(DTYPE),
             mask=(offs_m < M)[:, None] & n_mask[None, :])


def _launch_config(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) from shapes alone (CUDA-graph safe). On a GPU: up to 4096 elements of K a
    tile and about 8192 elements in all (64 a thread at 4 warps). Interpreted: small tiles (the interpreter's cost
    grows with tile size)."""
    if interpreting():
        return 16, 64, 4
    block_k = min(triton.next_power_of_2(k), 4096)
    return max(1, 8192 // block_k), block_k, 4


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  silu_mul_input: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, M <= MAX_M. With `silu_mul_input`, x is a
    fused gate_up output [M, 2K] and the input is silu(gate) * up. `out` [M, N] is allocated if None."""
    check("x", x, 2, DTYPES, inner_contiguous=True)
    dev = x.device
    if dev.type != "cuda" and not interpreting():
        raise ValueError(f"x must be on a CUDA device (or run under TRITON_INTERPRET=1), got {dev}")
    check("weight", weight, 2, (x.dtype,), dev, inner_contiguous=True)
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    if not 0 <= m <= MAX_M:
        raise ValueError(f"x must have at most {MAX_M} rows, got {m}")
    want_k = 2 * k if silu_mul_input else k
    if x.shape[1] != want_k:
        what = "2 x weight's in-features (gate then up)" if silu_mul_input else "weight's in-features"
        raise ValueError(f"x must have {want_k} columns ({what}), got {x.shape[1]}")
    if bias is not None:
        check("bias", bias, 1, (x.dtype,), dev, inner_contiguous=True)
        if bias.shape[0] != n:
            raise ValueError(f"bias must have {n} entries (weight's out-features), got {bias.shape[0]}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=dev)
    else:
        check("out", out, 2, (x.dtype,), dev, inner_contiguous=True)
        if tuple(out.shape) != (m, n):
            raise ValueError(f"out must be [{m}, {n}], got {tuple(out.shape)}")
    if m == 0 or n == 0:
        return out
    block_n, block_k, num_warps = _launch_config(m, n, k)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul_input,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
    )
    return out
