"""Cycling: replacing live workers on purpose, one at a time, while the rest serve (a rolling restart, a straggler).

Owns the one-worker step and the rolling restart built from it. A step (`cycle`): drain the worker
(coordinator.backend.drains: no new work routed to it), wait until nothing routed to it is left there (or, after
`drain_timeout_s`, go on: what still runs there then moves to another worker as off a dead one, with no token lost
or repeated), replace it (Supervisor.restart: a new actor in the same slot, at once, not counted against
recovery.max_restarts), wait until the new incarnation is live and serving, and route to it again. One step runs
at a time (a lock): two workers out at once could leave a pool empty.

A worker that is the last live one able to do its pool's work cannot be drained without stopping that work: the
step refuses it (`CycleRefused`, a 409 at the HTTP edge) unless `allow_pause`, and then the pause is stated:
new requests for that pool wait in admission (up to admission.timeout_s) while it restarts (in mode disaggregated
with recovery.fallback, they run whole on the other pool's workers meanwhile).

`RollingRestart` cycles every worker slot in turn (prefill slots first, then decode) in a background task; its
`status()` is what GET /admin/workers/restart shows: state ("running", "done", "failed"), the slot being cycled,
those done with their old and new pids, and each pause stated.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from dataclasses import dataclass, field

from coordinator.admission.router import WorkerState
from coordinator.backend.drains import Drains
from coordinator.backend.pools import START_TIMEOUT_S, Pools
from coordinator.backend.supervisor import Supervisor

log = logging.getLogger("pdserve")
POLL_S = 0.1


class CycleRefused(ValueError):
    """The worker cannot be taken out without stopping its pool's work, and no pause was allowed."""


class CycleFailed(RuntimeError):
    """The replacement did not come up (its slot failed or the start timed out)."""


@dataclass
class Step:
    """One worker's cycle, as reported."""

    worker: str
    old_pid: int
    new_pid: int | None = None
    moved: int = 0           # requests still there after drain_timeout_s, moved to other workers
    pause: str | None = None  # stated when the worker was the last of its pool
    seconds: float = 0.0


class Cycler:
    def __init__(self, pools: Pools, supervisor: Supervisor, drains: Drains) -> None:
        self.pools, self.supervisor, self.drains = pools, supervisor, drains
        self.lock = asyncio.Lock()

    def lone_roles(self, name: str) -> list[str]:
        """The pools worker `name` is the last live undrained worker of (draining it would stop their work)."""
        return [role for role in self.drains.roles
                if [w.name for w in self.drains.live(role)] == [name]]

    async def cycle(self, name: str, why: str, drain_timeout_s: float, allow_pause: bool = False,
                    key: str | None = None) -> Step:
        """Drain, empty, replace and undrain live worker `name` (`key`: only that incarnation). CycleRefused: it is
        the last of a pool and `allow_pause` is false; CycleFailed: it is not live (or replaced since), or no
        replacement came up."""
        async with self.lock:
            worker = self._live(name)
            if worker is None or (key is not None and worker.key != key):
                raise CycleFailed(f"{name} is not live, or was replaced since (a dead slot is being replaced already, "
                                  "or gave up)")
            lone = self.lone_roles(name)
            if lone and not allow_pause:
                raise CycleRefused(f"{name} is the only live worker that can {' or '.join(lone)}: restarting it "
                                   f"pauses that work (allow it with allow_pause: true)")
            step = Step(name, worker.info.pid)
            if lone:
                step.pause = (f"{name} is the only live worker that can {' or '.join(lone)}: new requests needing "
                              f"it wait in admission (up to admission.timeout_s) until its replacement serves")
                log.warning("cycling %s: %s", name, step.pause)
            started = time.monotonic()
            self.drains.drain(name, force=bool(lone))
            deadline = started + drain_timeout_s
            while self.drains.state(name) != "drained" and time.monotonic() < deadline:
                await asyncio.sleep(POLL_S)
            step.moved = len(worker.requests)  # still there: they move as off a dead worker
            old = self.supervisor.restart(name, why)
            self.drains.restarted(name)  # a dead slot is never routed to; its replacement is, once live
            if old is None:  # it died meanwhile: the Supervisor replaces it anyway
                old = worker
            new = await self._replacement(name, old.incarnation)
            step.new_pid, step.seconds = new.info.pid, time.monotonic() - started
            log.warning("cycled %s (%s): pid %d -> %d in %.1f s, %d requests moved", name, why, step.old_pid,
                        step.new_pid, step.seconds, step.moved)
            return step

    def _live(self, name: str) -> WorkerState | None:
        return next((w for w in self.pools.all_workers if w.name == name and w.alive), None)

    async def until_live(self, name: str) -> WorkerState:
        """Slot `name`'s incarnation once it is live (at once if it is)."""
        return await self._replacement(name, -1)

    async def _replacement(self, name: str, old_incarnation: int) -> WorkerState:
        """The slot's next incarnation (after `old_incarnation`) once it is live."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            slot = next((w for w in self.pools.all_workers if w.name == name), None)
            if slot is None:
                raise CycleFailed(f"{name} was removed: its pool shrank (coordinator.backend.scaler)")
            if slot.incarnation > old_incarnation and slot.alive:
                return slot
            if slot.state == "failed":
                raise CycleFailed(f"{name}'s replacement did not come up: {self.supervisor.gave_up.get(name)}")
            await asyncio.sleep(POLL_S)
        raise CycleFailed(f"{name}'s replacement was not live within {START_TIMEOUT_S:.0f} s")


@dataclass
class RollingRestart:
    """Every slot cycled in turn, in a background task; one at a time per server."""

    cycler: Cycler
    state: str = "idle"  # "idle" | "running" | "done" | "failed"
    current: str | None = None
    steps: list[Step] = field(default_factory=list)
    error: str | None = None
    _task: asyncio.Task | None = None

    def start(self, drain_timeout_s: float, allow_pause: bool) -> list[str]:
        """Begin restarting every worker; the order. CycleRefused (before anything is touched) when a worker is
        the last of its pool and `allow_pause` is false, or a rolling restart is already running."""
        if self.state == "running":
            raise CycleRefused("a rolling restart is already running (GET /admin/workers/restart shows it)")
        order = [w.name for w in self.cycler.pools.all_workers]
        lone = {name: roles for name in order if (roles := self.cycler.lone_roles(name))}
        if lone and not allow_pause:
            named = ", ".join(f"{n} (the only live worker that can {' or '.join(r)})" for n, r in lone.items())
            raise CycleRefused(f"a rolling restart would pause serving while {named} restarts: add a worker to "
                               "that pool, or accept the pause with allow_pause: true")
        self.state, self.current, self.steps, self.error = "running", None, [], None
        self._task = asyncio.get_running_loop().create_task(  # not under the calling request's id (its log lines)
            self._run(order, drain_timeout_s, allow_pause), context=contextvars.Context())
        return order

    def status(self) -> dict:
        return {"state": self.state, "current": self.current, "error": self.error,
                "done": [vars(s) for s in self.steps]}

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self, order: list[str], drain_timeout_s: float, allow_pause: bool) -> None:
        log.warning("rolling restart of %s", ", ".join(order))
        try:
            for name in order:
                if not any(w.name == name for w in self.cycler.pools.all_workers):
                    continue  # removed since the start: its pool shrank (coordinator.backend.scaler)
                self.current = name
                await self.cycler.until_live(name)  # a slot being replaced after a crash: its new incarnation
                self.steps.append(await self.cycler.cycle(name, "rolling restart", drain_timeout_s, allow_pause))
        except (CycleRefused, CycleFailed) as e:
            self.state, self.error = "failed", f"{self.current}: {e}"
            log.error("rolling restart stopped at %s: %s", self.current, e)
            return
        self.state, self.current = "done", None
        log.warning("rolling restart done: %d workers replaced", len(self.steps))
