"""Drills: what operators do to live pools on purpose (coordinator/api/admin.py's routes) and the injected faults.

Owns the drill config in force (FaultsConfig): applied to every live worker when set, and to every replacement
when it comes up (`on_worker_live`), except the injected slowness (`slow_step_s`): it slows the named workers'
processes live when it is set, not their replacements (a throttled process, which replacing cures). Killing goes
through the Supervisor (a whole worker) or the worker itself (one tensor-parallel rank, after which the worker dies
and the Supervisor replaces the whole group).
"""

from __future__ import annotations

import asyncio
import logging

from ray.exceptions import RayActorError, RayTaskError

from coordinator.admission.router import WorkerState
from coordinator.backend.pools import Pools
from coordinator.backend.supervisor import Supervisor
from coordinator.config.faults_config import FaultsConfig

log = logging.getLogger("pdserve")


class Drills:
    def __init__(self, pools: Pools, supervisor: Supervisor, faults: FaultsConfig) -> None:
        self.pools, self.supervisor, self.faults = pools, supervisor, faults

    @property
    def injecting(self) -> bool:
        return self.faults != FaultsConfig()

    def kill_worker(self, name: str) -> bool:
        """SIGKILL live worker `name`'s process; False if none has that name."""
        return self.supervisor.kill(name)

    async def kill_rank(self, name: str, rank: int) -> bool:
        """Kill one tensor-parallel rank of live worker `name` (the worker then dies and is replaced whole).
        False if no live worker has that name; ValueError if it has no such rank."""
        worker = next((w for w in self.pools.all_workers if w.name == name and w.alive), None)
        if worker is None:
            return False
        try:
            await worker.handle.kill_rank.remote(rank)
        except RayTaskError as e:
            raise ValueError(str(e.cause)) from None
        return True

    async def set_faults(self, faults: FaultsConfig) -> None:
        """Inject `faults` on every live worker now, and on every replacement from now on. ValueError when
        `slow_workers` names no worker slot."""
        names = {w.name for w in self.pools.all_workers}
        unknown = [n for n in faults.slow_workers if n not in names]
        if unknown:
            raise ValueError(f"slow_workers: no worker is named {unknown[0]!r} (the workers: {sorted(names)})")
        self.faults = faults
        await asyncio.gather(*[self.on_worker_live(w, fresh=False) for w in self.pools.all_workers if w.alive])

    async def on_worker_live(self, worker: WorkerState, fresh: bool = True) -> None:
        """Give a worker the faults in force (`fresh`: a replacement, which the injected slowness spares)."""
        slowed = not fresh and (not self.faults.slow_workers or worker.name in self.faults.slow_workers)
        try:
            await worker.handle.set_faults.remote(**worker_faults(self.faults),
                                                  step_delay_s=self.faults.slow_step_s if slowed else 0.0)
        except (RayActorError, RayTaskError) as e:
            log.warning("could not set faults on %s: %s", worker.name, e)


def worker_faults(faults: FaultsConfig) -> dict:
    """The keyword arguments of a worker's set_faults() for the drill config `faults` (every worker may prefill
    for another: the prefill faults apply wherever prefill() runs)."""
    kv = {"fail_fraction": faults.transfer_fail_fraction, "stall_fraction": faults.transfer_stall_fraction,
          "stall_s": faults.transfer_stall_s, "seed": faults.seed}
    return {"kv": kv, "prefill_error_fraction": faults.prefill_error_fraction, "seed": faults.seed,
            "call_jitter_s": faults.call_jitter_s}
