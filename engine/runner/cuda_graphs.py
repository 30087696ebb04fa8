"""DecodeGraphs: CUDA graphs of the decode step (model forward + logits), one per batch-size bucket.

A decode step of a large model is hundreds of small kernels; launched one by one from Python the GPU idles between
them. Each bucket's graph is captured once over static input buffers; a step copies its inputs into the first rows
of those buffers, pads the rest (context length 0 and slot -1: the kernels then neither attend nor store), in one
launch (engine.kernels.stage_inputs), and replays the smallest bucket that fits. Owns the static buffers and the
graphs; the KV cache is the engine's. Launch parameters of every kernel depend on shapes only, so a graph stays
valid for any contents.
With `first_buckets` set (EngineConfig.graph_capture "deferred"), only the buckets up to it are captured at start;
a larger one is captured the first time a step needs it (`ensure`), or earlier between steps (`capture_pending`,
engine.runner.deferred_graphs). Before such a capture every row is made padding again: the capture's warm-up run
reads the static buffers, which by then hold live slots.
"""

from __future__ import annotations

import torch

from engine.kernels.stage_inputs import stage_decode_inputs
from engine.model.attention_metadata import AttentionMetadata
from engine.model.decoder import CausalLM
from engine.runner.graph_capture import DeferredCaptures, capture_graph


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch (and max_batch itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, max_batch: int, max_blocks_per_seq: int,
                 stream: torch.cuda.Stream | None = None, first_buckets: int | None = None) -> None:
        """`stream`: capture there (engine.runner.graph_capture); the replays then belong there too (the decode
        lane's: engine.runner.prefill_lane.launch_decode makes it current). `first_buckets`: capture only the
        buckets up to this batch size now, the others later (None: all now)."""
        dev = kv_cache.device
        self.stream = stream
        self.model, self.kv_cache, self.max_batch = model, kv_cache, max_batch
        self.input_ids = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.slots = torch.full((max_batch,), -1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.semaphores = torch.zeros(max_batch, model.config.num_kv_heads, dtype=torch.int32, device=dev)
        self.buckets = bucket_sizes(max_batch)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0
        now = [b for b in self.buckets if first_buckets is None or b <= first_buckets]
        self.deferred = DeferredCaptures([b for b in self.buckets if b not in now])  # smallest first
        self._capture(now)
        self._warm_staging()

    def bucket_for(self, batch: int) -> int | None:
        """The bucket a step of `batch` rows replays (captured or still pending; None: above them all)."""
        return next((b for b in self.buckets if b >= batch and b not in self.deferred.failed), None)

    def ensure(self, batch: int) -> bool:
        """Whether a step of `batch` rows can replay a graph, capturing its bucket now if it is still pending."""
        bucket = self.bucket_for(batch)
        while bucket is not None and bucket not in self.graphs:
            if self.deferred.take(bucket) is not None and self._capture_later(bucket):
                return True
            bucket = self.bucket_for(batch)  # the next larger one where this one failed
        return bucket is not None

    def capture_pending(self) -> bool:
        """Capture the next pending bucket (between two steps); False when none is left."""
        bucket = self.deferred.take()
        if bucket is None:
            return False
        self._capture_later(bucket)
        return True

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            take: torch.Tensor | None = None, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """A decode-only step of B <= max_batch rows -> float32 logits [B, vocab] (a view valid until the next
        replay). input_ids, positions [B] and meta are the step's device tensors; take [B] int32 / prev_tokens
        (int64, the step before's samples): a row with take >= 0 takes prev_tokens[take] as its input instead."""
        b = input_ids.shape[0]
        bucket = self.bucket_for(b)
        if bucket not in self.graphs:
            raise ValueError(f"no decode graph holds a step of {b} rows yet (call ensure first)")
        width = meta.decode_block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(f"a decode row has {width} blocks; the graphs were captured for at most "
                             f"{self.block_tables.shape[1]}")
        stage_decode_inputs(input_ids, positions, meta.slots, meta.decode_context_lens, meta.decode_block_tables,
                            take, prev_tokens, self.input_ids, self.positions, self.slots, self.context_lens,
                            self.block_tables, bucket)
        graph, logits = self.graphs[bucket]
        graph.replay()
        self.replays += 1
        return logits[:b]

    @torch.inference_mode()
    def _warm_staging(self) -> None:
        """Compile both variants of the input staging (with and without pending tokens) now rather than in the
        first steps that need them: one row staged each way, then made padding again."""
        one = torch.zeros(1, dtype=torch.int32, device=self.input_ids.device)
        for take, prev in ((None, None), (one, torch.zeros(1, dtype=torch.int64, device=one.device))):
            stage_decode_inputs(one, one, one, one, one.view(1, 1), take, prev, self.input_ids, self.positions,
                                self.slots, self.context_lens, self.block_tables, 1)
        self.slots[:1].fill_(-1)
        self.context_lens[:1].zero_()
        torch.cuda.synchronize(self.input_ids.device)  # before any other stream (a lane's) replays or captures

    def _meta(self, b: int) -> AttentionMetadata:
        dev = self.kv_cache.device
        empty = torch.zeros(0, dtype=torch.int32, device=dev)
        return AttentionMetadata(
            slots=self.slots[:b], num_decode=b, decode_block_tables=self.block_tables[:b],
            decode_context_lens=self.context_lens[:b], prefill_block_tables=empty.view(0, 0),
            prefill_query_start=torch.zeros(1, dtype=torch.int32, device=dev), prefill_context_lens=empty,
            prefill_lens=(), sliding_window=self.model.config.sliding_window,
            decode_semaphores=self.semaphores[:b])

    @torch.inference_mode()
    def _capture(self, buckets: list[int]) -> None:
        for b in sorted(buckets, reverse=True):  # largest first: smaller ones reuse its memory
            self._capture_one(b)
        torch.cuda.synchronize()

    @torch.inference_mode()
    def _capture_later(self, b: int) -> bool:
        """Capture bucket b while serving: every row made padding first (on the replays' stream, after the steps
        queued there); a capture that fails leaves b to eager steps for good (logged)."""
        with torch.cuda.stream(self.stream or torch.cuda.current_stream()):
            self.slots.fill_(-1)
            self.context_lens.zero_()
        return self.deferred.attempt(b, lambda: self._capture_one(b), f"decode graph of {b} rows",
                                     "such steps run eagerly")

    def _capture_one(self, b: int) -> None:
        meta = self._meta(b)

        def step() -> torch.Tensor:
            hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_cache, meta)
            return self.model.compute_logits(hidden)  # [b, vocab]

        self.graphs[b] = capture_graph(step, self.deferred.memory_pool(),
                                       self.stream or self.deferred.stream())  # (graph, logits)
