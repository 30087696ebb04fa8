"""A weight the step reads next asked into the GPU's L2 by the programs of a long kernel before it.

At many decode rows the fp8 decode attention runs for ~80 us a layer (8B shape, batch 64, 2k context on an H200)
reading the KV cache at ~0.78x the copy rate, and the linear after it (o_proj: 16.8 MB of e4m3) then runs at
~0.45x, bound by its first DRAM round trips. Each of the attention's programs may therefore ask the L2 for its
share of that weight as it starts (Hopper's bulk prefetch, `cp.async.bulk.prefetch.L2`: one instruction a
program, nothing to wait for), while its K / V loads carry an evict-first hint (read once, they are the L2's first
lines to go), so that the weight is still in L2 when o_proj reads it. Weights are written by no kernel of a step,
so asking early is always safe, and results do not change (a prefetch moves no data into registers). Two earlier
tries from other places were slower and withdrawn (docs/benchmark-log.md, 2026-12-04 and 2026-12-07): the prefetch
then either overlapped the short kernel it hid behind (batch 1-16) or was evicted by the KV stream that followed
it. Off by default (engine.kernels.decode_launch.PREFETCH_MIN_PAIRS) until a GPU times it; not yet run on a GPU.

Owns `prefetch_share` (device: a program's share of a byte range, one bulk prefetch by its first thread) and
`share_bytes` (host: how many bytes each program asks for, from shapes alone, so a CUDA graph keeps it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ALIGN = 16  # the bulk prefetch's address and size granule


@triton.jit
def prefetch_share(ptr, program, share_bytes, total_bytes):
    # Thread 0 of program `program` asks the L2 for bytes [program * share_bytes, ...) of the range at ptr, at most
    # share_bytes (a multiple of ALIGN), none past total_bytes: one bulk prefetch a program. Hopper (sm_90+) only;
    # ptr ALIGN-aligned.
    start = program * share_bytes  # int32: share_bytes says the range fits
    size = tl.minimum(tl.maximum(total_bytes - start, 0), share_bytes)
    tl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\t.reg .u32 t;\n\tmov.u32 t, %tid.x;\n\tsetp.eq.u32 p, t, 0;"
        "\n\tsetp.gt.and.s32 p, $2, 0, p;\n\t@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\t}\n\tmov.u32 $0, 0;",
        "=r,l,r", [ptr.to(tl.pointer_type(tl.int8)) + start + tl.zeros([1], tl.int32), size + tl.zeros([1], tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1)


def share_bytes(weight: torch.Tensor, programs: int) -> int:
    """Bytes each of `programs` programs asks for so that together they cover `weight` (rounded up to ALIGN); 0
    where the weight cannot be prefetched this way (not contiguous, not ALIGN-aligned, empty, or
    2 GiB or more: the device code's offsets are int32, which keeps its registers few)."""
    total = weight.numel() * weight.element_size()
    if total == 0 or total >= 2**31 or programs < 1 or not weight.is_contiguous() or weight.data_ptr() % ALIGN:
        return 0
    return triton.cdiv(triton.cdiv(total, programs), ALIGN) * ALIGN
