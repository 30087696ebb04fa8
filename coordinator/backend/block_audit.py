"""BlockAudit: /admin/integrity's comparison of what each worker's engine holds with what the coordinator has booked
there; a disagreement that lasts beyond a lease is reported (`mismatches`, and `ok` false) instead of ok.

Two kinds of mismatch, per live worker:
- Held with nothing to explain it. The worker's last load (refreshed every second by the liveness probe, when the
  backend calls `observe()`) shows requests running or waiting there while the coordinator books nothing and runs
  no attempt there; or decode-side reservations (blocks booked for KV being written in) while it books no KV blocks
  there; or pinned prefills while no request is in flight at all. Each is normal for an instant (an abort or a
  release on its way); one that has lasted `grace_s` (transfer.pin_lease_s, which no pin legitimately outlives) is
  reported with its age.
- Pins that outlived their lease. The engine frees a pinned request that nobody released or aborted within
  transfer.pin_lease_s and counts it (check_integrity's `expired_pins`, EngineLoad.expired_pins_total): each one
  is a mismatch that lasted a whole lease (nothing of the coordinator's was still waiting for it, or a transfer
  was slower than the lease and its blocks were freed under it). A report names those that expired since the
  previous report (per worker incarnation), so an operator polling /admin/integrity sees each once; the engines'
  totals stay in the report's `workers` and in /metrics (`pdserve_worker_engine_expired_pins_total`).

Under load a pinned prefill is explained by any request in flight (once its prompt is computed, the coordinator
books nothing on the prefill worker for the pin), so a pin leaked under load shows as an expired pin, a lease later.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from coordinator.admission.reservation import Ledger
from coordinator.admission.router import WorkerState


class BlockAudit:
    def __init__(self, grace_s: float, ledger: Ledger, in_flight: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_s = grace_s
        self._ledger = ledger
        self._in_flight = in_flight  # requests the coordinator has in flight
        self._clock = clock
        self._since: dict[str, float] = {}  # worker key -> when its current unexplained holding was first seen
        self._expired_reported: dict[str, int] = {}  # worker key -> its expired pins named in earlier reports

    def baseline(self, worker: WorkerState, expired_pins: int) -> None:
        """An adopted worker's pins that expired under a dead coordinator are not this one's to report."""
        self._expired_reported[worker.key] = expired_pins

    def forget(self, worker: WorkerState) -> None:
        """A dead incarnation: nothing of it is reported again."""
        self._expired_reported.pop(worker.key, None)
        self._since.pop(worker.key, None)

    def unexplained(self, worker: WorkerState) -> str | None:
        """What `worker`'s last load shows held that the coordinator's books do not explain, or None."""
        load = worker.load
        if load is None:
            return None
        kv_booked = self._ledger.booked(worker.key, "kv_blocks") > 0
        ours = kv_booked or self._ledger.booked(worker.key, "prompt_tokens") > 0 or bool(worker.requests)
        requests = load.num_running + load.num_waiting
        if requests and not ours:
            return f"{requests} requests running or waiting with nothing booked or running there"
        if load.num_reserved and not kv_booked:
            return f"{load.num_reserved} KV reservations with no KV blocks booked there"
        if load.num_pinned and not self._in_flight():
            return f"{load.num_pinned} pinned requests with no request in flight"
        return None

    def observe(self, workers: Iterable[WorkerState]) -> None:
        """Note which live workers hold something unexplained now, and since when (a worker that holds nothing
        unexplained starts afresh)."""
        now = self._clock()
        self._since = {w.key: self._since.get(w.key, now) for w in workers
                       if w.alive and self.unexplained(w) is not None}

    def report(self, workers: list[WorkerState], checks: dict[str, dict]) -> list[str]:
        """The mismatches of the live `workers`, given each one's engine check (`checks`, by worker name)."""
        self.observe(workers)
        now, out = self._clock(), []
        for w in workers:
            what, since = self.unexplained(w), self._since.get(w.key)
            if what is not None and since is not None and now - since >= self.grace_s:
                out.append(f"{w.name}: {what}, for {now - since:.0f} s (past transfer.pin_lease_s, "
                           f"{self.grace_s:g} s)")
            expired = (checks.get(w.name) or {}).get("expired_pins", 0)
            new = expired - self._expired_reported.get(w.key, 0)
            if new > 0:
                out.append(f"{w.name}: {new} pinned requests outlived transfer.pin_lease_s ({self.grace_s:g} s): "
                           "nothing released or aborted them, their lease freed them")
                self._expired_reported[w.key] = expired
        keys = {w.key for w in workers}
        self._expired_reported = {k: v for k, v in self._expired_reported.items() if k in keys}
        return out
