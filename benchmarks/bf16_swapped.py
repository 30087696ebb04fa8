"""The FP8 swapped-operand tensor-core kernel (engine.kernels.fp8_gemm's _fp8_mm_kernel) run on bf16 operands with
unit scales, with or without a split K: whether a Triton bf16 GEMM beats cuBLAS at decode sizes (issue 42's bf16
floor goal: at M = 64 on an H200 cuBLAS runs q/k/v, o and down at 1.31-1.41x their weight-read floor, gate_up at
1.09x; the four GEMMs' excess is ~70% of the batch-64 bf16 step's distance to its floor, those three's ~54%, by the
2026-12-06 sweep). benchmarks/gemm_sweep.py times these launches (`bf16_mm_*` rows); the engine does not use them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from engine.kernels import interpreting
from engine.kernels.fp8_gemm import FP8_MM_CONFIGS, _fp8_mm_kernel

# (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K): the same bytes a K tile as FP8's 256; the K splits as FP8's
# for its N = 4,096 projections (64 tiles of 64 rows for 132 SMs)
BF16_MM_CONFIGS = ((64, 128, 4, 4, 1), (64, 128, 4, 5, 1), (128, 64, 4, 4, 1), (128, 128, 8, 4, 1),
                   (32, 128, 4, 4, 1), (64, 128, 4, 4, 2), (64, 128, 4, 5, 2), (64, 128, 4, 4, 4),
                   (32, 128, 4, 4, 2))


@dataclass(frozen=True)
class SwappedBuffers:
    """What one launch needs besides x, w and out, made once outside a timed graph: unit scales, the split partials
    and the splits' semaphores (zero; the kernel leaves them zero)."""
    ones_m: torch.Tensor  # [M] float32
    ones_n: torch.Tensor  # [N] float32
    part: torch.Tensor    # [SPLIT_K * tiles * BLOCK_N * BLOCK_M] float32 (a 1-element stand-in without a split)
    sems: torch.Tensor    # [tiles] int32


def block_m(m: int) -> int:
    """The token tile fp8_mm picks for M rows (the first row of fp8_gemm.FP8_MM_CONFIGS whose bound holds)."""
    return next(tile for bound, _, tile, *_ in FP8_MM_CONFIGS if m <= bound)


def swapped_buffers(m: int, n: int, config: tuple[int, int, int, int, int], device: torch.device) -> SwappedBuffers:
    block_n, _, _, _, split = config
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m(m))
    part = torch.empty(split * tiles * block_n * block_m(m) if split > 1 else 1, dtype=torch.float32, device=device)
    return SwappedBuffers(torch.ones(m, device=device), torch.ones(n, device=device), part,
                          torch.zeros(tiles, dtype=torch.int32, device=device))


def bf16_swapped_mm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, config: tuple[int, int, int, int, int],
                    buffers: SwappedBuffers) -> None:
    """out [M, N] = x [M, K] @ w [N, K]^T, both 16-bit, on the swapped kernel in `config` (BLOCK_N, BLOCK_K, warps,
    stages, SPLIT_K), with `buffers` from swapped_buffers for the same M, N and config."""
    (m, k), n = x.shape, w.shape[0]
    block_n, block_k, warps, stages, split = config
    bm = block_m(m)
    k_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    _fp8_mm_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, bm), split)](
        x, buffers.ones_m, w, buffers.ones_n, buffers.ones_n, out, buffers.part, buffers.sems, m, n, k, k_split,
        x.stride(0), w.stride(0), out.stride(0), HAS_BIAS=False, BLOCK_N=block_n, BLOCK_M=bm, BLOCK_K=block_k,
        SPLIT_K=split, DOT_F32=interpreting(), PDL=False, num_warps=warps, num_stages=stages)


def config_name(config: tuple[int, int, int, int, int], m: int) -> str:
    """bf16_mm_{BLOCK_N}x{BLOCK_M}x{BLOCK_K}w{warps}s{stages}, then k{SPLIT_K} when K is split (the names of the
    sweep's earlier rows, which had no split)."""
    block_n, block_k, warps, stages, split = config
    return f"bf16_mm_{block_n}x{block_m(m)}x{block_k}w{warps}s{stages}" + (f"k{split}" if split > 1 else "")
