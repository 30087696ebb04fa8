"""The RayBackend's handling of its workers' life events and its periodic stats (a mixin of
coordinator.backend.ray_backend.RayBackend, whose state it works on): a worker dead or removed by a scale-in (its
books retired, its host-tier entries forgotten, its attempts failed so that they move), a worker live (its output
intake started), and every STATS_PERIOD_S the Supervisor's probe, the straggler watch, the block audit, the
workers' transfer figures and their host tiers' changes for the router's prefix index.
"""

from __future__ import annotations

import asyncio
import time

from coordinator.admission.router import WorkerState
from coordinator.backend.stats import transfer_totals
from coordinator.contract import WorkerLost

STATS_PERIOD_S = 1.0


class WorkerEvents:
    def _worker_dead(self, worker: WorkerState, reason: str) -> None:
        if not self.supervisor.planned(worker):  # a rolling restart's or a straggler's replacement is no error
            self._count(self.errors, "worker_died")
        if self.adaptive is not None:  # the last decoding worker died: another decodes now, before its requests move
            self.adaptive.planner.ensure_decoder()
        self._let_go(worker, "died")

    def _worker_removed(self, worker: WorkerState) -> None:
        """A scale-in took `worker` out of its pool (coordinator.backend.scaler): its books go, and what still runs
        there (past the drain's timeout) moves to other workers as off a dead one."""
        self._let_go(worker, "was removed (its pool shrank)")

    def _let_go(self, worker: WorkerState, what_happened: str) -> None:
        """A worker gone (dead or removed): its books retire once its requests have moved off (a bounded history),
        the audit and the router forget it (its host tier went with it), and each attempt on it fails, to move."""
        self.ledger.retire(worker.key)
        self.audit.forget(worker)
        if self.admission is not None:
            self.admission.router.forget_host(worker.name)
        for attempt in list(worker.requests):
            self.intake.fail(attempt, WorkerLost(f"{worker.info.role} worker {worker.name} {what_happened}"))

    def _worker_live(self, worker: WorkerState) -> None:
        self._spawn(self.intake.loop(worker))
        if self.drills.injecting:
            self._spawn(self.drills.on_worker_live(worker))
        self._capacity_freed()

    def _capacity_freed(self) -> None:
        if self.admission is not None:
            self.admission.notify()

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(STATS_PERIOD_S)
            await self.supervisor.probe()
            self._watch_stragglers()
            self.audit.observe(self.pools.all_workers)  # what workers hold that no booking explains, since when
            live = [w for w in self.pools.all_workers if w.alive]
            snapshots = await asyncio.gather(*[w.handle.transfer_metrics.remote() for w in live],
                                           return_exceptions=True)
            self.transfer_totals = transfer_totals([m for ranks in snapshots if isinstance(ranks, list)
                                                    for m in ranks if isinstance(m, dict)])  # every rank's
            await self._collect_host_tiers(live)
            self._capacity_freed()  # waiting requests also look again on a timer

    async def _collect_host_tiers(self, live: list[WorkerState]) -> None:
        """The workers' host-tier changes since the last period into the router's index (a worker that died
        meanwhile is left out: its entries went with it, forget_host)."""
        changes = await asyncio.gather(*[w.handle.host_tier_changes.remote() for w in live], return_exceptions=True)
        for worker, change in zip(live, changes, strict=True):
            if isinstance(change, tuple) and worker.alive and self.admission is not None:
                self.admission.router.host_report(worker.name, *change)

    def _watch_stragglers(self) -> None:
        """Compare the workers' step times (coordinator.backend.stragglers); replace a straggler if configured."""
        if not self.config.stragglers.enabled:
            return
        for worker, why in self.stragglers.observe(self.pools.all_workers, time.monotonic()):
            if self.config.stragglers.replace and self.drains.state(worker.name) is None:  # an operator's drain
                self._spawn(self.stragglers.replace(self.cycler, worker, why))            # stays theirs
