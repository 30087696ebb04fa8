"""Scheduler: decides, every step, which requests run and how many of their tokens (continuous batching).

Owns the requests' life cycle (waiting -> running -> finished, or pinned for prefill-only requests) and, through
the BlockManager, every block they hold. One rule covers prefill, chunked prefill, decode and recompute: a running
request computes its pending tokens, as many as the step's token budget allows; when it reaches its last token the
runner samples the next one. When blocks run out, a running request is preempted (the worst priority, the most
recently admitted within it: engine.core.waiting.victim): its blocks are freed and it goes back to the front of the
queue to be recomputed (its sampled tokens are kept), or, with a SwapSpace (EngineConfig.preemption_mode swap or
auto), its computed blocks are first copied to host slots (SchedulerOutput.swap_out) and copied back into new
blocks when it is admitted again (swap_in; blocks of its prefix still in the prefix cache are taken, not copied).
The runner executes both before it launches the step (the copies are ordered before any step that reuses the
blocks). With a HostTier (engine.core.host_tier) under the prefix cache, the cached blocks a step's allocations
evicted are copied to it (SchedulerOutput.tier_out) and a request admitted fresh whose prefix runs on past the
device's hits in the host tier has those blocks copied back into its new blocks (tier_in) instead of computed: its
`num_cached_tokens` counts both, `num_restored_tokens` the latter. Waiting requests start in the WaitingQueue's
order, where one that fits may pass a head that does not, for a while (engine.core.waiting).

Overlapped scheduling (`schedule_after`, engine.core.planning_ahead's mixin) plans the step that follows one still
on the device, before its tokens are known; `update` then skips chunks whose request ended meanwhile (`is_current`).

The step's plan and outcome are plain dataclasses (engine.core.step_plan), re-exported here; starting waiting
requests and preempting running ones, with their KV moves, are engine.core.admitting's (a mixin of Scheduler).
Counters (totals since start, read by LLMEngine.load for metrics): preemptions (`preemptions_by_cause`: a decode
row or a prompt chunk needed the blocks), requests started ahead of a waiting head, prefix-cache lookups and hits in
tokens, tokens scheduled (computed on the device) and tokens sampled.
Per request, `first_scheduled_at` (the scheduler's clock when a step first gave it work) lets its worker split the
request's time into waiting and computing (coordinator.observability.phases).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.core.admitting import Admitting
from engine.core.block_manager import BlockManager
from engine.core.host_tier import HostTier
from engine.core.planning_ahead import PlanningAhead, decodes_next
from engine.core.request import Request, RequestStatus, TokenLogprob
from engine.core.step_plan import PENDING_TOKEN, ScheduledChunk, SchedulerOutput, StepOutput
from engine.core.swap_space import SwapSpace
from engine.core.waiting import WaitingQueue, victim
from engine.engine_config import EngineConfig
from engine.load import IterationTokens

__all__ = ["PENDING_TOKEN", "PREEMPTION_CAUSES", "ScheduledChunk", "Scheduler", "SchedulerOutput", "StepOutput"]

PREEMPTION_CAUSES = ("decode", "prompt")  # what needed the blocks: a decode row, or a prompt chunk (or recompute)


class Scheduler(Admitting, PlanningAhead):
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 clock: Callable[[], float] = time.monotonic, max_prefill_chunk: int | None = None,
                 head_bypass_steps: int = EngineConfig.head_bypass_steps, swap: SwapSpace | None = None,
                 tier: HostTier | None = None) -> None:
        self.bm = block_manager
        self.swap = swap  # None: preempted requests are recomputed
        self.tier = tier  # None: no host tier under the prefix cache (the block manager records no evictions)
        self.max_prefill_chunk = max_prefill_chunk or max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # prompt tokens a step may carry beside decode rows (the engine's StepBudget sets it; None: no cap)
        self.prefill_cap: int | None = None
        # requests whose prompt chunks a prefill lane is computing beside the steps (engine.runner.prefill_lane):
        # until the engine applies them, no step plans them, none is preempted, and no step takes prompt tokens
        self.held: set[str] = set()
        self._incarnations = 0  # requests taken so far (Request.incarnation)
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(head_bypass_steps)
        self.running: list[Request] = []
        self.num_updates = 0  # steps applied (update): the waiting head's clock
        # totals since start, for metrics and tests
        self.num_preemptions = 0
        self.preemptions_by_cause = dict.fromkeys(PREEMPTION_CAUSES, 0)
        self.num_prefix_query_tokens = 0  # tokens of requests admitted (each admission looks the cache up)
        self.num_prefix_hit_tokens = 0    # of those, tokens whose KV came from the prefix cache
        self.num_host_hit_tokens = 0      # ... and from the host tier below it (copied back)
        self.num_scheduled_tokens = 0     # tokens planned for the device (prefill chunks, recomputes, decodes)
        self.num_sampled_tokens = 0       # tokens sampled and appended to a request
        self.iteration_tokens = IterationTokens()  # vLLM's tokens per step (engine.load)

    # ---- intake and exits
    def add(self, req: Request) -> None:
        if req.request_id in self.requests or self.bm.has_table(req.request_id):
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self._take(req)
        self.waiting.add(req)

    def add_prefilled(self, req: Request) -> None:
        """Start decoding a request whose KV (prompt and prior outputs) already sits in the blocks reserved under
        its id."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        table = self.bm.table(req.request_id)
        if self.bm.blocks_needed(req.num_tokens) > len(table):
            raise ValueError(f"request {req.request_id!r}: {len(table)} reserved blocks cannot hold "
                             f"{req.num_tokens} tokens of prompt and prior outputs")
        req.num_computed_tokens = req.num_tokens
        req.status = RequestStatus.RUNNING
        # its full blocks join the prefix cache at its first step's update (cache_full_blocks), not here: hashing a
        # 2,048-token prompt's 128 blocks here delayed every handoff's join on an H200 host (docs/benchmark-log.md)
        self._take(req)
        self.running.append(req)

    def _take(self, req: Request) -> None:
        self._incarnations += 1
        req.incarnation = self._incarnations
        self.requests[req.request_id] = req

    def finish(self, request_id: str, reason: str) -> bool:
        """End a request in any state (abort, release of a pinned one), freeing its blocks. False if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        self.bm.free(request_id)
        self._drop_swap(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = req.finish_reason or reason
        return True

    def expired_pins(self) -> list[str]:
        now = self.clock()
        return [r.request_id for r in self.requests.values()
                if r.status == RequestStatus.PINNED and r.pin_deadline is not None and r.pin_deadline <= now]

    def growth_headroom(self) -> int:
        """Blocks the running requests need beyond those they hold to compute their next block_size tokens (each
        crosses its next block boundary; a request's last token, whose KV is never computed, not counted): what a
        reservation from outside should leave free so that no running request is preempted for it soon."""
        bs, need = self.bm.block_size, 0
        for r in self.running:
            last_kv = min(len(r.prompt_token_ids) + r.params.max_tokens, r.max_model_len) - 1
            need += max(0, self.bm.blocks_needed(min(r.num_tokens + bs, last_kv)) - len(self.bm.table(r.request_id)))
        return need

    @property
    def has_paused(self) -> bool:
        """Whether a preempted request waits to resume (its stream paused until blocks free up)."""
        return any(r.num_preemptions > 0 for r in self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        prompt_budget = self._prompt_budget(any(decodes_next(r) for r in self.running))
        scheduled: list[tuple[Request, int]] = []  # (request, tokens granted this step)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_pending_tokens, budget, self.max_prefill_chunk)
            if not decodes_next(req):
                n = min(n, prompt_budget)
                if n <= 0:  # no prompt tokens left for this step: the prompt goes on next step
                    i += 1
                    continue
            cause = "decode" if decodes_next(req) else "prompt"
            while not self.bm.allocate(req.request_id, req.num_computed_tokens + n):
                v = victim([r for r in self.running if r.request_id not in self.held])
                at = self.running.index(v)
                k = next((k for k, (r, _) in enumerate(scheduled) if r is v), None)
                if k is not None:  # planned this step already: its tokens go back to the budgets
                    granted = scheduled.pop(k)[1]
                    budget += granted
                    prompt_budget += 0 if decodes_next(v) else granted
                self._preempt(v, cause, out)
                out.preempted.append(v.request_id)
                if at < i:  # it ran ahead of req: req moved up one
                    i -= 1
                if v is req:
                    break
            else:
                scheduled.append((req, n))
                budget -= n
                prompt_budget -= 0 if decodes_next(req) else n
                i += 1
        if not out.preempted:
            self._admit_waiting(scheduled, min(budget, prompt_budget), swap_in=out.swap_in, tier_in=out.tier_in,
                                restored=out.restored)
        out.chunks = [self._chunk(r, n) for r, n in scheduled]
        self.num_scheduled_tokens += out.num_tokens
        self._offload(out)
        return out

    def update(self, sched: SchedulerOutput, sampled: dict[str, tuple[int, TokenLogprob | None]],
               pin_lease_s: float) -> list[StepOutput]:
        """Advance progress after the runner computed `sched`; `sampled` maps request id -> (token, logprob)."""
        self.num_updates += 1
        outputs = []
        step_tokens = 0  # vLLM's count for the step: tokens sampled, and the prompt of each request's first token
        for chunk in sched.chunks:
            if not self.is_current(chunk):  # ended (or aborted) while this step was on the device
                continue
            req = self.requests[chunk.request_id]
            req.num_computed_tokens += len(chunk.token_ids)
            self.bm.cache_full_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)
            if not chunk.sample:
                continue
            token, logprob = sampled[req.request_id]
            req.append_token(token, logprob)
            self.num_sampled_tokens += 1
            step_tokens += req.num_tokens if len(req.new_output_token_ids) == 1 else 1
            pinned = None
            if req.finish_reason is None and req.prefill_only:
                self.running.remove(req)
                req.status = RequestStatus.PINNED
                req.pin_deadline = self.clock() + pin_lease_s
                pinned = list(self.bm.table(req.request_id))
            first_here = req.num_tokens - len(req.prompt_token_ids) - len(req.prior_output_ids) == 1
            outputs.append(StepOutput(req.request_id, [token], [logprob] if logprob else [],
                                      req.finish_reason, pinned, prefill_only=req.prefill_only,
                                      num_cached_tokens=req.num_cached_tokens if first_here else None))
            if req.finish_reason is not None:
                self.finish(req.request_id, req.finish_reason)
        if step_tokens:
            self.iteration_tokens.observe(step_tokens)
        return outputs

    # ---- internals
    def _prompt_budget(self, decoding: bool) -> int | float:
        """Prompt tokens a step may carry: none while a prefill lane holds a prompt; prefill_cap when it also
        decodes; else no limit beyond the budget."""
        if self.held:
            return 0
        return self.prefill_cap if decoding and self.prefill_cap is not None else float("inf")

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        if req.first_scheduled_at is None:
            req.first_scheduled_at = self.clock()
        start = req.num_computed_tokens
        tokens = req.all_token_ids[start:start + n]
        return ScheduledChunk(req.request_id, tokens, start, list(self.bm.table(req.request_id)),
                              sample=start + n == req.num_tokens, output_index=req.num_output_tokens,
                              incarnation=req.incarnation)
