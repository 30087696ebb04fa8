"""ModelRunner: owns the model weights and the KV cache tensor on one device; runs one scheduled step.

Input: the scheduler's plain SchedulerOutput. Output: {request_id: (token, logprob)} for the chunks that sample.
It knows nothing of request life cycles; the scheduler knows nothing of tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention import AttentionMetadata
from engine.model import CausalLM
from engine.request import TokenLogprob
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, block_size: int, sampler: Sampler) -> None:
        self.model = model
        self.kv_cache = kv_cache  # [NB, L, 2, bs, KVH, D]
        self.block_size = block_size
        self.sampler = sampler
        self.device = kv_cache.device

    @torch.inference_mode()
    def run(self, sched: SchedulerOutput, params: dict[str, SamplingParams],
            on_layer_done: Callable[[int], None] | None = None) -> dict[str, tuple[int, TokenLogprob | None]]:
        if not sched.chunks:
            return {}
        input_ids, positions, meta = self._prepare(sched)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, on_layer_done)  # [T, hidden]
        ends, sampling = [], []
        end = 0
        for chunk in sched.chunks:
            end += len(chunk.token_ids)
            if chunk.sample:
                ends.append(end - 1)
                sampling.append(chunk)
        if not sampling:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(ends, device=self.device)])  # [S, V]
        tokens, logprobs = self.sampler(logits, [params[c.request_id] for c in sampling],
                                        [c.output_index for c in sampling])
        return {c.request_id: (t, lp) for c, t, lp in zip(sampling, tokens, logprobs, strict=True)}

    def _prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slot_blocks: list[int] = []
        prefills = []
        decode_index, decode_tables, decode_lens = [], [], []
        for chunk in sched.chunks:
            n, start = len(chunk.token_ids), chunk.start_pos
            first = len(ids)
            ids += chunk.token_ids
            pos += range(start, start + n)
            slot_blocks += [chunk.block_table[p // bs] for p in range(start, start + n)]
            ctx = start + n
            table = chunk.block_table[: -(-ctx // bs)]
            if n == 1:
                decode_index.append(first)
                decode_tables.append(table)
                decode_lens.append(ctx)
            else:
                prefills.append((first, n, ctx, torch.tensor(table, device=self.device)))
        width = max((len(t) for t in decode_tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in decode_tables]
        dev = self.device
        positions = torch.tensor(pos, device=dev)
        meta = AttentionMetadata(
            slot_blocks=torch.tensor(slot_blocks, device=dev),
            slot_offsets=positions % bs,
            prefills=prefills,
            decode_token_index=torch.tensor(decode_index, dtype=torch.long, device=dev),
            decode_block_tables=torch.tensor(padded, dtype=torch.long, device=dev).reshape(len(padded), width),
            decode_context_lens=torch.tensor(decode_lens, dtype=torch.long, device=dev),
            sliding_window=self.model.config.sliding_window,
        )
        return torch.tensor(ids, device=dev), positions, meta
