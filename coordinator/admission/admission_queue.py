"""AdmissionQueue: the asyncio waiting room in front of scarce capacity (KV blocks, prefill backlog, workers).

Owns only the order in which waiting requests get to take capacity, never the capacity itself: the caller's
`try_take()` looks and books, returning what it booked or None. The rules:

- Order: lower priority number first (0 = the coordinator's own, e.g. migrations; tenants' classes are 1..3, see
  coordinator.admission.tenants), FIFO within a priority. Aging: a waiter's effective priority improves by one every
  `aging_s` seconds waited (by the injected clock), down to `best`, so no priority starves forever; waiters of
  equal effective priority go in arrival order, so an aged waiter goes before newer ones of the class it reached.
- The head, and who may pass it: the best waiter is asked first. When its try_take() returns None, waiters of its
  own (effective) priority behind it may take what it cannot use (up to BYPASS_SCAN of them, in their order) while
  the head has waited less than `bypass_s`: a small request need not wait behind a large one of its class for room
  it does not need. A waiter of a lower class never passes a higher one. Once the head
  has waited `bypass_s`, nobody passes it: what frees stays free until the head fits, so a stream of small requests
  cannot starve a large one (a reservation for the head). `bypass_s` 0 is strict head of line. The caller refuses,
  before queueing, anything that can never fit.
- try_take() runs only inside the queue's own wake pass, synchronously, for a live waiter whose future is then
  resolved at once, so a waiter that timed out or was cancelled is never asked. The one remaining race (the task
  is cancelled after the grant and before it resumes) hands the result to `release` and re-raises: nothing taken
  is ever lost. A try_take() that raises fails only its own waiter; the pass goes on.
- A wake pass runs on `notify()` (capacity may have freed), on every arrival, and when a waiter leaves. Deadlines
  fire from the event loop's timer whether or not notify() is called, and a pass also expires every waiter whose
  deadline has passed by the queue's clock (so tests can drive time with a fake clock).

Cost: a pass looks at one head per distinct priority (a handful) and pops granted waiters in O(1), and while a
head may be passed, asks at most BYPASS_SCAN waiters per priority behind it; deadlines are a heap. Removed waiters
are dropped lazily and compacted once they outnumber the live ones. Not thread-safe: use it from the event loop's
thread only.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")
BYPASS_SCAN = 16  # waiters per priority asked behind a head that does not fit (while it may be passed)


class AdmissionTimeout(Exception):
    """A waiter's deadline passed before its turn came (the caller turns it into a 503 with its reason)."""


class _Waiter:
    __slots__ = ("priority", "seq", "enqueued", "deadline", "future", "try_take", "timer", "live")

    def __init__(self, priority: int, seq: int, enqueued: float, deadline: float, future: asyncio.Future,
                 try_take: Callable[[], Any]) -> None:
        self.priority = priority
        self.seq = seq
        self.enqueued = enqueued
        self.deadline = deadline
        self.future = future
        self.try_take = try_take
        self.timer: asyncio.TimerHandle | None = None
        self.live = True


class AdmissionQueue(Generic[T]):
    def __init__(self, aging_s: float, clock: Callable[[], float] = time.monotonic, best: int = 0,
                 timeout_error: type[Exception] = AdmissionTimeout,  # raised as timeout_error()
                 bypass_s: float = 0.0) -> None:
        if isinstance(aging_s, bool) or not isinstance(aging_s, (int, float)) or not aging_s > 0:
            raise ValueError(f"AdmissionQueue.aging_s must be a positive number, got {aging_s!r}")
        if isinstance(best, bool) or not isinstance(best, int):
            raise ValueError(f"AdmissionQueue.best must be an int, got {best!r}")
        if isinstance(bypass_s, bool) or not isinstance(bypass_s, (int, float)) or not bypass_s >= 0:
            raise ValueError(f"AdmissionQueue.bypass_s must be a number >= 0, got {bypass_s!r}")
        self.aging_s = float(aging_s)
        self.bypass_s = float(bypass_s)  # how long a head that does not fit may be passed
        self.bypassed = 0  # grants that passed a waiting head (for metrics)
        self.best = best                  # aging never lifts a waiter above this priority
        self._clock = clock
        self._timeout_error = timeout_error
        self._seq = itertools.count()
        self._queues: dict[int, deque[_Waiter]] = {}   # base priority -> waiters in arrival order (some dead)
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._counts: dict[int, int] = {}               # base priority -> live waiters
        self._live = 0
        self._entries = 0                               # waiters in _queues, live or dead
        self._waking = False
        self._again = False

    def __len__(self) -> int:
        return self._live

    def waiting_by_priority(self) -> dict[int, int]:
        """Live waiters per (base, not aged) priority, for metrics."""
        return {p: n for p, n in sorted(self._counts.items()) if n}

    def effective_priority(self, priority: int, waited_s: float) -> int:
        if priority <= self.best:
            return priority
        return max(self.best, priority - int(max(0.0, waited_s) // self.aging_s))

    async def acquire(self, priority: int, deadline: float, try_take: Callable[[], T | None],
                      release: Callable[[T], None] | None = None) -> T:
        """Wait for this request's turn and return try_take()'s first non-None result. Raises the timeout error
        once `deadline` (on the queue's clock) passes first. If the calling task is cancelled after the grant but
        before it resumes, the result goes to `release` (when given; otherwise try_take must have booked into
        something the caller releases on cancellation) and the cancellation propagates."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {priority!r}")
        loop = asyncio.get_running_loop()
        now = self._clock()
        waiter = _Waiter(priority, next(self._seq), now, float(deadline), loop.create_future(), try_take)
        self._queues.setdefault(priority, deque()).append(waiter)
        heapq.heappush(self._deadlines, (waiter.deadline, waiter.seq, waiter))
        self._counts[priority] = self._counts.get(priority, 0) + 1
        self._live += 1
        self._entries += 1
        self._wake()
        if not waiter.future.done():
            waiter.timer = loop.call_later(max(0.0, waiter.deadline - now), self._on_deadline, waiter)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            fut = waiter.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                if release is not None:
                    release(fut.result())
            self._leave(waiter)
            self._wake()  # it may have been the head that blocked the rest, or it just gave capacity back
            raise

    def notify(self) -> None:
        """Capacity may have freed: let waiters take it, best first."""
        self._wake()

    # ---- internals
    def _leave(self, waiter: _Waiter) -> None:
        """Take a waiter out of the counts (its entries in the deque and deadline heap go lazily)."""
        if not waiter.live:
            return
        waiter.live = False
        self._live -= 1
        self._counts[waiter.priority] -= 1
        if waiter.timer is not None:
            waiter.timer.cancel()
            waiter.timer = None

    def _fail(self, waiter: _Waiter, error: BaseException) -> None:
        self._leave(waiter)
        if not waiter.future.done():
            waiter.future.set_exception(error)

    def _on_deadline(self, waiter: _Waiter) -> None:
        waiter.timer = None
        if waiter.live and not waiter.future.done():
            self._fail(waiter, self._timeout_error())
            self._wake()

    def _head(self, priority: int) -> _Waiter | None:
        queue = self._queues[priority]
        while queue and (not queue[0].live or queue[0].future.done()):
            self._leave(queue.popleft())  # a cancelled waiter whose task has not run its handler yet
            self._entries -= 1
        if not queue:
            del self._queues[priority]
            return None
        return queue[0]

    def _best(self, now: float) -> _Waiter | None:
        best: _Waiter | None = None
        best_key: tuple[int, int] = (0, 0)
        for priority in list(self._queues):
            head = self._head(priority)
            if head is None:
                continue
            key = (self.effective_priority(priority, now - head.enqueued), head.seq)
            if best is None or key < best_key:
                best, best_key = head, key
        return best

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            waiter = heapq.heappop(self._deadlines)[2]
            if waiter.live and not waiter.future.done():
                self._fail(waiter, self._timeout_error())

    def _wake(self) -> None:
        if self._waking:  # try_take() or a release called notify(): go round once more when this pass ends
            self._again = True
            return
        self._waking = True
        try:
            again = True
            while again:
                self._again = False
                now = self._clock()
                self._expire(now)
                while (waiter := self._best(now)) is not None:
                    try:
                        result = waiter.try_take()
                    except Exception as e:  # it fails this waiter's request, not the queue
                        self._fail(waiter, e)
                        continue
                    if result is None:
                        if now - waiter.enqueued < self.bypass_s:
                            self._pass(waiter, now)
                        break  # the head waits: nobody else is asked until it fits or may be passed
                    self._leave(waiter)
                    waiter.future.set_result(result)
                again = self._again
            self._compact()
        finally:
            self._waking = False

    def _pass(self, head: _Waiter, now: float) -> None:
        """Ask the waiters of the head's effective priority behind `head` (BYPASS_SCAN per base priority, in order) to
        take what it cannot use."""
        level = self.effective_priority(head.priority, now - head.enqueued)
        behind = []
        for priority, queue in self._queues.items():
            taken = 0
            for w in queue:
                if taken == BYPASS_SCAN:
                    break
                if w is head or not w.live or w.future.done():
                    continue
                key = (self.effective_priority(priority, now - w.enqueued), w.seq)
                if key[0] <= level:
                    behind.append((key, w))
                    taken += 1
        for _, w in sorted(behind, key=lambda pair: pair[0]):
            try:
                result = w.try_take()
            except Exception as e:  # it fails this waiter's request, not the queue
                self._fail(w, e)
                continue
            if result is not None:
                self._leave(w)
                self.bypassed += 1
                w.future.set_result(result)

    def _compact(self) -> None:
        if self._entries + len(self._deadlines) <= 4 * self._live + 256:
            return
        for priority in list(self._queues):
            self._queues[priority] = deque(w for w in self._queues[priority] if w.live)
            if not self._queues[priority]:
                del self._queues[priority]
        self._entries = sum(len(q) for q in self._queues.values())
        self._deadlines = [entry for entry in self._deadlines if entry[2].live]
        heapq.heapify(self._deadlines)
        self._counts = {p: n for p, n in self._counts.items() if n}
