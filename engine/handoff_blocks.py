"""The decode side's booking of blocks for KV written in from outside, and the prefill side's pins: a mixin of
LLMEngine, whose public methods these are (called on the engine by decode_pool's reservations, handoff and decodes,
prefill_pool, the benchmarks and tests).

Owns the reservations (`_reserved`, `_reserved_hits`, made in LLMEngine.__init__): reserve_blocks() and
fork_reservation() book blocks, add_prefilled_request() starts decoding in them (or holds it for its grammar's
loader: engine.grammar_holding), abort() (LLMEngine) gives them back; launch_fence() and order_after() order the
outside writes against the engine's device launches; release() frees a pinned prefill-only request.
Relies on LLMEngine's state and on _validate/_request (LLMEngine), _offload_now, _restorable and _restore_now
(engine.host_kv), _grammar_pending
and _grammar_row (engine.grammar_holding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.core.request import Request, RequestStatus, TokenLogprob, check_token_ids
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import StepOutput
from engine.grammar_holding import _Held

if TYPE_CHECKING:
    from engine.core.block_manager import BlockManager
    from engine.core.scheduler import Scheduler
    from engine.model.model_config import ModelConfig
    from engine.runner.model_runner import ModelRunner
    from engine.runner.tp_leader import TPFollowers
    from engine.sampling.grammar import GrammarManager


@dataclass(frozen=True)
class LaunchFence:
    """Where a write from outside into blocks reserved now may start (LLMEngine.launch_fence)."""

    event: torch.cuda.Event | None  # rank 0: after every launch queued so far on its stream (None on the CPU)
    follower_launches: int | None   # TP: rank 0's launches sent to its followers so far (None without followers)


class HandoffBlocks:
    """LLMEngine's reservations, handoff starts and pins (see the module)."""

    # LLMEngine's, set in its __init__
    device: torch.device
    followers: TPFollowers | None
    model_config: ModelConfig
    scheduler: Scheduler
    block_manager: BlockManager
    runner: ModelRunner
    grammar: GrammarManager | None
    _reserved: set[str]
    _reserved_hits: dict[str, int]
    _held: dict[str, _Held]
    num_handoff_hit_blocks: int

    def release(self, request_id: str) -> bool:
        """Free a pinned prefill-only request's blocks (its KV has been moved). False if it is not pinned."""
        req = self.scheduler.requests.get(request_id)
        if req is None or req.status != RequestStatus.PINNED:
            return False
        return self.scheduler.finish(request_id, "stop")

    def reserve_blocks(self, request_id: str, num_tokens: int, leave_room: bool = False,
                       prefix_hashes: Sequence[bytes] = ()) -> list[int] | None:
        """Decode side: take blocks for `num_tokens` tokens of KV (the prompt's, plus the prior outputs' for a
        resumed request) to be written in from outside. None when the cache has no room now (try later). Abort the
        id to give them back. `leave_room`: room means more than free blocks: none while a preempted request waits
        to resume (its stream is paused: it comes first), and the running requests keep the blocks they need to
        cross their next block boundary (Scheduler.growth_headroom), as does this request for its first token, so
        the reservation makes no running stream the victim of a preemption (the joining request, the newest, would
        be the first: its KV moved here for nothing).
        `prefix_hashes`: the hashes of the KV's leading full blocks (engine.core.block_manager.prefix_block_hashes
        of its tokens but the last). The longest run of them the prefix cache holds starts the table, shared (ref
        counted, as a prompt's prefix hits are): their KV is here already; the run the host tier holds after them
        is copied back into the next blocks now (a host-to-device copy instead of the handoff's); only the
        blocks after both need writing (`reserved_hits` says how many lead the table)."""
        if request_id in self.scheduler.requests or request_id in self._reserved or request_id in self._held:
            raise ValueError(f"request id {request_id!r} is already in use")
        bm = self.block_manager
        leading = list(prefix_hashes[:max(bm.blocks_needed(num_tokens) - 1, 0)])  # the last block is written
        hits = bm.cached_blocks(leading)
        on_host = self._restorable(leading[len(hits):])  # copied back from the host tier: not written either
        if leave_room:
            s = self.scheduler
            own = bm.blocks_needed(num_tokens + 1) - bm.blocks_needed(num_tokens)
            new = bm.blocks_needed(num_tokens) - len(hits) + bm.num_unreferenced(hits)  # cached hits leave the pool
            if s.has_paused or bm.num_free_blocks < new + own + s.growth_headroom():
                return None
        if not bm.allocate(request_id, num_tokens, hits):
            return None
        table = bm.table(request_id)
        self._restore_now(leading[len(hits):len(hits) + on_host], len(leading) - len(hits),  # (and the blocks it
                          table[len(hits):len(hits) + on_host])                             # evicted copied down)
        self._reserved.add(request_id)
        if hits or on_host:
            self._reserved_hits[request_id] = len(hits) + on_host
        return list(table)

    def reserved_hits(self, request_id: str) -> int:
        """How many leading blocks of `request_id`'s reservation the prefix cache supplied (reserve_blocks'
        prefix_hashes): their KV is not to be written from outside."""
        return self._reserved_hits.get(request_id, 0)

    def launch_fence(self) -> LaunchFence:
        """The point behind every device launch queued so far. A block is freed only once every step naming it has
        been launched (async scheduling queues the next step before applying the current one), so blocks reserved
        now are touched by nothing launched later: past this point they may be written from outside, whatever
        steps were queued since. On each TP follower the point lies after as many of rank 0's launches."""
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        return LaunchFence(event, self.followers.launches if self.followers is not None else None)

    def order_after(self, events: Sequence[torch.cuda.Event]) -> None:
        """Every device launch from now on (steps, block copies, later launch fences) runs after `events`: the copies
        of KV still landing in blocks reserved here, so their request can be started, or its blocks freed, before
        the copies end (a step that reads them, or a later write into them, waits on the device). TP=1 only: a
        follower's launches are not ordered by rank 0's stream. Relies on every launch (steps from the step thread,
        calls from the loop) going to the device's default stream: no step runs under `torch.cuda.stream(...)`.
        On the CPU there is no device queue to order (and no event to wait for)."""
        if not events or self.device.type != "cuda":
            return
        if self.followers is not None:
            raise ValueError("order_after: a tensor-parallel engine's followers launch on their own streams")
        stream = torch.cuda.current_stream(self.device)
        if stream != torch.cuda.default_stream(self.device):
            raise RuntimeError(f"order_after: the engine launches on the device's default stream, not {stream!r}")
        for event in events:
            stream.wait_event(event)

    def fork_reservation(self, src_id: str, dst_id: str, num_tokens: int) -> bool:
        """Reserve blocks for `dst_id` holding a copy-on-write fork of the first `num_tokens` tokens of KV of
        `src_id` (a reservation whose KV has arrived, or a pinned group prefill): full blocks are shared (ref
        counts), the partial last block is copied on the device (engine.block_manager.fork). Then start it with
        add_prefilled_request(dst_id, ...), or abort(dst_id). False when no block is free now."""
        src = self.scheduler.requests.get(src_id)
        if src_id not in self._reserved and (src is None or src.status != RequestStatus.PINNED):
            raise ValueError(f"request {src_id!r} is neither a reservation nor a pinned prefill")
        if dst_id in self.scheduler.requests or dst_id in self._reserved or dst_id in self._held:
            raise ValueError(f"request id {dst_id!r} is already in use")
        copies = self.block_manager.fork(src_id, dst_id, num_tokens)
        if copies is None:
            return False
        self._offload_now()
        self.runner.copy_blocks(copies)  # queued after any step in flight (on every rank)
        self._reserved.add(dst_id)
        return True

    def add_prefilled_request(self, request_id: str, prompt_token_ids: list[int], first_token_id: int,
                              params: SamplingParams, first_logprob: TokenLogprob | None = None,
                              prior_output_ids: Sequence[int] = (), priority: int = 0) -> StepOutput | None:
        """Decode side: start a request whose KV (prompt, then prior outputs) is in the blocks reserved under its
        id; `first_token_id` is the output the prefill sampled after them (output index len(prior_output_ids)).
        `priority` orders it as add_request's does, once it is preempted, and makes it a later victim than requests
        of a worse priority (engine.core.waiting). Returns a StepOutput if that token already ends it (then its
        blocks are freed at once)."""
        if request_id not in self._reserved or request_id in self._held:
            raise ValueError(f"request {request_id!r} has no reserved blocks (call reserve_blocks first)")
        prior = self._validate(request_id, prompt_token_ids, params, prior_output_ids)
        check_token_ids(request_id, "first_token_id", [first_token_id], self.model_config.vocab_size)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"request {request_id!r}: priority must be an int, got {priority!r}")
        req = self._request(request_id, prompt_token_ids, params, False, prior, priority)
        if self._grammar_pending(params):  # held, its blocks still booked, until the loader is done
            self._held[request_id] = _Held(req, (first_token_id, first_logprob))
            return None
        return self._start_prefilled(req, first_token_id, first_logprob)

    def _start_prefilled(self, req: Request, first_token_id: int, first_logprob: TokenLogprob | None
                         ) -> StepOutput | None:
        """add_prefilled_request's start, once the request's grammar (if any) can be made."""
        request_id = req.request_id
        # the prefill sampled it under the grammar; where the request's bans left no allowed token it breaks it,
        # and the request ends with "error", as it would have where it was sampled
        grammar = self._grammar_row(request_id, req.params, (*req.prior_output_ids, first_token_id),
                                    last_may_fail=True)
        self.scheduler.add_prefilled(req)
        self._reserved.discard(request_id)
        self.num_handoff_hit_blocks += self._reserved_hits.pop(request_id, 0)
        req.append_token(first_token_id, first_logprob)
        if grammar is not None:
            self.grammar.attach(request_id, grammar, req.incarnation)
            req.finish_reason = req.finish_reason or self.grammar.finish_reason(request_id)
        if req.finish_reason is not None:
            self.scheduler.finish(request_id, req.finish_reason)
            return StepOutput(request_id, [], [], req.finish_reason)
        return None
