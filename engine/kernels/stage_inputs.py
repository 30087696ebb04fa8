"""A decode step's inputs copied into its CUDA graph's static buffers in one launch (engine.runner.cuda_graphs).

Owns `stage_decode_inputs`. Before a replay the step's token ids, positions, slots, context lengths and block tables
(views of the one buffer the step's host-to-device copy filled: engine.runner.step_inputs) go into the first rows of
the graph's buffers, the rest of the bucket's rows become padding (slot -1, context 0: attended and stored by no
kernel), and a row whose input token is still being sampled by the step before (overlapped scheduling) takes it from
that step's tokens on the device. Done with torch ops this was eight to ten launches between two replays (an
index_select, a cast and an index_copy for the pending tokens, five copies, two fills): ~22 us of an H100's timeline
after each batch-1 step, most of it gaps between one-microsecond kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import check

BLOCK_W = 128  # block-table entries a loop iteration copies


@triton.jit(do_not_specialize=["rows", "width", "stride_dst_t"])  # one variant a HAS_TAKE (engine.runner.warmup)
def _stage_kernel(ids_ptr, pos_ptr, slots_ptr, lens_ptr, tables_ptr, take_ptr, prev_ptr, dst_ids_ptr, dst_pos_ptr,
                  dst_slots_ptr, dst_lens_ptr, dst_tables_ptr, rows, width, stride_dst_t,
                  HAS_TAKE: tl.constexpr, BLOCK_W: tl.constexpr):
    # Grid (bucket,): program r fills row r of the static buffers (a padding row from `rows` on)
    r = tl.program_id(0)
    if r < rows:
        token = tl.load(ids_ptr + r)
        if HAS_TAKE:
            src = tl.load(take_ptr + r)  # the row of the step before whose token this row takes; -1: its own
            if src >= 0:
                token = tl.load(prev_ptr + src).to(tl.int32)
        tl.store(dst_ids_ptr + r, token)
        tl.store(dst_pos_ptr + r, tl.load(pos_ptr + r))
        tl.store(dst_slots_ptr + r, tl.load(slots_ptr + r))
        tl.store(dst_lens_ptr + r, tl.load(lens_ptr + r))
        src_row = tables_ptr + r.to(tl.int64) * width
        dst_row = dst_tables_ptr + r.to(tl.int64) * stride_dst_t
        for c0 in range(0, width, BLOCK_W):
            cols = c0 + tl.arange(0, BLOCK_W)
            mask = cols < width
            tl.store(dst_row + cols, tl.load(src_row + cols, mask=mask), mask=mask)
    else:
        tl.store(dst_slots_ptr + r, -1)
        tl.store(dst_lens_ptr + r, 0)


def stage_decode_inputs(input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                        context_lens: torch.Tensor, block_tables: torch.Tensor, take: torch.Tensor | None,
                        prev_tokens: torch.Tensor | None, dst_ids: torch.Tensor, dst_positions: torch.Tensor,
                        dst_slots: torch.Tensor, dst_context_lens: torch.Tensor, dst_tables: torch.Tensor,
                        bucket: int) -> None:
    """Rows [0, B) of the dst buffers [>= bucket] (dst_tables [>= bucket, W_max], columns [0, W) written) from
    input_ids, positions, slots, context_lens [B] int32 and block_tables [B, W] int32 (contiguous); rows [B, bucket)
    made padding. take [B] int32 (or None): where >= 0, the row's token is prev_tokens[take] (int64, the step
    before's samples) instead of input_ids'."""
    rows = input_ids.shape[0]
    dev = dst_ids.device
    for name, t in (("input_ids", input_ids), ("positions", positions), ("slots", slots),
                    ("context_lens", context_lens)):
        check(name, t, 1, (torch.int32,), dev)
        if t.shape[0] != rows:
            raise ValueError(f"{name} has {t.shape[0]} rows, input_ids {rows}")
    check("block_tables", block_tables, 2, (torch.int32,), dev)
    check("dst_tables", dst_tables, 2, (torch.int32,), dev, inner_contiguous=True)
    width = block_tables.shape[1]
    if block_tables.shape[0] != rows or not block_tables.is_contiguous():
        raise ValueError(f"block_tables must be contiguous [{rows}, W], got {tuple(block_tables.shape)}")
    if not rows <= bucket <= dst_ids.shape[0] or width > dst_tables.shape[1]:
        raise ValueError(f"{rows} rows of width {width} do not fit a bucket of {bucket} in buffers of "
                         f"{dst_ids.shape[0]} x {dst_tables.shape[1]}")
    if (take is None) != (prev_tokens is None):
        raise ValueError("take and prev_tokens come together")
    if take is not None:
        check("take", take, 1, (torch.int32,), dev)
        check("prev_tokens", prev_tokens, 1, (torch.int64,), dev)
        if take.shape[0] != rows:
            raise ValueError(f"take has {take.shape[0]} rows, input_ids {rows}")
    if bucket == 0:
        return
    _stage_kernel[(bucket,)](input_ids, positions, slots, context_lens, block_tables,
                             input_ids if take is None else take, dst_ids if prev_tokens is None else prev_tokens,
                             dst_ids, dst_positions, dst_slots, dst_context_lens, dst_tables, rows, width,
                             dst_tables.stride(0), HAS_TAKE=take is not None, BLOCK_W=BLOCK_W, num_warps=1)
