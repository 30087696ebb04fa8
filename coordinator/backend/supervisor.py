"""Supervisor: notices dead workers, brings replacements up with backoff, and tells the truth about each pool.

A worker is dead at the first sign: an actor error from any call to it (the backend reports it through
`worker_died`) or a failed liveness probe (`probe()`, every second). Death is handled once per incarnation: the
worker stops getting requests at once (the router only sees live workers), `on_dead` lets the backend move its
requests elsewhere, and a replacement task for its slot starts. The replacement starts at once the first time,
then after a backoff (restart_delay: doubling with each further restart of that slot within `restart_window_s`),
starts a new actor with the same config in the same
placement bundle, waits until it has loaded its model, wires it to its live peers (Pools.connect), puts it in its
slot (in the role the slot had: adaptive roles outlive an incarnation) and calls `on_live`. A start that fails counts
as a restart and is retried after the next backoff; past
`max_restarts` within the window the slot stays down ("failed") instead of burning a GPU in a crash loop, and says
so: /health's entry has `gave_up` (when and why), and the 503 of a pool left with no live worker names the slot as
given up, not as being replaced; `given_up(role)` says a pool has nothing left that can come back by itself (then
`on_gave_up` lets admission answer its waiting requests at once). `revive()` (POST /admin/workers/{name}/revive)
starts such a slot again with a fresh restart count. `restart()` replaces a live worker on purpose (a rolling
restart's or a straggler's step: coordinator.backend.cycling): at once, without backoff, and not counted against
`max_restarts`.
Figures: restarts per role, seconds each pool spent with no live worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine

import ray
from ray.exceptions import RayActorError, RayTaskError

from coordinator.admission.router import WorkerState
from coordinator.backend.pools import START_TIMEOUT_S, Pools
from coordinator.backend.spares import Spares
from coordinator.backend.stats import start_phases
from coordinator.config.recovery_config import RecoveryConfig

log = logging.getLogger("pdserve")
PROBE_TIMEOUT_S = 10.0


class Supervisor:
    def __init__(self, pools: Pools, config: RecoveryConfig, on_dead: Callable[[WorkerState, str], None],
                 on_live: Callable[[WorkerState], None], on_gave_up: Callable[[], None] = lambda: None) -> None:
        self.pools = pools
        self.config = config
        self._on_dead = on_dead
        self._on_live = on_live
        self._on_gave_up = on_gave_up
        self._recent: dict[str, deque[float]] = {}      # slot name -> times of its recent restarts
        self.restarts: dict[str, int] = {}               # slot name -> replacements that came up
        self.restart_failures: dict[str, int] = {}       # slot name -> replacement starts that failed
        self.reasons: dict[str, str] = {}                # slot name -> why its last incarnation died
        self.recoveries: dict[str, dict[str, float]] = {}  # slot name -> phases of its last recovery, seconds
        self.gave_up: dict[str, str] = {}                # slot name -> why its restarts stopped (state "failed")
        self._died_at: dict[str, float] = {}
        self._planned: set[str] = set()                  # keys of incarnations replaced on purpose
        self._tried: dict[str, int] = {}                 # slot name -> the last incarnation a start was tried for
        self._down_since: dict[str, float | None] = dict.fromkeys(pools.roles, None)
        self._down_total: dict[str, float] = dict.fromkeys(pools.roles, 0.0)
        self._tasks: set[asyncio.Task] = set()
        self.spares: Spares | None = None                # warm spares that take over a dead slot (recovery.spares)
        self._adopted: set[int] = set()                  # pids of spares that took over a slot

    # ---- what happened
    def worker_died(self, worker: WorkerState, reason: str, planned: bool = False) -> None:
        """Mark `worker` dead (idempotent per incarnation) and start replacing its slot (`planned`: on purpose,
        at once and not counted against max_restarts)."""
        if worker.state not in ("live", "starting"):
            return
        worker.state = "dead"
        if planned:
            self._planned.add(worker.key)
        if worker.handle is not None:  # a hung actor (failed probe) must give its bundle back
            ray.kill(worker.handle, no_restart=True)
        self._died_at[worker.name] = time.monotonic()
        self.reasons[worker.name] = _short(reason)
        log.warning("worker %s died: %s", worker.name, self.reasons[worker.name])
        self._update_downtime()
        self._on_dead(worker, reason)
        self._spawn(self._replace(worker, planned))

    def kill(self, name: str) -> bool:
        """Kill a live worker's process (operators' drills); the supervisor then replaces it as any dead one."""
        worker = next((w for w in self.pools.all_workers if w.name == name and w.alive), None)
        if worker is None:
            return False
        self.worker_died(worker, "killed through the admin API")  # gone now: no need to wait for a call to fail
        return True

    def restart(self, name: str, why: str) -> WorkerState | None:
        """Replace live worker `name` on purpose, at once (no backoff, not counted against max_restarts); the
        incarnation that was killed, or None if no live worker has that name."""
        worker = next((w for w in self.pools.all_workers if w.name == name and w.alive), None)
        if worker is not None:
            self.worker_died(worker, why, planned=True)
        return worker

    def planned(self, worker: WorkerState) -> bool:
        """Whether `worker` (an incarnation) was replaced on purpose rather than lost."""
        return worker.key in self._planned

    def revive(self, name: str) -> bool | None:
        """Start slot `name` again after its restarts gave up (state "failed"), with a fresh restart count: True;
        False if the slot has not given up (it is live or being replaced); None if no slot has that name."""
        worker = next((w for w in self.pools.all_workers if w.name == name), None)
        if worker is None:
            return None
        if worker.state != "failed":
            return False
        self._recent.pop(name, None)
        self.gave_up.pop(name, None)
        worker.state = "dead"
        log.warning("worker %s: revived by an operator; starting it again", name)
        self._spawn(self._replace(worker, planned=True))
        return True

    async def probe(self) -> None:
        """Ask every live worker for its load; an actor error marks it dead (a hung worker times out)."""
        async def one(w: WorkerState) -> None:
            try:
                w.report(await asyncio.wait_for(w.handle.load.remote(), PROBE_TIMEOUT_S))
            except (RayActorError, TimeoutError) as e:
                self.worker_died(w, f"liveness probe: {type(e).__name__}: {e}")
            except RayTaskError:
                pass  # the actor is up; its engine loop may be busy or broken: calls report that themselves
        await asyncio.gather(*[one(w) for w in self.pools.all_workers if w.alive])

    # ---- what is true now
    @property
    def roles(self) -> tuple[str, ...]:
        return self.pools.roles

    def workers(self, role: str) -> list[WorkerState]:
        return self.pools.role_workers(role)

    def live(self, role: str) -> list[WorkerState]:
        return [w for w in self.pools.role_workers(role) if w.alive]

    def healthy(self) -> bool:
        return all(self.live(role) for role in self.pools.roles)

    def states(self) -> list[dict]:
        return [{"name": w.name, "role": w.role, "state": w.state, "restarts": self.restarts.get(w.name, 0),
                 "pid": w.info.pid, "host": w.info.host,
                 **({"last_failure": self.reasons[w.name]} if w.name in self.reasons else {}),
                 **({"gave_up": self.gave_up[w.name]} if w.state == "failed" and w.name in self.gave_up else {}),
                 **({"last_recovery_s": self.recoveries[w.name]} if w.name in self.recoveries else {}),
                 "start_phases_s": start_phases(w)}
                for w in self.pools.all_workers]

    def given_up(self, role: str) -> bool:
        """Whether `role`'s pool can take no request until an operator revives a slot: every slot that could serve
        it gave up (state "failed"), none is live or being replaced. Adaptive: any live worker can be made to decode
        (the planner does so at once), so that takes every slot of the fleet."""
        slots = self.pools.all_workers if self.pools.config.adaptive else self.pools.role_workers(role)
        return bool(slots) and all(w.state == "failed" for w in slots)

    def down_reason(self, role: str) -> str | None:
        """Why `role`'s pool cannot take requests now, or None if it has a live worker."""
        if self.live(role):
            return None
        states = "; ".join(self._slot_story(w) for w in self.pools.role_workers(role))
        return f"the {role} pool has no live worker ({states})"

    def _slot_story(self, w: WorkerState) -> str:
        """What is true of a slot that is not live, for a 503: being replaced, or given up (and how to revive)."""
        if w.state == "failed":
            return (f"{w.name} failed: {self.gave_up.get(w.name, 'its restarts gave up')}; no replacement is being "
                    f"started until an operator revives it (POST /admin/workers/{w.name}/revive)")
        if w.state in ("dead", "restarting"):
            return f"{w.name} {w.state}: a replacement is being started"
        return f"{w.name} {w.state}"

    def downtime_s(self) -> dict[str, float]:
        now = time.monotonic()
        return {role: total + (now - self._down_since[role] if self._down_since[role] is not None else 0.0)
                for role, total in self._down_total.items()}

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- replacement
    async def _replace(self, dead: WorkerState, planned: bool = False) -> None:
        name, role = dead.name, "prefill" if dead.info.role == "prefill" else "decode"
        incarnation = max(dead.incarnation, self._tried.get(name, 0))  # a revived slot goes on counting
        recent = self._recent.setdefault(name, deque())
        try:
            await asyncio.wait_for(self.pools.disconnect(dead), PROBE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - the replacement is tried anyway; its start says if it cannot
            log.warning("worker %s: its peers did not all drop it: %s: %s", name, type(e).__name__, e)
        while True:
            now = time.monotonic()
            while recent and now - recent[0] > self.config.restart_window_s:
                recent.popleft()
            if planned:  # on purpose (an operator, a rolling restart, a straggler): now, and not a crash to count
                planned = False
            elif len(recent) >= self.config.max_restarts:
                dead.state = "failed"
                self.gave_up[name] = (f"gave up after {len(recent)} restarts within "
                                      f"{self.config.restart_window_s:g} s (recovery.max_restarts "
                                      f"{self.config.max_restarts})")  # its last failure: self.reasons
                log.error("worker %s: %s, the last: %s; not restarting it until an operator revives it (POST "
                          "/admin/workers/%s/revive)", name, self.gave_up[name], self.reasons.get(name), name)
                self._update_downtime()
                self._on_gave_up()
                return
            else:
                delay = restart_delay(len(recent), self.config)
                recent.append(now)
                if delay > 0 and not self._spare_ready(role):  # a warm spare takes over at once
                    await asyncio.sleep(delay)
            dead.state = "restarting"
            incarnation += 1
            self._tried[name] = incarnation
            worker = None
            try:
                spawned = time.monotonic()
                worker = await self._take_over(dead, incarnation)
                if worker is None:
                    worker = await asyncio.wait_for(
                        self.pools.start_slot(role, Pools.slot_index(dead), incarnation, dead.role), START_TIMEOUT_S)
                started = time.monotonic()
                await self.pools.connect(worker)
            except Exception as e:  # noqa: BLE001 - any failed start is retried after the next backoff
                if worker is not None:  # started (or a spare adopted) but not wired: it gives its bundle back
                    ray.kill(worker.handle, no_restart=True)
                cause = getattr(e, "cause", None) or e  # a RayTaskError's own text is mostly its traceback
                self.restart_failures[name] = self.restart_failures.get(name, 0) + 1
                self.reasons[name] = _short(f"replacement failed to start: {type(cause).__name__}: {cause}")
                log.warning("worker %s: %s", name, self.reasons[name])
                dead.state = "dead"
                continue
            worker.role = dead.role  # the slot's role now (an operator may have changed it while it was down)
            self.pools.install(worker)
            self.restarts[name] = self.restarts.get(name, 0) + 1
            self._update_downtime()
            now = time.monotonic()
            adopted = worker.info.pid in self._adopted  # a warm spare: its start-up phases were long before
            phases = {} if adopted else {f"{k}_s": v for k, v in worker.info.startup_s}
            self.recoveries[name] = {
                "total_s": now - self._died_at[name], "backoff_s": spawned - self._died_at[name],
                ("takeover_s" if adopted else "actor_start_s"): started - spawned, **phases,
                "peer_exchange_s": now - started}
            log.warning("worker %s is back (incarnation %d): %s", name, incarnation,
                        ", ".join(f"{k} {v:.2f}" for k, v in self.recoveries[name].items()))
            self._on_live(worker)
            return

    def _spare_ready(self, role: str) -> bool:
        return self.spares is not None and bool(self.spares.ready.get(role))

    async def _take_over(self, dead: WorkerState, incarnation: int) -> WorkerState | None:
        """A warm spare as the slot's next incarnation (coordinator.backend.spares), or None: start a new actor."""
        if self.spares is None:
            return None
        worker = await self.spares.take_over(dead, incarnation)
        if worker is not None:
            self._adopted.add(worker.info.pid)
        return worker

    def _update_downtime(self) -> None:
        now = time.monotonic()
        for role in self.pools.roles:
            down = not self.live(role)
            since = self._down_since[role]
            if down and since is None:
                self._down_since[role] = now
            elif not down and since is not None:
                self._down_total[role] += now - since
                self._down_since[role] = None

    def _spawn(self, coro: Coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def restart_delay(recent_restarts: int, config: RecoveryConfig) -> float:
    """Seconds before a slot's next replacement, given its restarts within restart_window_s: none for the first (a
    single death is no crash loop, and every second of it the pool runs short), then backoff_initial_s doubling up
    to backoff_max_s."""
    if recent_restarts == 0:
        return 0.0
    return min(config.backoff_max_s, config.backoff_initial_s * 2 ** (recent_restarts - 1))


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
