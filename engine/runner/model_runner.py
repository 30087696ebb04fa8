"""ModelRunner: owns the model weights and the KV cache tensor on one device; runs one scheduled step.

Input: the scheduler's plain SchedulerOutput. Output: {request_id: (token, logprob)} for the chunks that sample.
It knows nothing of request life cycles; the scheduler knows nothing of tensors. On the GPU path, decode-only
steps replay CUDA graphs (engine.runner.cuda_graphs), short prefill-only steps too (engine.runner.prefill_graphs),
other steps up to a token bound replay piecewise graphs around eager attention (engine.runner.mixed_graphs); steps
with a per-layer hook or step extras run eagerly.

`launch` queues a step and returns a LaunchedStep whose tokens are still on the device; `run` = launch + result.
A decode step may take its input ids from the LaunchedStep before it (`after`), still on the device, which lets
the engine queue step N+1 before the host has read step N's tokens (overlapped scheduling).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.core.request import PromptLogprob, TokenLogprob
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import PENDING_TOKEN, ScheduledChunk, SchedulerOutput
from engine.model.decoder import CausalLM
from engine.runner.cuda_graphs import DecodeGraphs
from engine.runner.mixed_graphs import MixedGraphs
from engine.runner.prefill_graphs import PrefillGraphs
from engine.runner.step_extras import StepExtras, compute_prompt_logprobs, fork_rows
from engine.runner.step_inputs import StepInputs, build_step_inputs, decode_rows
from engine.sampling.sampler import SampledTokens, Sampler


@dataclass
class LaunchedStep:
    """A step queued on the device: what was scheduled, and its samples on their way to the host."""

    sched: SchedulerOutput
    sampling: list[ScheduledChunk]     # the sampling chunks, in the row order of `sampled`
    sampled: SampledTokens | None      # None when no chunk samples
    fork_rows: dict[str, list[int]] = field(default_factory=dict)  # group prefills' extra rows (engine.step_extras)
    prompt_logprobs: dict[str, tuple[int, list[PromptLogprob]]] = field(default_factory=dict)  # by request id
    fork_first: dict[str, list[tuple[int, TokenLogprob | None]]] = field(default_factory=dict)  # set by result()

    def result(self) -> dict[str, tuple[int, TokenLogprob | None]]:
        """Waits for the step's tokens: {request_id: (token, logprob)} (group prefills' other first tokens go
        to `fork_first`)."""
        if self.sampled is None:
            return {}
        tokens, logprobs = self.sampled.result()
        self.fork_first = {rid: [(tokens[i], logprobs[i]) for i in rows] for rid, rows in self.fork_rows.items()}
        n = len(self.sampling)
        return {c.request_id: (t, lp) for c, t, lp in zip(self.sampling, tokens[:n], logprobs[:n], strict=True)}


class ModelRunner:
    # whether decode graphs gather a step's pending input tokens while staging its inputs (one launch); a
    # tensor-parallel leader gathers them first instead, to broadcast them to its followers
    stages_pending_tokens = True

    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, block_size: int, sampler: Sampler | None,
                 graphs: DecodeGraphs | None = None, prefill_graphs: PrefillGraphs | None = None,
                 mixed_graphs: MixedGraphs | None = None) -> None:
        """`sampler`: None on a tensor-parallel follower, which never samples (engine.runner.tp_follower)."""
        self.model = model
        self.kv_cache = kv_cache  # [NB, L, 2, bs, KVH, D]
        self.block_size = block_size
        self.sampler = sampler
        self.graphs = graphs
        self.prefill_graphs = prefill_graphs
        self.mixed_graphs = mixed_graphs
        self.device = kv_cache.device
        # called as hook(sampling chunks, logits [S, V], after) before sampling, to mask logits in place
        # (engine.grammar); None: no request has a structured output spec
        self.logits_hook: Callable[[list[ScheduledChunk], torch.Tensor, LaunchedStep | None], None] | None = None

    def run(self, sched: SchedulerOutput, params: dict[str, SamplingParams],
            on_layer_done: Callable[[int], None] | None = None) -> dict[str, tuple[int, TokenLogprob | None]]:
        return self.launch(sched, params, on_layer_done=on_layer_done).result()

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, params: dict[str, SamplingParams], after: LaunchedStep | None = None,
               on_layer_done: Callable[[int], None] | None = None, extras: StepExtras | None = None,
               graphs: DecodeGraphs | None = None) -> LaunchedStep:
        """Queue `sched`. With `after` (the step queued before it, its tokens not yet read), a decode row whose
        token id is PENDING_TOKEN takes the token `after` samples for its request. `extras`: fork rows and prompt
        logprobs (engine.step_extras); such a step runs eagerly. `graphs`: decode graphs to replay instead of the
        runner's (the decode lane's: engine.runner.prefill_lane)."""
        if not sched.chunks:
            return LaunchedStep(sched, [], None)
        take = self._take(after, sched) if after is not None else None
        step = build_step_inputs(sched, self.block_size, self.device, self.model.config.sliding_window, take)
        prev = after.sampled.tokens if step.take is not None else None  # [S'] int64, the step before's samples
        prompt = {}
        graphs = graphs or self.graphs
        if not extras and self._graph_fits(graphs, step.input_ids.shape[0], step.decode_only, len(step.sampling),
                                           on_layer_done):
            if prev is not None and not self.stages_pending_tokens:
                logits = graphs.run(self._ids_after(step, prev), step.positions, step.meta)  # [B, V]
            else:  # the pending tokens gathered by the graphs' input staging
                logits = graphs.run(step.input_ids, step.positions, step.meta, step.take, prev)  # [B, V]
        else:
            input_ids = step.input_ids if prev is None else self._ids_after(step, prev)  # [T]
            hidden = self.forward(input_ids, step, on_layer_done, eager=bool(extras))  # [T, h]
            if extras and extras.prompt:
                prompt = compute_prompt_logprobs(self.model, hidden, sched, extras.prompt)
            if not step.sampling:
                return LaunchedStep(sched, [], None, prompt_logprobs=prompt)
            logits = self.model.compute_logits(hidden[step.sample_index])  # [S, V]
        return self.sample(sched, step.sampling, logits, params, after, extras, prompt)

    def sample(self, sched: SchedulerOutput, chunks: list[ScheduledChunk], logits: torch.Tensor,
               params: dict[str, SamplingParams], after: LaunchedStep | None = None, extras: StepExtras | None = None,
               prompt: dict | None = None) -> LaunchedStep:
        """Queue the sampling of `chunks` (the step's sampling chunks, in the row order of `logits` [S, V])."""
        prompt = prompt or {}
        if self.logits_hook is not None:
            self.logits_hook(chunks, logits, after)
        row_params = [params[c.request_id] for c in chunks]
        if extras and extras.forks:
            rows, row_params, indices, ids, where = fork_rows(chunks, row_params, extras.forks)
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))  # [S + forks, V]
            sampled = self.sampler.launch(logits, row_params, indices, ids)
            return LaunchedStep(sched, chunks, sampled, where, prompt)
        sampled = self.sampler.launch(logits, row_params, [c.output_index for c in chunks],
                                      [c.request_id for c in chunks])
        return LaunchedStep(sched, chunks, sampled, prompt_logprobs=prompt)

    def forward(self, input_ids: torch.Tensor, step: StepInputs, on_layer_done: Callable[[int], None] | None,
                eager: bool) -> torch.Tensor:
        """The step's final hidden states [T, h]: a prefill graph's replay where one fits (no hook, not `eager`),
        else the mixed-step graphs' where one fits, else the eager forward. TP followers call it alike, so every
        rank makes the same choice."""
        if not eager and on_layer_done is None:
            graphs, mixed = self.prefill_graphs, self.mixed_graphs
            key = graphs.bucket(input_ids.shape[0], step.meta) if graphs is not None else None
            if key is not None:
                return graphs.run(key, input_ids, step.positions, step.meta)
            bucket = mixed.bucket_for(input_ids.shape[0]) if mixed is not None else None
            if bucket is not None:
                return mixed.run(bucket, input_ids, step.positions, step.meta)
        return self.model(input_ids, step.positions, self.kv_cache, step.meta, on_layer_done)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst (all layers), queued after any step in flight."""
        for a, b in pairs:
            self.kv_cache[b].copy_(self.kv_cache[a])  # [L, 2, bs, KVH, D]

    @staticmethod
    def _take(after: LaunchedStep, sched: SchedulerOutput) -> list[int] | None:
        """Per decode row of `sched` (queued after `after`, whose tokens are not yet read): the row of `after`'s
        samples whose token is its input (-1: the row's own; a joining row's known token, every prompt chunk's);
        None when no row waits for one."""
        row = {c.request_id: i for i, c in enumerate(after.sampling)}  # `after`'s tokens: [S + F], forks last
        take = []
        for c in decode_rows(sched):  # row i is token i (engine.runner.step_inputs)
            if c.token_ids[0] != PENDING_TOKEN:
                take.append(-1)
            elif after.sampled is None or c.request_id not in row:
                raise ValueError(f"request {c.request_id!r} waits for a token the step before does not sample")
            else:
                take.append(row[c.request_id])
        return take if any(t >= 0 for t in take) else None

    def _ids_after(self, step: StepInputs, prev: torch.Tensor) -> torch.Tensor:
        """[T] int32 input ids: the step's own, with each decode row that has step.take >= 0 given prev[take]
        (prev [S'] int64: the step before's samples, still on the device), for the steps that do not stage their
        inputs into decode graphs (eager and mixed steps; a tensor-parallel leader, which broadcasts the result)."""
        take = step.take  # [D] int32
        taken = prev.index_select(0, take.clamp(min=0)).to(torch.int32)  # [D]
        ids = step.input_ids.clone()
        ids[:take.shape[0]] = torch.where(take >= 0, taken, ids[:take.shape[0]])
        return ids

    @staticmethod
    def _graph_fits(graphs: DecodeGraphs | None, num_tokens: int, decode_only: bool, num_sampling: int,
                    on_layer_done: Callable | None) -> bool:
        """Graphs cover decode-only steps where every row samples, without a per-layer hook (a bucket still
        pending is captured now: DecodeGraphs.ensure)."""
        if graphs is None or on_layer_done is not None or not decode_only or num_sampling != num_tokens:
            return False
        return graphs.ensure(num_tokens)
