"""OperatorCalls: the part of RayBackend (coordinator.backend.ray_backend) that the admin routes and /health call:
figures (a request in flight, health, integrity) and an operator's actions (drills, roles, drains, revive, rolling
restart). Each call reads or delegates to the backend's parts (Pools, Supervisor, Drains, Drills, the adaptive
layout, the ledger and its block audit) and holds no state of its own; RayBackend inherits it, so the backend's
interface (coordinator.contract.ServingBackend and the admin calls) stays one object.
"""

from __future__ import annotations

import asyncio

from coordinator.config.faults_config import FaultsConfig


class OperatorCalls:
    async def request_view(self, request_id: str) -> dict | None:
        """GET /admin/requests/{id}: a single-choice request in flight (coordinator.backend.inflight), or None."""
        record = self.inflight.get(request_id)
        return None if record is None else record.view({w.key: w.name for w in self.pools.all_workers})

    async def requests_in_flight(self) -> list[str]:
        """GET /admin/requests: the ids of the single-choice requests in flight."""
        return list(self.inflight)

    def health(self) -> tuple[bool, list[dict]]:
        return self.drains.healthy(), self.drains.states() + self.spares.states()  # spares: state "spare"

    def health_extra(self) -> dict:
        """What /health adds for the operator: the pools' scaling (sizes, limits, recent events), where pools scale."""
        return {"scaling": self.scaler.view()} if self.scaler is not None else {}

    def check_integrity(self) -> dict[str, dict[str, int]]:
        """Assert that the bookings are exactly those of the requests in flight; return them per worker."""
        booked = self.ledger.check_integrity()
        assert self.ledger.live_requests == len(self._ids), (self.ledger.live_requests, self._ids)
        return booked

    async def integrity(self) -> dict:
        """check_integrity() here and on every live engine, and what the engines hold against the bookings
        (coordinator.backend.block_audit: `mismatches`), as a report: ok, or the first failure."""
        report: dict = {"ok": True, "error": None, "coordinator": self.ledger.snapshot(), "workers": {}}
        try:
            report["coordinator"] = self.check_integrity()
        except AssertionError as e:
            report.update(ok=False, error=f"coordinator: {e}")
        live = [w for w in self.pools.all_workers if w.alive]
        checks = await asyncio.gather(*[w.handle.check_integrity.remote() for w in live], return_exceptions=True)
        for w, check in zip(live, checks, strict=True):
            if isinstance(check, BaseException):
                report.update(ok=False, error=report["error"] or f"{w.name}: {check}")
            else:
                report["workers"][w.name] = check
        report["mismatches"] = self.audit.report(live, report["workers"])
        if report["mismatches"]:
            report.update(ok=False, error=report["error"] or report["mismatches"][0])
        return report

    # ---- drills (coordinator.backend.drills; the admin routes call them here)
    async def kill_worker(self, name: str) -> bool:
        killed = self.drills.kill_worker(name)
        if killed:  # a restart on purpose ends a drain (coordinator.backend.drains)
            self.drains.restarted(name)
        return killed

    async def kill_rank(self, name: str, rank: int) -> bool:
        return await self.drills.kill_rank(name, rank)

    async def set_faults(self, faults: FaultsConfig) -> None:
        await self.drills.set_faults(faults)

    async def set_role(self, name: str, role: str) -> bool:
        """An operator's role change (mode adaptive; coordinator.backend.adaptive). ValueError if it cannot be."""
        if self.adaptive is None:
            raise ValueError(f"roles change only in mode adaptive (this server runs mode {self.config.mode})")
        if self.drains.state(name) is not None:
            raise ValueError(f"{name} is {self.drains.state(name)}: undrain it before changing its role")
        return self.adaptive.set_role(name, role, "set through the admin API")

    async def drain_worker(self, name: str) -> str | None:
        """Take a worker out of routing (coordinator.backend.drains); DrainRefused (a ValueError) for the last."""
        return self.drains.drain(name)

    async def undrain_worker(self, name: str) -> bool | None:
        return self.drains.undrain(name)

    async def revive_worker(self, name: str) -> bool | None:
        """Start a slot whose restarts gave up again (Supervisor.revive): True; False if it had not; None: no slot."""
        return self.supervisor.revive(name)

    async def restart_workers(self, drain_timeout_s: float, allow_pause: bool) -> list[str]:
        """Begin a rolling restart (coordinator.backend.cycling); its order. CycleRefused (a ValueError)."""
        return self.rolling.start(drain_timeout_s, allow_pause)

    async def restart_status(self) -> dict:
        return self.rolling.status()
