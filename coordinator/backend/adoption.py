"""Adoption: a coordinator that starts where a previous one died takes over its workers instead of starting new ones.

Pools.start() calls `adopt()` when the config names a namespace (coordinator.backend.fleet). What it finds there:
- nothing: None, the pools start as usual;
- workers of another fleet (their fingerprint differs: another model, pool size, engine or transfer config), or
  no placement group for a pool: the namespace is torn down (logged with the reason) and None: the pools start
  afresh. Refusing would leave the operator a namespace to clean by hand for a config they changed on purpose;
- our fleet: each slot's newest incarnation is asked to `adopt` (pool_worker.orphans): it aborts every request the
  dead coordinator left on it (their streams ended with it) and drops the output backlog nobody will read, then
  reports its info, block counts and load. No model is loaded again, and its transfer agents stay connected to
  their peers. A slot whose actor is gone, dead, unresponsive, or still starting (the dead coordinator's start)
  is started afresh (the next incarnation; older ones are killed) and wired to its adopted peers, so a worker that
  died while no coordinator watched, or during the adoption, ends replaced. The coordinator's books start empty:
  after the aborts the workers hold nothing, which their integrity counts confirm.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from coordinator.admission.router import WorkerState
from coordinator.backend.fleet import existing_group, named_workers, teardown

log = logging.getLogger("pdserve")
ADOPT_TIMEOUT_S = 30.0  # one worker's answer (its aborts included); a worker slower than this is replaced


async def adopt(pools: Any) -> tuple[list[WorkerState], list[WorkerState]] | None:
    """(every worker, the ones started afresh) once the namespace's fleet is adopted; None when there is none to
    adopt (anything found there is torn down first). `pools`: the coordinator.backend.pools.Pools starting (it
    imports this module)."""
    found = named_workers()
    if not found:
        return None
    slots = [(role, i) for role in pools.pool_names for i in range(pools.pool(role).workers)]
    groups = {role: existing_group(role) for role in pools.pool_names}
    if any(g is None for g in groups.values()):
        await teardown("a pool's placement group is missing: the fleet cannot be adopted")
        return None
    answers = await asyncio.gather(*[_ask(name, pools.fleet) for role, i in slots
                                     for _, name in found.get((role, i), [])[:1]])
    asked = iter(answers)
    adopted: dict[tuple[str, int], WorkerState] = {}
    for role, i in slots:
        entries = found.get((role, i), [])
        if not entries:
            continue
        incarnation, name = entries[0]
        handle, answer = next(asked)
        if answer is not None and answer.info is None:
            await teardown(f"its workers were started for another config (fingerprint {answer.fleet}, this "
                           f"config's {pools.fleet})")
            return None
        if answer is not None:
            adopted[(role, i)] = WorkerState(answer.info, handle, incarnation=incarnation, load=answer.load)
            log.warning("worker %s adopted (incarnation %d, pid %d): %d orphaned requests aborted; blocks %s",
                        answer.info.name, incarnation, answer.info.pid, len(answer.aborted), answer.integrity)
    if not adopted:
        await teardown("no worker of the fleet answered")
        return None
    for key, entries in found.items():  # stale incarnations, and any slot this config has no more
        for _, name in entries[1:] if key in adopted else entries:
            _kill(name)
    pools.groups.adopt(groups)
    fresh = await asyncio.gather(*[_restart(pools, role, i, found) for role, i in slots if (role, i) not in adopted])
    return [adopted.get(s) or next(w for w in fresh if w.name == f"{s[0]}-{s[1]}") for s in slots], list(fresh)


async def _ask(name: str, fleet: str):
    """(handle, its Adoption) of actor `name`; (handle or None, None) if it cannot be adopted."""
    try:
        handle = ray.get_actor(name)
    except ValueError:
        return None, None
    try:
        return handle, await asyncio.wait_for(handle.adopt.remote(fleet), ADOPT_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - dead, hung or broken: its slot is started afresh
        log.warning("worker %s cannot be adopted (%s: %s); its slot is started afresh", name, type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "")
        return handle, None


async def _restart(pools: Any, role: str, index: int, found: dict) -> WorkerState:
    """Slot (role, index) started afresh as its next incarnation (the supervisor's way, without a backoff)."""
    incarnation = max((inc for inc, _ in found.get((role, index), [])), default=-1) + 1
    log.warning("worker %s-%d: no live incarnation to adopt; starting incarnation %d", role, index, incarnation)
    return await pools.start_slot(role, index, incarnation)


def _kill(name: str) -> None:
    try:
        ray.kill(ray.get_actor(name), no_restart=True)
    except ValueError:
        pass
