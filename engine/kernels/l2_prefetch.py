"""An FP8 GEMM's weight slice asked into L2 before its PDL wait: the weight stream starts under the kernel before.

engine.kernels.fp8_gemm's fp8_mm (and fp8_mm_rope / fp8_mm_swiglu, which share its main loop) run at 2-64 rows under
programmatic dependent launch (engine.kernels.pdl): their programs may be resident while the short kernel before them
(the activations' quantization, an RMSNorm) still runs, and wait on the device for it. Weights are written by no
kernel of a step, so before that wait each program may ask the L2 for its own first weight tiles with Hopper's bulk
prefetch (`cp.async.bulk.prefetch.L2`: one instruction a weight row, no registers, nothing to wait for); the main
loop's loads of those tiles then find them in L2 or already on their way. A decode step's small GEMMs are bound by
their first DRAM round trips and their launch, not by bytes (o_proj of the 8B shape at 64 rows ran at ~0.45x the copy
rate on an H200), which is the time this moves under the kernel before.

`prefetch_tiles` decides per launch, from shapes alone (CUDA-graph safe), how many BLOCK_K tiles each program asks
for: up to BUDGET_BYTES over the whole grid (what an L2 of 50 MB holds beside the step's activations and KV tiles),
0 without PDL (no wait to run ahead of), on a weight whose rows are not 16-byte aligned (the instruction's rule), or
with BUDGET_BYTES 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Bytes of weight a launch asks into L2 before its wait, over all its programs; 0: none.
BUDGET_BYTES = 0


@triton.jit
def prefetch_weight_rows(w_ptr, rows, n_rows, stride_wn, K, K_SPLIT, BYTES: tl.constexpr):
    # Asks the L2 for the first BYTES (a multiple of 16) of this split's K slice of weight rows `rows` [R] (rows
    # past n_rows repeat the last). Hopper (sm_90+) only; w_ptr, stride_wn, K and K_SPLIT 16-byte multiples.
    k_start = tl.program_id(2) * K_SPLIT
    nbytes = tl.minimum(tl.minimum(K, k_start + K_SPLIT) - k_start, BYTES)
    if nbytes > 0:
        ptrs = w_ptr + tl.minimum(rows, n_rows - 1).to(tl.int64) * stride_wn + k_start  # [R]
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                  [ptrs, nbytes + tl.zeros_like(rows)], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_tiles(weight: torch.Tensor, grid: tuple[int, int, int], block_n: int, block_k: int, k_split: int,
                   pdl: bool) -> int:
    """How many BLOCK_K tiles of its weight rows each program of a launch over `grid` (N tiles, M tiles, SPLIT_K)
    asks into L2 before its wait: within BUDGET_BYTES for the whole grid, at most a split's tiles; 0 without PDL or
    where the weight's rows or K are not 16-byte multiples."""
    if not pdl or BUDGET_BYTES <= 0 or weight.data_ptr() % 16 or weight.stride(0) % 16 or weight.shape[1] % 16:
        return 0
    tile = block_n * block_k * weight.element_size()
    return max(0, min(triton.cdiv(k_split, block_k), BUDGET_BYTES // (tile * grid[0] * grid[2])))
