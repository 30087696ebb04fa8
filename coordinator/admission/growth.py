"""BookingGrowth: decode bookings that grow as their requests decode (`admission.reserve_output: null`, the default).

A request placed on a decode worker books its prompt (and prior outputs) and `admission.reserve_ahead_tokens` of
output (Admission.kv_blocks). As its tokens come back from the worker, its booking grows so that it always covers
what it holds plus reserve_ahead_tokens more, up to max_tokens: `blocks_for(base, outputs)` blocks, the formula
Admission books by. A booking so stays at or above what the request's KV really takes on the worker, so what the
ledger has free is really free; the bookings of one worker may, though, grow past its KV cache together: then
nothing new is admitted there until they shrink (requests end), and its engine preempts the lowest-priority, newest
request when its blocks run out (engine.core.waiting; recomputed later, its stream only pauses).

Every growth goes into the request's own Reservation, so Reservation.release() gives back the grown booking on every
exit path like any other (and a released reservation never grows). Owns one tracked stream per worker-side id (a
single request's attempt, or one choice of a group), from its placement to its end (`track` .. `drop`). Not
thread-safe: the coordinator's event loop only.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.admission.reservation import Reservation


@dataclass
class _Stream:
    reservation: Reservation
    worker: str          # the ledger key of the worker that decodes it
    base_tokens: int     # tokens its blocks hold before its outputs there (prompt and prior outputs; a choice: its
    #                      copy of the prompt's partial block)
    remaining: int       # outputs it may still generate there (max_tokens less the prior ones)
    blocks: int          # booked for it on `worker` so far
    produced: int = 0    # outputs received from the worker


class BookingGrowth:
    def __init__(self, block_size: int, ahead_tokens: int) -> None:
        if block_size < 1 or ahead_tokens < 1:
            raise ValueError(f"block_size and ahead_tokens must be >= 1, got {block_size}, {ahead_tokens}")
        self.block_size = block_size
        self.ahead_tokens = ahead_tokens
        self.grown_blocks = 0  # blocks added to bookings as requests decoded (since start, for metrics)
        self._streams: dict[str, _Stream] = {}

    def blocks_for(self, base_tokens: int, outputs: int) -> int:
        """Blocks booked for `base_tokens` + `outputs` tokens of KV, plus the one the engine keeps ahead."""
        return -(-(base_tokens + outputs) // self.block_size) + 1

    def track(self, stream_id: str, reservation: Reservation, worker: str, base_tokens: int, remaining: int,
              blocks: int) -> None:
        """Start growing `stream_id`'s booking: `blocks` of it on `worker` are booked in `reservation` already."""
        if stream_id in self._streams:
            raise ValueError(f"stream {stream_id!r} is tracked already")
        self._streams[stream_id] = _Stream(reservation, worker, base_tokens, remaining, blocks)

    def advance(self, stream_id: str, num_tokens: int) -> int:
        """`num_tokens` more outputs of `stream_id` came from its worker: book what its booking now lacks; returns
        the blocks booked (0 for an untracked id)."""
        s = self._streams.get(stream_id)
        if s is None or s.reservation.released:
            return 0
        s.produced += num_tokens
        want = self.blocks_for(s.base_tokens, min(s.remaining, s.produced + self.ahead_tokens))
        if want <= s.blocks:
            return 0
        s.reservation.book(s.worker, "kv_blocks", want - s.blocks)
        grown, s.blocks = want - s.blocks, want
        self.grown_blocks += grown
        return grown

    def drop(self, stream_id: str) -> None:
        """Stop tracking (the stream ended; its reservation gives back what it booked)."""
        self._streams.pop(stream_id, None)

    def __len__(self) -> int:
        return len(self._streams)
