"""What a worker holds for a coordinator that died, and its adoption by the next one (coordinator.backend.adoption).

A worker outlives its coordinator (a detached actor, coordinator.backend.fleet). The requests it was running then
belong to streams that ended with the dead coordinator: nobody reads their tokens or will release their blocks.
`held_request_ids()` lists every request id the worker holds anywhere (the engine's requests and reservations, the
decode duty's early bookings and handoffs, the prefill duty's prefills and pushes); the adopting coordinator has
them all aborted through the worker's ordinary abort (each duty frees its own, a transfer in flight once it has
ended), then learns the worker's info, fleet fingerprint and block counts (`Adoption`) to rebuild its books from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.load import EngineLoad, WorkerInfo


@dataclass(frozen=True)
class Adoption:
    """A worker's answer to the coordinator adopting it."""

    fleet: str                      # the fingerprint it was started with (coordinator.backend.fleet.fingerprint)
    info: WorkerInfo | None         # None: the fingerprints differ, nothing was aborted
    aborted: tuple[str, ...] = ()   # the orphaned request ids it held, all aborted now
    integrity: dict | None = None   # its engine's check_integrity() after the aborts
    load: EngineLoad | None = None  # its load after the aborts


async def held_request_ids(worker: Any) -> set[str]:
    """Every request id `worker` (pool_worker.worker.Worker, which imports this module) holds, any duty and any
    stage; the engine's own are read on its thread."""
    def engine_held(e) -> set[str]:
        return set(e.scheduler.requests) | set(e._reserved)  # noqa: SLF001 - blocks booked for KV written in
    ids = set(await worker.loop.call(engine_held))
    if worker.decodes is not None:
        d = worker.decodes
        ids |= set(d.reservations._early) | set(d.handoffs.transferring)  # noqa: SLF001
        ids |= set(d.handoffs._expected) | set(d.handoffs._joins)  # noqa: SLF001
    if worker.prefills is not None:
        p = worker.prefills
        ids |= set(p._waiting) | set(p._finishing) | set(p._outcomes)  # noqa: SLF001
        if p.pushes is not None:
            ids |= set(p.pushes._pushes)  # noqa: SLF001
    return ids


async def abort_held(worker: Any) -> list[str]:
    """Abort every request `worker` holds (those of a dead coordinator); their ids, sorted."""
    ids = sorted(await held_request_ids(worker))
    for request_id in ids:
        await worker.abort(request_id)
    return ids
