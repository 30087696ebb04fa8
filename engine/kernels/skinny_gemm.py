"""y = x @ W^T (+ bias) for a few rows of x: the projections of a small decode batch, as a Triton GEMV.

With one or two rows (decode at batch 1-2), a projection only streams its weight matrix once, and what decides its
time is how many bytes are in flight. cuBLAS runs the qkv and o projections of a 7B-class model there at 0.6-0.8
of copy bandwidth, this kernel, with whole rows of K per tile, at 0.83-0.90
(benchmarks/design_choices.py decode-kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import check, interpreting
from engine.kernels.pdl import dependents_may_start, pdl_args, wait_for_inputs
from engine.kernels.silu_mul import swiglu

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_M = 16


# Grid (cdiv(N, BLOCK_N),): one program owns BLOCK_N output columns (rows of W) for all M rows of x and walks the
# K dimension BLOCK_K at a time, K contiguous (16-byte loads; evicted first from L2 since nothing reads W again).
# A decode GEMV is bound by how many bytes are in flight, not by arithmetic: tiles are wide (thousands of elements,
# dozens per thread, often the whole row in one iteration), so each program issues all its loads before it waits,
# and thousands of small programs keep every SM's memory pipe full, with no split-K and no second kernel. Each of
# the M input rows (tiny, served from L2) is multiplied with the tile and reduced along K into column m of the
# [BLOCK_M, BLOCK_N] fp32 accumulator. Past a few rows the per-row reductions cost more than the weight read, and
# cuBLAS's tensor-core kernels win (the model switches at engine.model.kernel_linears.SKINNY_ROWS).
@triton.jit
def gemv_tile(x_ptr, w_rows, n_mask, M, K, stride_xm,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
              PDL_LATE: tl.constexpr = False):
    # [BLOCK_M, BLOCK_N] fp32: rows 0..M-1 of x times the weight rows at `w_rows` ([BLOCK_N, 1] pointers, masked by
    # n_mask [BLOCK_N]) over K. Waits for the previous kernel (engine.kernels.pdl) itself: under PDL the first weight
    # tile is requested before the wait, so the weight stream starts while the kernel before still runs; callers
    # read nothing that kernel writes before calling this. Shared with engine.kernels.qkv_rope.
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_first = 0
    if PDL:
        w_first = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0,
                          eviction_policy="evict_first")  # [BLOCK_N, BLOCK_K]
        wait_for_inputs(PDL, PDL_LATE)
        acc = _gemv_add(acc, x_ptr, w_first.to(tl.float32), offs_k, M, K, stride_xm, BLOCK_M)
        k_first = BLOCK_K
    for k0 in range(k_first, K, BLOCK_K):
        ks = k0 + offs_k
        w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & (ks < K)[None, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32)  # [BLOCK_N, BLOCK_K]
        acc = _gemv_add(acc, x_ptr, w, ks, M, K, stride_xm, BLOCK_M)
    dependents_may_start(PDL, PDL_LATE)
    return acc


@triton.jit
def _gemv_add(acc, x_ptr, w, ks, M, K, stride_xm, BLOCK_M: tl.constexpr):
    # acc [BLOCK_M, BLOCK_N] + each x row's columns `ks` [BLOCK_K] times the weight tile w [BLOCK_N, BLOCK_K] (fp32)
    offs_m = tl.arange(0, BLOCK_M)
    k_mask = ks < K
    for m in tl.static_range(BLOCK_M):
        x_row = x_ptr + tl.minimum(m, M - 1) * stride_xm  # rows past M repeat the last; never stored
        x = tl.load(x_row + ks, mask=k_mask, other=0.0).to(tl.float32)  # [BLOCK_K]
        part = tl.sum(w * x[None, :], axis=1)  # [BLOCK_N]
        acc = tl.where(offs_m[:, None] == m, acc + part[None, :], acc)
    return acc


@triton.jit
def gemv_rows(N, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    # The weight rows [BLOCK_N] this program reads, their mask, and the output columns it writes with theirs. Plain:
    # BLOCK_N rows, one output each. GATED (a fused [gate; up] weight of 2N rows, N outputs): BLOCK_N // 2 outputs,
    # each from the gate row n and the up row N + n, read side by side (rows 2j and 2j + 1 of the tile).
    r = tl.arange(0, BLOCK_N)
    if GATED:
        n = tl.program_id(0) * (BLOCK_N // 2) + r // 2
        rows = n + (r % 2) * N
        out_n = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    else:
        rows = tl.program_id(0) * BLOCK_N + r
        n = rows
        out_n = rows
    return rows, n < N, out_n, out_n < N


@triton.jit
def gemv_store(acc, y_ptr, out_n, out_mask, M, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               GATED: tl.constexpr):
    # acc [BLOCK_M, BLOCK_N] fp32 over gemv_rows' rows -> y; GATED: silu(gate) * up of each (gate, up) pair
    DTYPE = y_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    if GATED:
        gate, up = tl.split(tl.reshape(acc.to(DTYPE).to(tl.float32), [BLOCK_M, BLOCK_N // 2, 2]))
        y = swiglu(gate, up, DTYPE)  # [BLOCK_M, BLOCK_N // 2]
    else:
        y = acc.to(DTYPE)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + out_n[None, :], y, mask=(offs_m < M)[:, None] & out_mask[None, :])


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    GATED: tl.constexpr = False, PDL_LATE: tl.constexpr = False,
):
    rows, n_mask, out_n, out_mask = gemv_rows(N, BLOCK_N, GATED)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    acc = gemv_tile(x_ptr, w_rows, n_mask, M, K, stride_xm, BLOCK_M, BLOCK_N, BLOCK_K, PDL, PDL_LATE)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    gemv_store(acc, y_ptr, out_n, out_mask, M, stride_ym, BLOCK_M, BLOCK_N, GATED)


def launch_config(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) from shapes alone (CUDA-graph safe). On a GPU: 2 weight rows of up to 4096
    elements a tile (the whole row of a 4096-wide model: one iteration), on 8 warps for one input row and 4 for
    more, the best of the H200 sweep in docs/benchmark-log.md; engine.kernels.qkv_rope takes BLOCK_K and the warps.
    Interpreted: small tiles (the interpreter's cost grows with tile size)."""
    if interpreting():
        return 16, 64, 4
    return 2, min(triton.next_power_of_2(k), 4096), 8 if m == 1 else 4


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, M <= MAX_M. `out` [M, N] is allocated if
    None. `gated`: weight is a fused [gate; up] (N even) and the result silu(gate) * up, [M, N / 2], as
    engine.kernels.silu_mul would make of the plain result (rounded alike), without that kernel's launch."""
    check("x", x, 2, DTYPES, inner_contiguous=True)
    dev = x.device
    if dev.type != "cuda" and not interpreting():
        raise ValueError(f"x must be on a CUDA device (or run under TRITON_INTERPRET=1), got {dev}")
    check("weight", weight, 2, (x.dtype,), dev, inner_contiguous=True)
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    if not 0 <= m <= MAX_M:
        raise ValueError(f"x must have at most {MAX_M} rows, got {m}")
    if x.shape[1] != k:
        raise ValueError(f"x must have {k} columns (weight's in-features), got {x.shape[1]}")
    if bias is not None:
        check("bias", bias, 1, (x.dtype,), dev, inner_contiguous=True)
        if bias.shape[0] != n:
            raise ValueError(f"bias must have {n} entries (weight's out-features), got {bias.shape[0]}")
    n_out = gated_outputs(n) if gated else n
    if out is None:
        out = torch.empty((m, n_out), dtype=x.dtype, device=dev)
    else:
        check("out", out, 2, (x.dtype,), dev, inner_contiguous=True)
        if tuple(out.shape) != (m, n_out):
            raise ValueError(f"out must be [{m}, {n_out}], got {tuple(out.shape)}")
    if m == 0 or n == 0:
        return out
    block_n, block_k, num_warps = launch_config(m, n, k)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](  # gated: half the outputs a program, the same rows a tile
        x, weight, bias if bias is not None else weight, out, m, n_out, k, x.stride(0), weight.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n,
        BLOCK_K=block_k, GATED=gated, num_warps=num_warps, **pdl_args(dev, m),
    )
    return out


def gated_outputs(rows: int) -> int:
    """The outputs of a gated GEMV over a fused [gate; up] weight of `rows` rows."""
    if rows % 2:
        raise ValueError(f"a gated GEMV's weight is [gate; up]: its rows must be even, got {rows}")
    return rows // 2
