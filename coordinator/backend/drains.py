"""Drains: an operator takes one worker out of routing while the rest keep serving (`POST
/admin/workers/{name}/drain` and `/undrain`, coordinator.api.admin).

Owns which worker slots are drained, by slot name: "draining" from the drain call until nothing routed to the worker
is left on it, then "drained". Neither gets new work: no new request, no request moving off a dead worker, no group,
and in mode adaptive the planner neither routes to it nor changes its role (it sees only `undrained()` workers; an
operator's role change is refused too); what already runs there goes on to its end. Drained means: no attempt of a
request runs there (WorkerState.requests), nothing is booked on it in the ledger, and its engine, asked afresh,
reports nothing waiting, running, pinned or reserved (a dead slot has nothing running: drained too).

A drain is refused (`DrainRefused`, a 409 at the HTTP edge) when the worker is the last live, undrained one that can
do its pool's work (decode; in mode disaggregated also prefill): the server would stop serving. An undrain puts it
back in routing at once, a draining one included.

Death: the drain belongs to the slot, not the incarnation. A drained worker that dies (a crash, a failed probe, a
killed tensor-parallel rank) is replaced as any other and its replacement comes back drained: it was taken out on
purpose, and a bad GPU must not return by crashing. A restart through `POST /admin/workers/{name}/kill` is the
operator's own act (drain, wait for "drained", kill: a rolling restart's step), so it ends the drain: the
replacement serves (`restarted()`).

`live(role)`, `roles`, `workers(role)` and `down_reason(role)` are the pools as Admission sees them (its Workers
protocol): the Supervisor's live workers less the drained ones. `healthy()` and `states()` are /health's: healthy
while every pool has a live undrained worker; each drained slot's entry has `"drain": "draining" | "drained"`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ray.exceptions import RayActorError, RayTaskError

from coordinator.admission.reservation import Ledger
from coordinator.admission.router import WorkerState
from coordinator.backend.pools import Pools
from coordinator.backend.supervisor import PROBE_TIMEOUT_S, Supervisor

log = logging.getLogger("pdserve")
POLL_S = 0.25  # how often a draining worker is looked at
DRAIN_STATES = ("draining", "drained")


class DrainRefused(ValueError):
    """Draining the worker would leave a pool with no live worker to route to."""


class Drains:
    def __init__(self, pools: Pools, supervisor: Supervisor, ledger: Ledger, on_change: Callable[[], None]) -> None:
        self.pools, self.supervisor, self.ledger = pools, supervisor, ledger
        self._on_change = on_change  # routing changed: waiting requests look again
        self._states: dict[str, str] = {}  # slot name -> one of DRAIN_STATES
        self._tasks: dict[str, asyncio.Task] = {}

    def state(self, name: str) -> str | None:
        return self._states.get(name)

    # ---- the pools as routing sees them (Admission's Workers protocol, the planner's list, /health)
    @property
    def roles(self) -> tuple[str, ...]:
        return self.supervisor.roles

    def workers(self, role: str) -> list[WorkerState]:
        return self.supervisor.workers(role)

    def live(self, role: str) -> list[WorkerState]:
        return [w for w in self.supervisor.live(role) if w.name not in self._states]

    def given_up(self, role: str) -> bool:
        return self.supervisor.given_up(role)

    def down_reason(self, role: str) -> str | None:
        reason = self.supervisor.down_reason(role)
        if reason is None and not self.live(role):
            drained = ", ".join(f"{w.name} {self._states[w.name]}" for w in self.supervisor.live(role))
            return f"every live {role} worker is drained ({drained})"
        return reason

    def undrained(self) -> list[WorkerState]:
        """Every worker slot's current incarnation but the drained ones (what the adaptive planner may change)."""
        return [w for w in self.pools.all_workers if w.name not in self._states]

    def healthy(self) -> bool:
        return all(self.live(role) for role in self.roles)

    def states(self) -> list[dict]:
        return [s | {"drain": self._states[s["name"]]} if s["name"] in self._states else s
                for s in self.supervisor.states()]

    # ---- operators
    def drain(self, name: str, force: bool = False) -> str | None:
        """Take worker `name` out of routing; its state ("draining", or "drained" once nothing runs there), None if
        no worker has that name. DrainRefused if it is the last live undrained worker that can do a pool's work,
        unless `force` (a restart that accepted the pause: coordinator.backend.cycling)."""
        worker = self._slot(name)
        if worker is None:
            return None
        if name in self._states:
            return self._states[name]
        for role in () if force else self.roles:
            live = self.live(role)
            if len(live) == 1 and live[0] is worker:
                raise DrainRefused(f"{name} is the last live worker that can {role}: draining it would leave none "
                                   f"to {role} (undrain or add another first)")
        self._states[name] = "draining"
        log.warning("worker %s: draining (no new work; %d requests running there)", name, len(worker.requests))
        self._tasks[name] = asyncio.get_running_loop().create_task(self._settle(name))
        return "draining"

    def undrain(self, name: str, why: str = "undrained through the admin API") -> bool | None:
        """Put worker `name` back in routing: whether it was drained or draining; None if no worker has that name."""
        if self._slot(name) is None:
            return None
        state = self._states.pop(name, None)
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()
        if state is None:
            return False
        log.warning("worker %s: back in routing (%s)", name, why)
        self._on_change()
        return True

    def restarted(self, name: str) -> None:
        """Worker `name` was killed on purpose to be replaced (the admin API's kill): its replacement serves."""
        if name in self._states:
            self.undrain(name, "restarted through the admin API")

    def forget(self, name: str) -> None:
        """Slot `name` left its pool (a scale-in, coordinator.backend.scaler): its drain ends with it."""
        self._states.pop(name, None)
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()

    async def shutdown(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    # ---- internals
    def _slot(self, name: str) -> WorkerState | None:
        return next((w for w in self.pools.all_workers if w.name == name), None)

    async def _settle(self, name: str) -> None:
        """Mark `name` drained once nothing routed to it is left there."""
        while self._states.get(name) == "draining":
            worker = self._slot(name)
            if worker is None or not worker.alive or (not self._in_flight(worker) and await self._idle(worker)
                                                      and not self._in_flight(worker)):
                if self._states.get(name) == "draining":
                    self._states[name] = "drained"
                    log.warning("worker %s: drained (nothing runs there; no new work until it is undrained)", name)
                return
            await asyncio.sleep(POLL_S)

    def _in_flight(self, worker: WorkerState) -> bool:
        """Whether a request routed to `worker` is still under way there, as the coordinator's books say."""
        return bool(worker.requests) or any(self.ledger.booked(worker.key, kind) for kind in ("kv_blocks",
                                                                                               "prompt_tokens"))

    @staticmethod
    async def _idle(worker: WorkerState) -> bool:
        """Whether the worker's engine, asked now, holds no request: none waiting, running, pinned or reserved."""
        try:
            load = await asyncio.wait_for(worker.handle.load.remote(), PROBE_TIMEOUT_S)
        except (RayActorError, RayTaskError, TimeoutError):
            return False  # dead or busy: the next look (or the Supervisor) tells
        return not (load.num_waiting or load.num_running or load.num_pinned or load.num_reserved)
