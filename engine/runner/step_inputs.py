"""StepInputs: one scheduled step turned into device tensors, with one host-to-device copy.

Owns the token order (decode rows first, then prefill chunks, as engine.attention expects) and the packing: every
integer the step needs goes into one int32 host buffer (pinned on CUDA) that moves with a single non-blocking
copy, so building a step never waits for the GPU. Every part starts 16-byte aligned: Triton specialises a kernel
on its pointers' 16-byte alignment, so unaligned parts would compile new variants mid-serving (engine.runner.warmup).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.core.scheduler import ScheduledChunk, SchedulerOutput
from engine.model.attention_metadata import AttentionMetadata

ALIGN = 4  # int32 elements: 16 bytes


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor       # [T] int32
    positions: torch.Tensor       # [T] int32
    meta: AttentionMetadata
    sample_index: torch.Tensor    # [S] int32, the token whose hidden state samples, per sampling chunk
    sampling: list[ScheduledChunk]  # the sampling chunks, in sample_index order
    take: torch.Tensor | None = None  # [num_decode] int32: the row of the step before whose token a decode row
    # takes as input (-1: its own); None when no row waits for one

    @property
    def decode_only(self) -> bool:
        return self.meta.num_decode == self.input_ids.shape[0]


def build_step_inputs(sched: SchedulerOutput, block_size: int, device: torch.device,
                      sliding_window: int | None, take: list[int] | None = None) -> StepInputs:
    """`take`: per decode row, the row of the step before whose sampled token is its input (-1: its own token);
    it rides in the same copy (StepInputs.take)."""
    decodes = decode_rows(sched)
    if take is not None and len(take) != len(decodes):
        raise ValueError(f"take has {len(take)} entries for {len(decodes)} decode rows")
    prefills = [c for c in sched.chunks if len(c.token_ids) > 1]
    ordered = decodes + prefills
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    sample_index: list[int] = []
    for chunk in ordered:
        n, start = len(chunk.token_ids), chunk.start_pos
        ids += chunk.token_ids
        if n == 1:
            pos.append(start)
            slots.append(chunk.block_table[start // block_size] * block_size + start % block_size)
        else:
            pos += range(start, start + n)
            slots += [chunk.block_table[p // block_size] * block_size + p % block_size
                      for p in range(start, start + n)]
        if chunk.sample:
            sample_index.append(len(ids) - 1)
    d_tables = [_table(c, block_size) for c in decodes]
    p_tables = [_table(c, block_size) for c in prefills]
    p_lens = [(len(c.token_ids), c.start_pos + len(c.token_ids)) for c in prefills]
    q_start = [0]
    for n, _ in p_lens:
        q_start.append(q_start[-1] + n)
    nd, npf = len(decodes), len(prefills)
    d_width, p_width = _width(d_tables), _width(p_tables)
    parts = [ids, pos, slots, [c.start_pos + 1 for c in decodes], q_start, [ctx for _, ctx in p_lens], sample_index,
             take or []]
    sizes = [len(p) for p in parts] + [nd * d_width, npf * p_width]
    spans = [-(-n // ALIGN) * ALIGN for n in sizes]  # each part starts 16-byte aligned
    host = np.zeros(sum(spans), dtype=np.int32)  # table padding stays 0
    starts = np.cumsum([0] + spans[:-1]).tolist()
    for part, start in zip(parts, starts, strict=False):
        host[start:start + len(part)] = part
    for tables, width, start in ((d_tables, d_width, starts[-2]), (p_tables, p_width, starts[-1])):
        for row, t in enumerate(tables):
            host[start + row * width:start + row * width + len(t)] = t
    flat = torch.from_numpy(host)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    ids_t, pos_t, slots_t, d_lens, q_start_t, p_ctx, sample_t, take_t, d_tab, p_tab = (
        t[:n] for t, n in zip(flat.split(spans), sizes, strict=True))
    meta = AttentionMetadata(
        slots=slots_t,
        num_decode=nd,
        decode_block_tables=d_tab.view(nd, d_width),
        decode_context_lens=d_lens,
        prefill_block_tables=p_tab.view(npf, p_width),
        prefill_query_start=q_start_t,
        prefill_context_lens=p_ctx,
        prefill_lens=tuple(p_lens),
        sliding_window=sliding_window,
    )
    sampling = [c for c in ordered if c.sample]
    return StepInputs(ids_t, pos_t, meta, sample_t, sampling, None if take is None else take_t)


def decode_rows(sched: SchedulerOutput) -> list[ScheduledChunk]:
    """The one-token chunks, which lead the step's token order (row i is token i)."""
    return [c for c in sched.chunks if len(c.token_ids) == 1]


def _table(chunk: ScheduledChunk, block_size: int) -> list[int]:
    """The blocks holding the chunk's whole context (cached prefix plus its new tokens)."""
    context = chunk.start_pos + len(chunk.token_ids)
    return chunk.block_table[: -(-context // block_size)]


def _width(tables: list[list[int]]) -> int:
    return max((len(t) for t in tables), default=0)


