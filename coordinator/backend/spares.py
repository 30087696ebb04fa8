"""Spares: warm spare workers (`recovery.spares: N`, per pool; off by default) that take over a dead slot at once.

Owns the spares of each pool: started in the background after the pools (their own placement group of N bundles,
`pdserve-<pool>-spares`), each with its pool's config, model loaded and KV cache allocated, connected to no peer and
never routed to; listed in /health with state "spare". When a slot of that pool dies, the Supervisor asks `take_over`
first: a ready spare adopts the slot's name (Worker.adopt: its transfer metadata renamed, so peers know it by the
slot's name) and comes back as the slot's next incarnation, which the Supervisor then wires to its peers
(Pools.connect) and installs: no process start, no imports, no weights. The slot's old bundle is free then (its
actor is dead), so a new spare is started there in the background, and the slot keeps the spare's bundle
(coordinator.backend.placement_groups' `bundles`). A spare that died while idle is dropped (and replaced) when it is
found so.

Spare names are never reused (`<pool>-spare-<k>`, k counting up): a peer knows a spare's transfer agent by its own
name as well, and a fresh name never collides with one a peer still remembers.
"""

from __future__ import annotations

import asyncio
import logging

import ray
from ray.exceptions import RayActorError, RayTaskError

from coordinator.admission.router import WorkerState
from coordinator.backend.pools import Pools

log = logging.getLogger("pdserve")


class Spares:
    def __init__(self, pools: Pools, count: int) -> None:
        self.pools = pools
        self.count = count
        self.ready: dict[str, list[WorkerState]] = {}  # pool -> spares started and idle
        self.starting: dict[str, int] = {}             # pool -> spares being started
        self.taken: dict[str, int] = {}                # pool -> slots a spare took over
        self.failed_starts = 0
        self._serial = 0
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Place each pool's spare bundles and start its spares in the background."""
        if self.count == 0:
            return
        for pool in self.pools.pool_names:
            await self.pools.groups.add(f"{pool}-spares", self.pools.pool(pool), self.count)
            self.ready[pool], self.starting[pool], self.taken[pool] = [], 0, 0
            for bundle in range(self.count):
                self._refill(pool, (f"{pool}-spares", bundle))

    def states(self) -> list[dict]:
        """/health's entries for the spares (state "spare")."""
        return [{"name": w.name, "role": pool, "state": "spare", "pid": w.info.pid, "host": w.info.host,
                 "start_phases_s": dict(w.info.startup_s)} for pool, spares in self.ready.items() for w in spares]

    async def take_over(self, dead: WorkerState, incarnation: int) -> WorkerState | None:
        """A ready spare of the dead slot's pool as that slot's incarnation `incarnation` (not yet connected nor
        installed), or None when no spare is ready."""
        pool = "prefill" if dead.info.role == "prefill" else "decode"
        spares = self.ready.get(pool, [])
        while spares:
            spare = spares.pop(0)
            try:
                info = await spare.handle.take_over_slot.remote(dead.name)
            except (RayActorError, RayTaskError) as e:
                log.warning("spare %s could not take over %s (%s); trying the next", spare.name, dead.name, e)
                ray.kill(spare.handle, no_restart=True)
                self._refill(pool, self.pools.groups.bundles.pop(spare.name))
                continue
            freed = self.pools.groups.bundles.pop(dead.name, (pool, Pools.slot_index(dead)))
            self.pools.groups.bundles[dead.name] = self.pools.groups.bundles.pop(spare.name)
            self.taken[pool] += 1
            log.warning("worker %s: taken over by spare %s (pid %d)", dead.name, spare.name, info.pid)
            self._refill(pool, freed)
            return WorkerState(info, spare.handle, incarnation=incarnation, load=spare.load, role=dead.role)
        return None

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for spares in self.ready.values():
            for w in spares:
                ray.kill(w.handle, no_restart=True)

    def _refill(self, pool: str, bundle: tuple[str, int]) -> None:
        self._serial += 1
        name = f"{pool}-spare-{self._serial}"
        self.pools.groups.bundles[name] = bundle
        self.starting[pool] += 1
        task = asyncio.get_running_loop().create_task(self._start(pool, name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start(self, pool: str, name: str) -> None:
        """Start spare `name` in its bundle; a failed start is retried under a new name after a pause."""
        try:
            spare = await self.pools.start_slot(pool, 0, name=name)
        except Exception as e:  # noqa: BLE001 - a spare that cannot start is logged; serving goes on without it
            self.failed_starts += 1
            log.warning("spare %s failed to start: %s: %s; trying again", name, type(e).__name__, e)
            await asyncio.sleep(5.0)
            self._refill(pool, self.pools.groups.bundles.pop(name))
            return
        finally:
            self.starting[pool] -= 1
        log.warning("spare %s ready (pid %d): %s", name, spare.info.pid,
                    ", ".join(f"{k} {v:.2f} s" for k, v in spare.info.startup_s))
        self.ready[pool].append(spare)
