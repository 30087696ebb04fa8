"""Reservations of a decode worker's KV blocks for prompts prefilled elsewhere.

A booking runs on the engine loop between two steps (LLMEngine.reserve_blocks), retried while the cache is full,
up to the admission timeout (NoCapacity). The coordinator books early: while the prompt is still being prefilled on
the prefill worker (`book_early`), so when the prefill ends the handoff finds its blocks booked and goes straight
to the pull, instead of first waiting for the decode step under way to end. Owns the early bookings in flight
(request id -> task); the engine owns the blocks. Every early booking ends in exactly one of: `take` (the handoff
uses it), `cancel` (the request ended first: whatever it booked is given back).
"""

from __future__ import annotations

import asyncio
import time

from engine.async_engine import AsyncEngine

RESERVE_RETRY_S = 0.01


class NoCapacity(RuntimeError):
    """The worker's KV cache stayed full for the whole admission timeout."""


class Reservations:
    def __init__(self, loop: AsyncEngine, worker: str, timeout_s: float) -> None:
        self.loop, self.worker, self.timeout_s = loop, worker, timeout_s
        self._early: dict[str, asyncio.Task] = {}

    async def book(self, request_id: str, num_tokens: int) -> list[int]:
        """The blocks of `num_tokens` tokens of KV, booked under `request_id`; NoCapacity after the timeout."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            blocks = await self.loop.call(lambda e: e.reserve_blocks(request_id, num_tokens))
            if blocks is not None:
                return blocks
            if time.monotonic() > deadline:
                raise NoCapacity(f"decode worker {self.worker}: no room for {num_tokens} tokens of KV within "
                                 f"{self.timeout_s} s")
            await asyncio.sleep(RESERVE_RETRY_S)

    def book_early(self, request_id: str, num_tokens: int) -> None:
        """Start booking now, for a `take` later (a second early booking of the same id is ignored)."""
        if request_id not in self._early:
            self._early[request_id] = asyncio.ensure_future(self.book(request_id, num_tokens))

    async def take(self, request_id: str, num_tokens: int) -> list[int]:
        """The request's early booking once it is made (its NoCapacity raised here), or a booking made now."""
        task = self._early.pop(request_id, None)
        if task is None:
            return await self.book(request_id, num_tokens)
        return await task

    async def cancel(self, request_id: str) -> bool:
        """End an early booking that no handoff will take, giving back what it booked; False if there is none."""
        task = self._early.pop(request_id, None)
        if task is None:
            return False
        task.cancel()  # a booking still queued on the loop is then never made
        await asyncio.gather(task, return_exceptions=True)
        # one made before the cancel landed is freed here: this call runs on the loop after the booking's
        await self.loop.call(lambda e: e.abort(request_id))
        return True

    def __len__(self) -> int:
        return len(self._early)
