"""Reservations of a decode worker's KV blocks for prompts prefilled elsewhere.

A booking runs on the engine loop between two steps (LLMEngine.reserve_blocks), retried while the cache has no
room, up to the admission timeout (NoCapacity). Room leaves the running requests what they need to cross their next
block boundary and yields to preempted requests waiting to resume (reserve_blocks' leave_room): under growing
bookings (admission.reserve_output null) a booking that took those blocks made the engine preempt a running stream
at its next block, most often the request that had just joined (the newest), its KV moved here for nothing; now the
booking waits for room instead (streams end and free their blocks), and fails with NoCapacity after the timeout.
The coordinator books early: while the prompt is still being prefilled on
the prefill worker (`book_early`), so when the prefill ends the handoff finds its blocks booked and goes straight
to the pull, instead of first waiting for the decode step under way to end. Owns the early bookings in flight
(request id -> task); the engine owns the blocks. Every early booking ends in exactly one of: `take` (the handoff
uses it), `cancel` (the request ended first: whatever it booked is given back).
A booking carries its launch fence (LLMEngine.launch_fence): the pull into its blocks waits for that, the steps
launched before the booking, not for the decode steps queued on the engine's stream by the time the pull starts.
A booking reuses what this worker's prefix cache holds of the KV (multi-turn chat: the previous turn's prompt and
answer): its table starts with the cached blocks of the longest cached prefix of the tokens (ref counted, as a
prompt's prefix hits are, so nothing evicts them), and only the blocks after them (`Booking.skip` on) are written
from outside; the partial last block always is. The tokens' block hashes are computed here, on the event loop,
not on the engine thread.
A cancelled id is remembered for ENDED_TTL_S: an abort can overtake its request's handoff (the coordinator sends
the abort as the client leaves, the handoff from its own task; and Ray runs an async actor's calls in no guaranteed
order: benchmarks/ray_call_order.py counts up to 5.75% of call pairs run second-first), and a handoff arriving
after it must not book blocks and decode, to max_tokens, a request nobody reads (`take` raises RequestEnded). The
worker asks the same (`ended`) before it prefills or generates a request. A taken id is remembered as long, for the
same reason: an early booking that arrives after its handoff (which booked its own) is not made, where it would
have held its blocks for ever (no abort follows a request that finished).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.core.block_manager import prefix_block_hashes

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import LaunchFence

RESERVE_RETRY_S = 0.01
ENDED_TTL_S = 600.0  # how long an aborted id is refused: far beyond any handoff's delay
ENDED_MAX = 100_000  # and at most this many (the oldest forgotten first)


class RequestEnded(RuntimeError):
    """The request was aborted here before its handoff arrived."""


class NoCapacity(RuntimeError):
    """The worker's KV cache stayed full for the whole admission timeout."""


@dataclass(frozen=True)
class Booking:
    """Blocks booked for KV written from outside, and the fence a write into them waits for on the device."""

    blocks: list[int]
    fence: LaunchFence  # after every step launched before the booking, on every rank
    token_ids: Sequence[int] = ()  # the tokens whose KV the blocks hold (prompt, then prior outputs)
    skip: int = 0  # blocks[:skip] hold their KV already (this worker's prefix cache): only blocks[skip:] are written


class Reservations:
    def __init__(self, loop: AsyncEngine, worker: str, timeout_s: float) -> None:
        self.loop, self.worker, self.timeout_s = loop, worker, timeout_s
        self._early: dict[str, asyncio.Task] = {}
        self._ended = RecentIds()  # cancelled ids
        self._taken = RecentIds()  # ids whose handoff took (or made) their booking

    async def book(self, request_id: str, token_ids: Sequence[int]) -> Booking:
        """The blocks of the KV of `token_ids`, booked under `request_id` (those this worker's prefix cache holds
        shared, not written: Booking.skip); NoCapacity after the timeout."""
        deadline = time.monotonic() + self.timeout_s
        num_tokens = len(token_ids)
        config = self.loop.engine.config
        hashes = prefix_block_hashes(token_ids[:-1], config.block_size) if config.enable_prefix_caching else []

        def reserve(e) -> Booking | None:
            blocks = e.reserve_blocks(request_id, num_tokens, leave_room=True, prefix_hashes=hashes)
            return None if blocks is None else Booking(blocks, e.launch_fence(), token_ids,
                                                       e.reserved_hits(request_id))
        while True:
            booking = await self.loop.call(reserve)
            if booking is not None:
                return booking
            if time.monotonic() > deadline:
                raise NoCapacity(f"decode worker {self.worker}: no room for {num_tokens} tokens of KV within "
                                 f"{self.timeout_s} s")
            await asyncio.sleep(RESERVE_RETRY_S)

    def book_early(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Start booking now, for a `take` later (a second early booking of the same id is ignored, and so is one
        arriving after its request's abort or handoff)."""
        if request_id not in self._early and request_id not in self._ended and request_id not in self._taken:
            self._early[request_id] = asyncio.ensure_future(self.book(request_id, token_ids))

    async def settled(self, request_id: str, token_ids: Sequence[int]) -> Booking:
        """Book early (unless booked already) and wait until the booking is made and its fence has passed on the
        device: from then on the blocks may be written from another process (a pushed handoff) with no ordering
        on this device. The booking stays for `take` (or `cancel`); its NoCapacity is raised here as well."""
        self.book_early(request_id, token_ids)
        task = self._early.get(request_id)
        if task is None:
            why = "handed over" if request_id in self._taken else "aborted"
            raise RequestEnded(f"request {request_id} was {why} before its blocks were booked")
        booking = await asyncio.shield(task)
        if booking.fence.event is not None:
            from kvtransfer.cache import event_done  # torch: this module is imported by the torch-free coordinator

            await event_done(booking.fence.event, time.monotonic() + self.timeout_s, spin_s=0.0)
        return booking

    async def take(self, request_id: str, token_ids: Sequence[int]) -> Booking:
        """The request's early booking once it is made (its NoCapacity raised here), or a booking made now;
        RequestEnded if the request was cancelled first. ValueError (the booking given back by the caller's abort)
        if the early booking was made for other tokens: its shared blocks would hold another prefix's KV."""
        if request_id in self._ended:
            raise RequestEnded(f"request {request_id} was aborted before its handoff arrived")
        self._taken.add(request_id)
        task = self._early.pop(request_id, None)
        if task is None:
            return await self.book(request_id, token_ids)
        booking = await task
        if list(booking.token_ids) != list(token_ids):
            raise ValueError(f"request {request_id!r}: booked for {len(booking.token_ids)} tokens of KV, handed "
                             f"over with {len(token_ids)} other ones")
        return booking

    async def cancel(self, request_id: str) -> bool:
        """End an early booking that no handoff will take, giving back what it booked; False if there is none.
        Either way a handoff of `request_id` arriving later is refused."""
        self._ended.add(request_id)
        task = self._early.pop(request_id, None)
        if task is None:
            return False
        task.cancel()  # from here no booking is made: one still queued on the loop is skipped, no retry runs
        # one made before the cancel landed is freed by this abort, queued before this call first waits, so any
        # engine call reaching the worker after the cancel (an integrity check) finds the blocks given back
        freed = self.loop.submit(lambda e: e.abort(request_id))
        await asyncio.gather(task, return_exceptions=True)
        await freed
        return True

    def ended(self, request_id: str) -> bool:
        """Whether `request_id` was aborted here (within ENDED_TTL_S): a call for it arriving now came too late."""
        return request_id in self._ended

    def __len__(self) -> int:
        return len(self._early)


class RecentIds:
    """Request ids seen lately: each kept ENDED_TTL_S, at most ENDED_MAX of them (the oldest forgotten first)."""

    def __init__(self) -> None:
        self._seen: OrderedDict[str, float] = OrderedDict()  # id -> when, oldest first

    def add(self, request_id: str) -> None:
        now = time.monotonic()
        self._seen[request_id] = now
        self._seen.move_to_end(request_id)
        while self._seen and (len(self._seen) > ENDED_MAX or next(iter(self._seen.values())) < now - ENDED_TTL_S):
            self._seen.popitem(last=False)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._seen
