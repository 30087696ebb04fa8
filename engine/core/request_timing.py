"""RequestTiming: one worker's per-request phase durations, measured on its own clock
(coordinator.observability.phases).

The worker stamps when a request reached it (`received`) and, on the decode side, when its KV landed
(`kv_ready`); it hands over the engine's Request (`attach`), whose `first_scheduled_at` the scheduler stamps on the
same clock (time.monotonic, LLMEngine's default). At the request's first output, `first_output()` turns the stamps
into durations, in time order:
- a request computed here (prefill worker; collocated worker; decode worker recomputing after a failed pull):
  `prefill_queue` (received -> first engine step that runs it) and `prefill_compute` (-> its first token out);
  a request whose prefix was copied back from the host tier (engine.core.host_tier) has `kv_restore` (those
  copies, as the engine timed them: engine.runner.host_tier_store.CopyTimer) taken out of the front of
  prefill_compute;
- a request whose KV was pulled here (decode worker): `kv_transfer` (received -> KV landed: reserving blocks and
  the pull), `decode_join` (-> the first engine step that runs it) and `first_decode_step` (-> its first token out).
  A request may join before its KV is seen to land (a copy the device orders before its first step: decode_pool);
  then decode_join is 0 and first_decode_step runs from the landing, so the phases still add up to the total.
Only durations leave the worker, so clocks of different machines are never compared. An entry ends at the first
output or with `drop()` (abort, failure): nothing is kept for a request that is gone. Used by the worker's event
loop and, inside engine calls (`attach`, `drop`), by its engine thread (engine.async_engine); a request's entry is
touched by one of them at a time (its calls are awaited).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.core.request import Request

Durations = tuple[tuple[str, float], ...]


@dataclass
class _Stamps:
    received_at: float
    request: Request | None = None
    kv_ready_at: float | None = None


class RequestTiming:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._open: dict[str, _Stamps] = {}

    def __len__(self) -> int:
        return len(self._open)

    def received(self, request_id: str) -> None:
        self._open[request_id] = _Stamps(self._clock())

    def kv_ready(self, request_id: str) -> None:
        """The KV landed now (a later call moves the stamp: a provisional one, then the landing)."""
        stamps = self._open.get(request_id)
        if stamps is not None:
            stamps.kv_ready_at = self._clock()

    def attach(self, request_id: str, request: Request | None) -> None:
        """The engine's Request (None if it already ended: its first token was its last)."""
        stamps = self._open.get(request_id)
        if stamps is not None:
            stamps.request = request

    def drop(self, request_id: str) -> None:
        self._open.pop(request_id, None)

    def first_output(self, request_id: str) -> Durations | None:
        """The request's durations, now that its first token is out (None if it is not timed here); ends it."""
        stamps = self._open.pop(request_id, None)
        if stamps is None:
            return None
        now = self._clock()
        scheduled = stamps.request.first_scheduled_at if stamps.request is not None else None
        if stamps.kv_ready_at is None:
            if scheduled is None:  # no step ran it (cannot happen before a first token): nothing to split
                return ()
            queue, compute = ("prefill_queue", scheduled - stamps.received_at), now - scheduled
            timer = stamps.request.restore_timer if stamps.request is not None else None
            if timer is None:
                return queue, ("prefill_compute", compute)
            restore = min(max(timer.seconds(), 0.0), compute)
            return queue, ("kv_restore", restore), ("prefill_compute", compute - restore)
        transfer = ("kv_transfer", stamps.kv_ready_at - stamps.received_at)
        if scheduled is None:  # ended as it joined (its first token ended it): no decode step ran
            return transfer, ("decode_join", now - stamps.kv_ready_at)
        joined = max(scheduled, stamps.kv_ready_at)
        return transfer, ("decode_join", joined - stamps.kv_ready_at), ("first_decode_step", now - joined)
