"""Reservation and Ledger: what each request holds in the coordinator's books, and the books themselves.

A worker's capacity is booked by the requests placed on it: KV blocks on the worker that will decode the
request (prompt plus its output budget), prompt tokens on the worker that will prefill it. Every booking belongs
to exactly one Reservation, the request's; `Reservation.release()` gives back everything it still holds, exactly
once, and the request's owner calls it on every exit path (finish, abort, disconnect, timeout, worker death,
exception: it sits in a `finally`). A booking can be given back earlier (`unbook`: the prefill ran, the request
moved to another worker); giving back twice is impossible by construction.

The Ledger keeps, per worker and kind, the sum of its live reservations' bookings; `check_integrity()` recomputes
that sum from the live reservations and asserts the two agree, so a leak is caught by the tests that call it after
every path. A dead worker incarnation's books are `retire`d: kept while they hold anything, and among the
RECENT_RETIRED last retired; older empty ones are dropped, so /admin/integrity does not grow with every restart.
Everything runs on the coordinator's event loop: no locks.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

KINDS = ("kv_blocks", "prompt_tokens")
RECENT_RETIRED = 3  # dead worker incarnations whose books are kept (and shown) once empty


class Ledger:
    def __init__(self, on_release: Callable[[], None] | None = None) -> None:
        self._booked: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(KINDS, 0))
        self._live: dict[int, Reservation] = {}
        self._retired: list[str] = []  # keys of dead incarnations whose books are still kept, oldest first
        self._on_release = on_release  # capacity may have freed: the admission queue looks again

    def open(self, request_id: str) -> Reservation:
        reservation = Reservation(request_id, self)
        self._live[id(reservation)] = reservation
        return reservation

    def booked(self, worker: str, kind: str) -> int:
        return self._booked[worker][kind] if worker in self._booked else 0

    def snapshot(self) -> dict[str, dict[str, int]]:
        """{worker: {kind: booked}} for every live worker that ever had a booking and the retired ones kept."""
        self._prune()
        return {w: dict(kinds) for w, kinds in self._booked.items()}

    def retire(self, worker: str) -> None:
        """`worker` (an incarnation's key) is dead: its books go once empty and older than RECENT_RETIRED others."""
        if worker in self._booked and worker not in self._retired:
            self._retired.append(worker)
        self._prune()

    def _prune(self) -> None:
        older, recent = self._retired[:-RECENT_RETIRED], self._retired[-RECENT_RETIRED:]
        holding = [w for w in older if any(self._booked[w].values())]  # still booked by live reservations
        for w in older:
            if w not in holding:
                del self._booked[w]
        self._retired = holding + recent

    @property
    def live_requests(self) -> int:
        return len(self._live)

    def check_integrity(self) -> dict[str, dict[str, int]]:
        """Assert that every worker's booked amounts equal the sum of the live reservations' bookings."""
        expected: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(KINDS, 0))
        for reservation in self._live.values():
            for (worker, kind), amount in reservation.bookings.items():
                expected[worker][kind] += amount
        for worker in set(expected) | set(self._booked):
            have = self._booked[worker] if worker in self._booked else dict.fromkeys(KINDS, 0)
            want = expected[worker] if worker in expected else dict.fromkeys(KINDS, 0)
            assert have == want, f"ledger of {worker}: booked {have}, live reservations hold {want}"
            assert all(v >= 0 for v in have.values()), f"ledger of {worker} went negative: {have}"
        return self.snapshot()

    def _add(self, worker: str, kind: str, amount: int) -> None:
        self._booked[worker][kind] += amount

    def _closed(self, reservation: Reservation) -> None:
        self._live.pop(id(reservation), None)
        if self._on_release is not None:
            self._on_release()


class Reservation:
    """One request's bookings: {(worker, kind): amount}. Owned by the request's task from admission to its end."""

    def __init__(self, request_id: str, ledger: Ledger) -> None:
        self.request_id = request_id
        self.bookings: dict[tuple[str, str], int] = {}
        self._ledger = ledger
        self._released = False

    def book(self, worker: str, kind: str, amount: int) -> None:
        if self._released:
            raise RuntimeError(f"request {self.request_id}: booking after release")
        if kind not in KINDS or amount < 0:
            raise ValueError(f"cannot book {amount} {kind}")
        self.bookings[(worker, kind)] = self.bookings.get((worker, kind), 0) + amount
        self._ledger._add(worker, kind, amount)

    def unbook(self, worker: str, kind: str) -> int:
        """Give back this request's booking of `kind` on `worker` now (0 if it holds none)."""
        amount = self.bookings.pop((worker, kind), 0)
        if amount:
            self._ledger._add(worker, kind, -amount)
            if self._ledger._on_release is not None:
                self._ledger._on_release()
        return amount

    def clear(self) -> None:
        """Give back every booking but stay open (the request is about to be placed again)."""
        for worker, kind in list(self.bookings):
            self.unbook(worker, kind)

    def holds(self, worker: str, kind: str) -> int:
        return self.bookings.get((worker, kind), 0)

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Give back everything still booked. Idempotent: only the first call does anything."""
        if self._released:
            return
        self._released = True
        for (worker, kind), amount in self.bookings.items():
            self._ledger._add(worker, kind, -amount)
        self.bookings.clear()
        self._ledger._closed(self)
