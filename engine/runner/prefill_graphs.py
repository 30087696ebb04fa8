"""PrefillGraphs: CUDA graphs of short prefill-only steps (the model forward), one per (token, sequence) bucket.

A prefill step of a few short prompts is host-bound: on one H100 a 64-token prompt's step took 7.8 ms, nearly all
of it Python launching ~16 kernels a layer (benchmarks/engine_host.py prefill), against 1.7 ms for a decode step of
eight replayed from a graph. That time is on the critical path of every short request's first token, and a high
priority prompt waits for the step under way to end. So prefill-only steps of at most `max_tokens` tokens replay a
graph captured over static buffers (at start, or with `deferred` between steps once the engine serves:
`capture_pending`; until its graph is captured a step runs in the smallest captured bucket that holds it, or
eagerly):
- tokens past the step's own are padding: slot -1 (their K/V is not stored) and in no sequence;
- sequences past the step's own have no new tokens (query start = the step's token count) and context 0, so their
  attention programs exit at once; the attention grid is sized for the bucket (max query length = its tokens).
Every row's math is its own, so padding rows never touch real ones. The output is the hidden states [T, hidden] (a
view valid until the next replay); the caller computes logits of its sampling rows eagerly (their count varies).
Steps with decode rows, a per-layer hook or prompt logprobs run eagerly (engine.runner.model_runner).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.model.attention_metadata import AttentionMetadata
from engine.model.decoder import CausalLM
from engine.runner.graph_capture import DeferredCaptures, capture_graph

MIN_TOKENS = 16


class PrefillBuckets:
    """Which graph a prefill-only step of T tokens in N chunks replays: the smallest token bucket >= T (16, 32,
    64, ... up to max_tokens), then its smallest sequence bucket >= N (1, 2, 4, ... up to the most chunks a step
    of that many tokens holds: every prefill chunk has at least 2 tokens, engine.runner.step_inputs)."""

    def __init__(self, max_tokens: int, max_seqs: int) -> None:
        self.tokens: list[int] = []
        if max_tokens >= 2:
            t = MIN_TOKENS
            while t < max_tokens:
                self.tokens.append(t)
                t *= 2
            self.tokens.append(max_tokens)
        self._seqs = {t: _seq_buckets(max(1, min(t // 2, max_seqs))) for t in self.tokens}

    def seqs(self, tokens: int) -> list[int]:
        return self._seqs[tokens]

    def all(self) -> list[tuple[int, int]]:
        return [(t, n) for t in self.tokens for n in self._seqs[t]]

    def bucket_for(self, num_tokens: int, num_seqs: int,
                   usable: Callable[[tuple[int, int]], bool] = lambda key: True) -> tuple[int, int] | None:
        """The smallest bucket that holds the step (tokens first, then chunks), among those `usable` allows."""
        if num_seqs < 1:
            return None
        for t in (b for b in self.tokens if b >= num_tokens):
            n = next((b for b in self._seqs[t] if b >= num_seqs and usable((t, b))), None)
            if n is not None:
                return t, n
        return None


def _seq_buckets(cap: int) -> list[int]:
    """1, 2, 4, ... below cap, then cap."""
    out, n = [], 1
    while n < cap:
        out.append(n)
        n *= 2
    return out + [cap]


class PrefillGraphs:
    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, max_tokens: int, max_seqs: int,
                 max_blocks_per_seq: int, capture: bool = True, deferred: bool = False) -> None:
        """`capture=False` runs the padded forward eagerly instead of replaying (a CPU test of the padding).
        `deferred`: capture nothing now; every bucket waits for capture_pending (smallest first)."""
        dev = kv_cache.device
        self.model, self.kv_cache = model, kv_cache
        self.buckets = PrefillBuckets(max_tokens, max_seqs)
        t_max = max(self.buckets.tokens, default=0)
        n_max = max((self.buckets.seqs(t)[-1] for t in self.buckets.tokens), default=0)
        self.input_ids = torch.zeros(t_max, dtype=torch.int32, device=dev)
        self.positions = torch.zeros(t_max, dtype=torch.int32, device=dev)
        self.slots = torch.full((t_max,), -1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n_max, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.query_start = torch.zeros(n_max + 1, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(n_max, dtype=torch.int32, device=dev)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0
        self.capturing = capture
        self.deferred = DeferredCaptures(self.buckets.all() if capture and deferred else [])
        if capture and not deferred:
            self._capture()

    def bucket(self, num_tokens: int, meta: AttentionMetadata) -> tuple[int, int] | None:
        """The (tokens, chunks) graph a step replays; None for a step with decode rows, above the bound or with no
        graph captured yet that holds it."""
        if meta.num_decode:
            return None
        return self.buckets.bucket_for(num_tokens, len(meta.prefill_lens),
                                       lambda key: not self.capturing or key in self.graphs)

    @torch.inference_mode()
    def capture_pending(self) -> bool:
        """Capture the next pending bucket (between two steps; every row made padding first: the warm-up run reads
        the static buffers, whose rows past the last step still hold live slots); False when none is left. A
        capture that fails leaves its bucket to the others (logged)."""
        key = self.deferred.take()
        if key is None:
            return False
        self.slots.fill_(-1)
        self.query_start.zero_()
        self.context_lens.zero_()
        self.deferred.attempt(key, lambda: self._capture_one(*key), f"prefill graph {key}",
                              "its steps run in another bucket or eagerly")
        return True

    @torch.inference_mode()
    def run(self, key: tuple[int, int], input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """A prefill-only step in graph `key` (from bucket()) -> final hidden states [T, hidden]. input_ids,
        positions [T] and meta are the step's device tensors."""
        t, n = input_ids.shape[0], len(meta.prefill_lens)
        tb, nb = key
        if meta.num_decode or t > tb or n > nb:
            raise ValueError(f"graph {key} cannot run {t} tokens in {n} chunks with {meta.num_decode} decode rows")
        width = meta.prefill_block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(f"a prefill chunk has {width} blocks; the graphs were captured for at most "
                             f"{self.block_tables.shape[1]}")
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slots[:t].copy_(meta.slots)
        self.slots[t:tb].fill_(-1)
        self.block_tables[:n, :width].copy_(meta.prefill_block_tables)
        self.query_start[:n + 1].copy_(meta.prefill_query_start)
        self.query_start[n + 1:nb + 1].fill_(t)
        self.context_lens[:n].copy_(meta.prefill_context_lens)
        self.context_lens[n:nb].zero_()
        self.replays += 1
        if key not in self.graphs:  # capture=False
            return self._forward(tb, nb)[:t]
        graph, hidden = self.graphs[key]
        graph.replay()
        return hidden[:t]

    def _meta(self, tb: int, nb: int) -> AttentionMetadata:
        empty = torch.zeros(0, dtype=torch.int32, device=self.kv_cache.device)
        # the host lengths only size the attention grid (max query length = the bucket's tokens)
        return AttentionMetadata(
            slots=self.slots[:tb], num_decode=0, decode_block_tables=empty.view(0, 0), decode_context_lens=empty,
            prefill_block_tables=self.block_tables[:nb], prefill_query_start=self.query_start[:nb + 1],
            prefill_context_lens=self.context_lens[:nb], prefill_lens=((tb, tb),) + ((0, 0),) * (nb - 1),
            sliding_window=self.model.config.sliding_window)

    def _forward(self, tb: int, nb: int) -> torch.Tensor:
        return self.model(self.input_ids[:tb], self.positions[:tb], self.kv_cache, self._meta(tb, nb))  # [tb, h]

    @torch.inference_mode()
    def _capture(self) -> None:
        # Before the first step the buffers hold no sequence (query starts 0, slots -1): capturing stores nothing.
        for tb, nb in sorted(self.buckets.all(), reverse=True):  # largest first: smaller ones reuse its memory
            self._capture_one(tb, nb)
        torch.cuda.synchronize()

    def _capture_one(self, tb: int, nb: int) -> None:
        self.graphs[(tb, nb)] = capture_graph(lambda: self._forward(tb, nb), self.deferred.memory_pool(),
                                              self.deferred.stream())  # (graph, hidden)
