"""ModelRunner: owns the model weights and the KV cache tensor on one device; runs one scheduled step.

Input: the scheduler's plain SchedulerOutput. Output: {request_id: (token, logprob)} for the chunks that sample.
It knows nothing of request life cycles; the scheduler knows nothing of tensors. On the GPU path, decode-only
steps replay CUDA graphs (engine.cuda_graphs); other steps run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.cuda_graphs import DecodeGraphs
from engine.model import CausalLM
from engine.request import TokenLogprob
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.step_inputs import build_step_inputs


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, block_size: int, sampler: Sampler,
                 graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache  # [NB, L, 2, bs, KVH, D]
        self.block_size = block_size
        self.sampler = sampler
        self.graphs = graphs
        self.device = kv_cache.device

    @torch.inference_mode()
    def run(self, sched: SchedulerOutput, params: dict[str, SamplingParams],
            on_layer_done: Callable[[int], None] | None = None) -> dict[str, tuple[int, TokenLogprob | None]]:
        if not sched.chunks:
            return {}
        step = build_step_inputs(sched, self.block_size, self.device, self.model.config.sliding_window)
        if self._graph_fits(step.input_ids.shape[0], step.decode_only, len(step.sampling), on_layer_done):
            logits = self.graphs.run(step.input_ids, step.positions, step.meta)  # [B, V], every row samples
        else:
            hidden = self.model(step.input_ids, step.positions, self.kv_cache, step.meta, on_layer_done)  # [T, h]
            if not step.sampling:
                return {}
            logits = self.model.compute_logits(hidden[step.sample_index])  # [S, V]
        chunks = step.sampling
        tokens, logprobs = self.sampler(logits, [params[c.request_id] for c in chunks],
                                        [c.output_index for c in chunks])
        return {c.request_id: (t, lp) for c, t, lp in zip(chunks, tokens, logprobs, strict=True)}

    def _graph_fits(self, num_tokens: int, decode_only: bool, num_sampling: int,
                    on_layer_done: Callable | None) -> bool:
        """Graphs cover decode-only steps where every row samples, without a per-layer hook."""
        if self.graphs is None or on_layer_done is not None or not decode_only or num_sampling != num_tokens:
            return False
        return self.graphs.bucket_for(num_tokens) is not None
