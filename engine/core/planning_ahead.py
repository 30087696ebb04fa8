"""Planning the step after one still on the device (overlapped scheduling): a mixin of engine.core.scheduler.Scheduler.

`schedule_after` plans it before the step's tokens are known (a row continuing from a sampled token has a
placeholder input, PENDING_TOKEN, taken from the device), with prompt chunks, joining and newly admitted requests in
it as schedule() would plan them; only blocks running short (preemption) and requests whose steps need their outputs
read at once fall back to schedule(). `is_current` tells a planned chunk that still applies from one whose request
ended meanwhile. Expects the Scheduler's state (requests, running, waiting, the block manager, budgets) and its
_prompt_budget, _chunk, _admit_waiting and _offload.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.core.admitting import plans_alone
from engine.core.request import Request, RequestStatus
from engine.core.step_plan import PENDING_TOKEN, ScheduledChunk, SchedulerOutput

if TYPE_CHECKING:
    from engine.core.block_manager import BlockManager


class PlanningAhead:
    requests: dict[str, Request]
    running: list[Request]
    bm: BlockManager
    max_num_batched_tokens: int
    max_num_seqs: int
    max_prefill_chunk: int
    num_scheduled_tokens: int

    def schedule_after(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """The step after `prev` (on the device, not yet updated), planned as schedule() would plan it once prev's
        tokens are known: a row of prev that samples continues with a decode of the token it is sampling
        (PENDING_TOKEN) unless that token is its last by length; a row computing a prompt chunk without sampling
        gets its next chunk; a running request outside prev joins (its next input token known, or its next prompt
        chunk); waiting requests are admitted into the slots left, counting those that rows ending by length with
        prev give up. A row that then ends on a stop token leaves a wasted row (dropped by update) and a slot
        filled one step later than schedule() would. None where only schedule() may plan: work for a request
        that `_plans_alone`, or blocks running short (only schedule() preempts)."""
        budget = self.max_num_batched_tokens
        prompt_budget = self._prompt_budget(any(c.sample and self.is_current(c) for c in prev.chunks)
                                            or any(decodes_next(r) for r in self.running))
        chunks: list[ScheduledChunk] = []
        in_prev, leaving = set(), 0
        for c in prev.chunks:
            if not self.is_current(c):  # an ended request's row (its id maybe taken again: that request may join)
                continue
            in_prev.add(c.request_id)
            req = self.requests[c.request_id]
            start = c.start_pos + len(c.token_ids)
            if c.sample and (req.prefill_only or self._ends_by_length(c, req)):
                leaving += 1  # pinned or finished by prev's update
                continue
            if plans_alone(req, start):
                return None
            if budget <= 0:
                break  # as in schedule(): later rows wait a step (they join the step after)
            n = 1 if c.sample else min(req.num_tokens - start, budget, self.max_prefill_chunk, prompt_budget)
            if n <= 0:
                continue
            if not self.bm.allocate(req.request_id, start + n):
                return None
            if c.sample:  # a decode of the token prev samples
                tokens, sample, index = [PENDING_TOKEN], True, c.output_index + 1
            else:  # the prompt's next chunk
                tokens, sample, index = req.all_token_ids[start:start + n], start + n == req.num_tokens, c.output_index
            chunks.append(ScheduledChunk(req.request_id, tokens, start, list(self.bm.table(req.request_id)), sample,
                                         index, req.incarnation))
            budget -= n
            prompt_budget -= 0 if c.sample else n
        for req in self.running:
            if req.request_id in in_prev:
                continue
            if plans_alone(req, req.num_computed_tokens):
                return None
            if budget <= 0:
                break
            n = min(req.num_pending_tokens, budget, self.max_prefill_chunk)
            if not decodes_next(req):
                n = min(n, prompt_budget)
                if n <= 0:
                    continue
            if not self.bm.allocate(req.request_id, req.num_computed_tokens + n):
                return None
            chunks.append(self._chunk(req, n))
            budget -= n
            prompt_budget -= 0 if decodes_next(req) else n
        if self.waiting and len(self.running) - leaving < self.max_num_seqs and plans_alone(self.waiting[0], 0):
            return None
        admitted: list[tuple[Request, int]] = []
        swap_in: list[tuple[int, int]] = []
        tier_in: list[tuple[int, int]] = []
        restored: list[str] = []
        self._admit_waiting(admitted, min(budget, prompt_budget), leaving, overlappable_only=True, swap_in=swap_in,
                            tier_in=tier_in, restored=restored)
        chunks += [self._chunk(r, n) for r, n in admitted]
        if not chunks:
            return None
        out = SchedulerOutput(chunks, swap_in=swap_in, tier_in=tier_in, restored=restored)
        self.num_scheduled_tokens += out.num_tokens
        self._offload(out)
        return out

    def plans_alone(self, sched: SchedulerOutput) -> bool:
        """Whether the step after `sched` must wait for `sched`'s tokens to be read (the engine then applies it at
        once instead of overlapping it): some chunk's request `_plans_alone` from where the chunk starts."""
        return any(plans_alone(self.requests[c.request_id], c.start_pos) for c in sched.chunks)

    @staticmethod
    def _ends_by_length(chunk: ScheduledChunk, req: Request) -> bool:
        """Whether the token `chunk` samples is its request's last (max_tokens or the model's length)."""
        end = chunk.start_pos + len(chunk.token_ids)  # the sampled token's position
        return chunk.output_index + 1 >= req.params.max_tokens or end + 1 >= req.max_model_len

    def is_current(self, chunk: ScheduledChunk) -> bool:
        """Whether `chunk` still applies: its request (the one it was planned for, not a later one of the same id)
        runs and has computed exactly the tokens before it."""
        req = self.requests.get(chunk.request_id)
        return (req is not None and req.incarnation == chunk.incarnation and req.status == RequestStatus.RUNNING
                and req.num_computed_tokens == chunk.start_pos)


def decodes_next(req: Request) -> bool:
    """Whether `req`'s next row is a decode (one token after an output), not a prompt chunk."""
    return req.num_pending_tokens == 1 and req.num_output_tokens > 0
