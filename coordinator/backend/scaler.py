"""Scaler: grows a pool by one worker when it misses its SLO target and the Ray cluster has (or gets) room, and
shrinks it by one, drained first, after its load has stayed low; never outside [min_workers, max_workers]
(`prefill.*` / `decode.*`; coordinator.config.scaling_config). On whenever a pool's sizes differ from its `workers`,
in every mode (collocated: the decode pool).

Owns the recent requests' latencies it judges by, each worker's busy share (coordinator.backend.busy_meter),
the scale events (logged, counted by pool and direction for /metrics `pdserve_pool_scale_events_total`, the last
RECENT_EVENTS shown to the operator in /health's `scaling`), and the two actions; when to act is ScalePolicy's
(coordinator.backend.scale_policy), looked at every LOOK_S, one event at a time, none while a rolling restart runs.

Out: the pool's next slot (`<pool>-<index>`, indices never reused: a peer knows a transfer agent by its name) is
started the way a replacement is (Pools.start_slot, then Pools.connect to its live peers, then installed and
routed to), in a bundle the pool freed earlier or else a placement group of its own (coordinator.backend
.slot_placement: room now, the autoscaler's node, or a clean give-up). A scale-out that cannot be placed or started
leaves nothing behind and is an event of its own (`out_failed`, with the reason). A slot it added is not detached:
it stops with this coordinator (a restarted coordinator adopts the starting sizes and scales again).
In: the pool's newest live slot is drained (coordinator.backend.drains: no new work; a drain that would leave a
pool with no worker is refused, and the scale-in with it: `in_cancelled`), waited for up to server.drain_timeout_s
(what still runs there then moves to another worker as off a dead one, no token lost), then taken out of its pool
(Pools.remove: the Supervisor never replaces it), dropped by its peers, stopped, and its placement group removed
(its resources back to the cluster; on a joined cluster the autoscaler's standing request is lowered to match).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

import ray

from coordinator.admission.router import WorkerState
from coordinator.backend.busy_meter import BusyMeter
from coordinator.backend.cycling import Cycler, RollingRestart
from coordinator.backend.drains import DrainRefused, Drains
from coordinator.backend.fleet import group_name
from coordinator.backend.placement_groups import worker_bundle
from coordinator.backend.pools import START_TIMEOUT_S, Pools
from coordinator.backend.scale_policy import Decision, PoolView, ScalePolicy
from coordinator.backend.slot_placement import NoRoom, place, set_fleet_shape, single_machine
from coordinator.config.serve_config import ServeConfig
from coordinator.observability.latency_window import LatencyWindow

log = logging.getLogger("pdserve")
LOOK_S = 1.0
RECENT_EVENTS = 32
STOP_TIMEOUT_S = 10.0  # a removed worker's clean shutdown (its transfer agent); then it is killed anyway


@dataclass(frozen=True)
class ScaleEvent:
    at: float        # wall-clock seconds (Unix time)
    pool: str
    direction: str   # "out" | "in" | "out_failed" | "in_cancelled"
    worker: str
    reason: str


class Scaler:
    def __init__(self, config: ServeConfig, pools: Pools, drains: Drains, cycler: Cycler, rolling: RollingRestart,
                 on_live: Callable[[WorkerState], None], on_removed: Callable[[WorkerState], None],
                 spares: Callable[[], int] = lambda: 0) -> None:
        assert config.slo is not None  # the config loader requires it where a pool scales
        self.config, self.pools, self.drains, self.cycler, self.rolling = config, pools, drains, cycler, rolling
        self._on_live, self._on_removed, self._spares = on_live, on_removed, spares
        self.window = LatencyWindow(config.scaling.window_s)
        self.policy = ScalePolicy(config.scaling, config.slo, config.mode == "collocated")
        self.meter = BusyMeter()
        self.events: deque[ScaleEvent] = deque(maxlen=RECENT_EVENTS)
        self.counts: dict[tuple[str, str], int] = {}  # (pool, direction) -> events
        self._highest: dict[str, int] = {}  # pool -> the highest slot index it has had
        # a cluster pdserve did not start (its own local Ray runs in Ray's single-machine mode): it may autoscale
        self.joined = config.ray_address is not None and not single_machine(os.environ)

    def request_ended(self, started_at: float, first_at: float | None, tokens: int) -> None:
        """A request that streamed `tokens` tokens, its first at `first_at` (monotonic seconds) ended now."""
        if first_at is not None:
            now = time.monotonic()
            self.window.add(now, first_at - started_at, (now - first_at) / (tokens - 1) if tokens > 1 else None)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(LOOK_S)
            try:
                await self.look()
            except Exception:  # noqa: BLE001 - a failed look is logged; the next one comes
                log.exception("scaling: a look at the pools failed")

    async def look(self) -> ScaleEvent | None:
        """One look, and the event it led to, if any."""
        if self.rolling.state == "running":
            return None
        now = time.monotonic()
        self.meter.measure(self.pools.all_workers, now)
        decision = self.policy.look(now, self.window, [self._view(pool) for pool in self.config.scaling_pools])
        if decision is None:
            return None
        event = await (self.scale_out(decision) if decision.direction == "out" else self.scale_in(decision))
        self.policy.acted(time.monotonic())
        return event

    def view(self) -> dict:
        """/health's `scaling` (the operator's): each scaling pool's size and limits, and the recent events."""
        pools = {}
        for pool in self.config.scaling_pools:
            cfg, slots = getattr(self.config, pool), self._slots(pool)
            pools[pool] = {"workers": len(slots), "live": sum(w.alive for w in slots), "min_workers": cfg.fewest,
                           "max_workers": cfg.most}
        return {"pools": pools, "events": [asdict(e) for e in self.events]}

    # ---- out
    async def scale_out(self, decision: Decision) -> ScaleEvent:
        pool, cfg = decision.pool, getattr(self.config, decision.pool)
        index = self._next_index(pool)
        name = f"{pool}-{index}"
        log.warning("scaling: the %s pool grows by %s (%s)", pool, name, decision.why)
        placed = False
        try:
            free = self.pools.groups.free.get(pool)
            if free:
                self.pools.groups.bundles[name] = free.pop()
            else:
                key = f"{pool}-slot-{index}"
                group = await place(worker_bundle(cfg), group_name(key), "PACK", self.joined,
                                    self.config.scaling.placement_timeout_s, self._fleet())
                self.pools.groups.own(key, group, name)
            placed = True
            self.pools.scaled.add(name)
            worker = await asyncio.wait_for(self.pools.start_slot(pool, index), START_TIMEOUT_S)
            try:
                await self.pools.connect(worker)
            except BaseException:
                ray.kill(worker.handle, no_restart=True)
                raise
        except NoRoom as e:
            self._highest[pool] = index - 1  # nothing was started under its name: the next scale-out takes it
            return self._event(pool, "out_failed", name, f"{decision.why}; {name} was not started: {e}")
        except Exception as e:  # noqa: BLE001 - a failed start leaves nothing behind, and says why
            cause = getattr(e, "cause", None) or e  # a RayTaskError's own text is mostly its traceback
            if placed:
                self.pools.give_back(name, pool)
            return self._event(pool, "out_failed", name, f"{decision.why}; {name} failed to start: "
                               f"{type(cause).__name__}: {cause}")
        self.pools.install(worker)
        self._on_live(worker)
        return self._event(pool, "out", name, f"{decision.why}; {name} started (pid {worker.info.pid}, host "
                           f"{worker.info.host})")

    # ---- in
    async def scale_in(self, decision: Decision) -> ScaleEvent:
        pool = decision.pool
        async with self.cycler.lock:  # never alongside a rolling restart's or a straggler's step
            live = [w for w in self._slots(pool) if w.alive and self.drains.state(w.name) is None]
            victim = max(live, key=Pools.slot_index)
            name = victim.name
            log.warning("scaling: the %s pool shrinks by %s (%s)", pool, name, decision.why)
            try:
                self.drains.drain(name)
            except DrainRefused as e:
                return self._event(pool, "in_cancelled", name, f"{decision.why}; not drained: {e}")
            deadline = time.monotonic() + self.config.server.drain_timeout_s
            while self.drains.state(name) == "draining" and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            if self.drains.state(name) is None:
                return self._event(pool, "in_cancelled", name, f"{decision.why}; {name} was undrained by an operator "
                                   "while it drained")
            slot = next((w for w in self._slots(pool) if w.name == name), None)
            if slot is None or not slot.alive:  # it died while draining: the Supervisor is replacing it
                self.drains.undrain(name, "its scale-in was called off")
                return self._event(pool, "in_cancelled", name, f"{decision.why}; {name} died while it drained")
            moved = len(slot.requests)
            await self._remove(slot, pool)
        note = f"; {moved} requests still there after server.drain_timeout_s moved to other workers" if moved else ""
        return self._event(pool, "in", name, f"{decision.why}; {name} drained and removed{note}")

    async def _remove(self, worker: WorkerState, pool: str) -> None:
        worker.state = "removed"  # nothing routes to it, and the Supervisor ignores it from here
        self.pools.remove(worker)
        self.drains.forget(worker.name)
        self.meter.forget(worker)
        self._on_removed(worker)
        try:
            await asyncio.wait_for(self.pools.disconnect(worker), STOP_TIMEOUT_S)
            await asyncio.wait_for(worker.handle.shutdown.remote(), STOP_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - it is killed anyway; its peers dropped what they could
            log.warning("scaling: %s did not stop cleanly (%s: %s); killing it", worker.name, type(e).__name__, e)
        ray.kill(worker.handle, no_restart=True)
        self.pools.give_back(worker.name, pool)
        if self.joined:  # the autoscaler may let its node go
            await set_fleet_shape(self._fleet())

    # ---- internals
    def _slots(self, pool: str) -> list[WorkerState]:
        return self.pools.prefill if pool == "prefill" else self.pools.decode

    def _view(self, pool: str) -> PoolView:
        cfg, slots = getattr(self.config, pool), self._slots(pool)
        live = [w for w in slots if w.alive and self.drains.state(w.name) is None]
        return PoolView(pool, len(slots), len(live), cfg.fewest, cfg.most,
                        [self.meter.busy[w.name] for w in live if w.name in self.meter.busy])

    def _next_index(self, pool: str) -> int:
        highest = max([self._highest.get(pool, -1)] + [Pools.slot_index(w) for w in self._slots(pool)])
        self._highest[pool] = highest + 1
        return highest + 1

    def _fleet(self) -> list[dict[str, float]]:
        """One bundle per worker slot and warm spare of every pool: the cluster shape the fleet holds now."""
        return [worker_bundle(getattr(self.config, pool)) for pool in self.pools.pool_names
                for _ in range(len(self._slots(pool)) + self._spares())]

    def _event(self, pool: str, direction: str, worker: str, reason: str) -> ScaleEvent:
        event = ScaleEvent(time.time(), pool, direction, worker, reason)
        self.events.append(event)
        self.counts[(pool, direction)] = self.counts.get((pool, direction), 0) + 1
        (log.warning if direction in ("out", "in") else log.error)("scaling: %s %s %s: %s", pool, direction, worker,
                                                                   reason)
        return event
