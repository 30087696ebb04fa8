"""Admitting: how the Scheduler (engine.core.scheduler) starts waiting requests and sends running ones back, with the
KV moves each needs; a mixin of Scheduler, whose state it works on.

- `_admit_waiting`: start waiting requests in queue order while the step's budget, the slots and the blocks allow:
  a fresh request's prefix found in the device's prefix cache is shared, the run after it found in the host tier is
  copied back (tier_in), a swapped-out request's own blocks come back from the host (swap_in).
- `_preempt`: a running request goes back to the queue's front, its KV swapped out (SwapSpace) or dropped.
- `_offload`: the cached blocks a step's allocations evicted go to the host tier (tier_out).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.core.block_manager import prefix_block_hashes
from engine.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.core.block_manager import BlockManager
    from engine.core.host_tier import HostTier
    from engine.core.step_plan import SchedulerOutput
    from engine.core.swap_space import SwapSpace
    from engine.core.waiting import WaitingQueue


class Admitting:
    """Scheduler's admissions and preemptions (see the module)."""

    # Scheduler's, set in its __init__
    bm: BlockManager
    swap: SwapSpace | None
    tier: HostTier | None
    waiting: WaitingQueue
    running: list[Request]
    max_num_seqs: int
    max_prefill_chunk: int
    num_updates: int
    num_preemptions: int
    preemptions_by_cause: dict[str, int]
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int
    num_host_hit_tokens: int
    clock: Callable[[], float]

    def _admit_waiting(self, scheduled: list[tuple[Request, int]], budget: int, leaving: int = 0,
                       overlappable_only: bool = False, *, swap_in: list[tuple[int, int]],
                       tier_in: list[tuple[int, int]], restored: list[str]) -> None:
        """Start waiting requests in queue order while the budget, the slots (`leaving` of the running ones are
        about to end) and the blocks allow; with `overlappable_only`, stop at one schedule_after may not plan (or
        skip it, behind a head). A head short of blocks may be passed by requests of its priority that fit
        (WaitingQueue.head_blocked). A swapped-out request resumes where it stopped: the copies of its blocks
        back from the host go to `swap_in`; a fresh one's blocks restored from the host tier, to `tier_in`."""
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) - leaving < self.max_num_seqs:
            if not self.waiting.may_try(i):
                break
            req = self.waiting[i]
            if overlappable_only and plans_alone(req, 0):
                if i == 0:
                    break
                i += 1
                continue
            swapped = req.swap_slots is not None
            fresh = req.num_computed_tokens == 0 and req.params.prompt_logprobs is None  # cached KV has no logits
            hashes = prefix_block_hashes(req.all_token_ids[:-1], self.bm.block_size) if (
                (fresh or swapped) and self.bm.enable_prefix_caching) else []
            prefix = self.bm.cached_blocks(hashes)
            if swapped:  # its own KV comes back from the host; what the prefix cache still holds is not copied
                prefix = prefix[:req.num_computed_tokens // self.bm.block_size]
            on_host = self.tier.find(hashes[len(prefix):]) if self.tier is not None and fresh else []
            if on_host:  # copied back only where that beats computing them (engine.core.copy_cost)
                on_host = self.tier.worth_restoring(on_host, self.bm.block_size)
            device_tokens = len(prefix) * self.bm.block_size
            cached_tokens = req.num_computed_tokens if swapped else device_tokens + len(on_host) * self.bm.block_size
            n = min(req.num_tokens - cached_tokens, budget, self.max_prefill_chunk)
            if not self.bm.allocate(req.request_id, cached_tokens + n, prefix):
                if i == 0 and not self.waiting.head_blocked(self.num_updates):
                    break
                i += 1
                continue
            self.waiting.take(i)
            if swapped:
                self._swap_in(req, len(prefix), swap_in)
            else:
                if self.tier is not None and fresh:
                    slots = self.tier.take(hashes[len(prefix):len(prefix) + len(on_host)], len(hashes) - len(prefix))
                    tier_in += zip(slots, self.bm.table(req.request_id)[len(prefix):len(prefix) + len(slots)],
                                   strict=True)
                    if slots:
                        restored.append(req.request_id)
                if req.num_preemptions == 0:
                    req.num_cached_tokens = cached_tokens
                    req.num_restored_tokens = cached_tokens - device_tokens
                self.num_prefix_query_tokens += req.num_tokens
                self.num_prefix_hit_tokens += device_tokens
                self.num_host_hit_tokens += cached_tokens - device_tokens
            req.num_computed_tokens = cached_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n

    def _preempt(self, req: Request, cause: str, out: SchedulerOutput) -> None:
        """Send a running request back to the queue's front: its KV swapped out (where the SwapSpace takes it) or
        dropped, to be recomputed."""
        self.running.remove(req)
        blocks = self.bm.blocks_needed(req.num_computed_tokens)
        slots = None
        if self.swap is not None and blocks and self.swap.wants_swap(req.num_computed_tokens, blocks):
            slots = self.swap.take(blocks)
        if slots is not None:  # copied out before the step that may reuse its blocks (SchedulerOutput.swap_out)
            out.swap_out += zip(self.bm.table(req.request_id)[:blocks], slots, strict=True)
            req.swap_slots = slots
            self.swap.num_swapped_out += 1
            self.swap.blocks_out += blocks
        else:
            req.num_computed_tokens = 0
        self.bm.free(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.preemptions_by_cause[cause] += 1
        self.waiting.push_front(req)

    def _swap_in(self, req: Request, num_prefix: int, swap_in: list[tuple[int, int]]) -> None:
        """Queue the copies of `req`'s swapped-out blocks back into its new table (all but the first
        `num_prefix`, taken from the prefix cache) and free its host slots (a later copy out into one is ordered
        after these copies)."""
        slots = req.swap_slots
        table = self.bm.table(req.request_id)
        pairs = list(zip(slots[num_prefix:], table[num_prefix:len(slots)], strict=True))
        swap_in += pairs
        self.swap.give_back(slots)
        self.swap.num_swapped_in += 1
        self.swap.blocks_in += len(pairs)
        req.swap_slots = None

    def _offload(self, out: SchedulerOutput) -> None:
        """The cached blocks this step's allocations evicted go to the host tier, copied before the step writes them
        (SchedulerOutput.tier_out)."""
        if self.tier is not None:
            out.tier_out = self.tier.store(self.bm.take_evicted())

    def _drop_swap(self, req: Request) -> None:
        if req.swap_slots is not None:
            self.swap.give_back(req.swap_slots)
            req.swap_slots = None


def plans_alone(req: Request, start: int) -> bool:
    """Whether a step giving `req` work from position `start` must be planned by schedule(), after the step before
    it was read (Scheduler.schedule_after): prefill-only requests (pinned at their first token), fork groups and
    chunks whose prompt logprobs are wanted (step extras, engine.runner.step_extras)."""
    return (req.prefill_only or req.fork_params is not None
            or (req.params.prompt_logprobs is not None and start + 1 < len(req.prompt_token_ids)))
