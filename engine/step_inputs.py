"""StepInputs: one scheduled step turned into device tensors, with one host-to-device copy.

Owns the token order (decode rows first, then prefill chunks, as engine.attention expects) and the packing: every
integer the step needs goes into one int32 host buffer (pinned on CUDA) that moves with a single non-blocking
copy, so building a step never waits for the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.scheduler import ScheduledChunk, SchedulerOutput


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor       # [T] int32
    positions: torch.Tensor       # [T] int32
    meta: AttentionMetadata
    sample_index: torch.Tensor    # [S] int32, the token whose hidden state samples, per sampling chunk
    sampling: list[ScheduledChunk]  # the sampling chunks, in sample_index order

    @property
    def decode_only(self) -> bool:
        return self.meta.num_decode == self.input_ids.shape[0]


def build_step_inputs(sched: SchedulerOutput, block_size: int, device: torch.device,
                      sliding_window: int | None) -> StepInputs:
    decodes = [c for c in sched.chunks if len(c.token_ids) == 1]
    prefills = [c for c in sched.chunks if len(c.token_ids) > 1]
    ordered = decodes + prefills
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    sample_index: list[int] = []
    for chunk in ordered:
        n, start = len(chunk.token_ids), chunk.start_pos
        ids += chunk.token_ids
        pos += range(start, start + n)
        slots += [chunk.block_table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
        if chunk.sample:
            sample_index.append(len(ids) - 1)
    d_tables = [_table(c, block_size) for c in decodes]
    d_lens = [c.start_pos + 1 for c in decodes]
    p_tables = [_table(c, block_size) for c in prefills]
    p_lens = [(len(c.token_ids), c.start_pos + len(c.token_ids)) for c in prefills]
    q_start = [0]
    for n, _ in p_lens:
        q_start.append(q_start[-1] + n)
    d_width, p_width = _width(d_tables), _width(p_tables)
    parts = [ids, pos, slots, _flat(d_tables, d_width), d_lens, _flat(p_tables, p_width), q_start,
             [ctx for _, ctx in p_lens], sample_index]
    host = torch.tensor([x for part in parts for x in part], dtype=torch.int32)
    if device.type == "cuda":
        host = host.pin_memory()
    flat = host.to(device, non_blocking=True)
    fields = list(flat.split([len(p) for p in parts]))
    t, nd, npf = len(ids), len(decodes), len(prefills)
    meta = AttentionMetadata(
        slots=fields[2],
        num_decode=nd,
        decode_block_tables=fields[3].view(nd, d_width),
        decode_context_lens=fields[4],
        prefill_block_tables=fields[5].view(npf, p_width),
        prefill_query_start=fields[6],
        prefill_context_lens=fields[7],
        prefill_lens=tuple(p_lens),
        sliding_window=sliding_window,
    )
    assert fields[0].shape[0] == t
    sampling = [c for c in ordered if c.sample]
    return StepInputs(fields[0], fields[1], meta, fields[8], sampling)


def _table(chunk: ScheduledChunk, block_size: int) -> list[int]:
    """The blocks holding the chunk's whole context (cached prefix plus its new tokens)."""
    context = chunk.start_pos + len(chunk.token_ids)
    return chunk.block_table[: -(-context // block_size)]


def _width(tables: list[list[int]]) -> int:
    return max((len(t) for t in tables), default=0)


def _flat(tables: list[list[int]], width: int) -> list[int]:
    return [b for t in tables for b in t + [0] * (width - len(t))]
