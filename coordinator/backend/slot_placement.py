"""Room on the Ray cluster for one more worker (a pool's scale-out: coordinator.backend.scaler).

A new worker gets a placement group of its own, one bundle of its pool's resources (Pools' worker_bundle), so it can
be given back whole when the pool shrinks. Where the room comes from:
- the cluster has it now (`ray.available_resources()` covers the bundle): the group is placed at once;
- it has not, and pdserve started this Ray itself (no `ray_address`: Ray's single-machine mode, which no node can
  join, coordinator.backend.ray_network): no autoscaler can add a node, so the scale-out gives up at once, saying
  what the worker needs and what the cluster has free;
- it has not, on a cluster pdserve joined (`ray_address`, e.g. a `ray up` cluster): Ray's autoscaler is asked for
  the whole fleet's shape with the new worker in it (`ray.autoscaler.sdk.request_resources`: a standing request for
  the cluster's total, replaced by each call) and the group waits up to `scaling.placement_timeout_s` for the node;
  past it the group is removed, the request is set back to the fleet without the worker, and the scale-out gives up
  saying so. A cluster without an autoscaler answers the same way, after the timeout.
`set_fleet_shape` sets the standing request to the fleet as it is (after a worker is removed, so the autoscaler may
let an idle node go).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

log = logging.getLogger("pdserve")
# Ray's own switch, which `pdserve serve` sets to "0" for the local Ray it starts
# (coordinator.backend.ray_network): a node no other node may join
RAY_CLUSTERS_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_SLACK = 1e-6  # Ray's resource amounts are fixed-point: 0.5 + 0.5 may read 0.9999999


class NoRoom(RuntimeError):
    """The cluster had no room for the worker (the message says what it needed and what there was)."""


def single_machine(environ: Mapping[str, str]) -> bool:
    """Whether this process's Ray runs in its single-machine mode: no node can join, so no autoscaler can add one."""
    return environ.get(RAY_CLUSTERS_ENV) == "0"


def fits(bundle: dict[str, float], available: dict[str, float]) -> bool:
    return all(available.get(name, 0.0) + _SLACK >= amount for name, amount in bundle.items())


def free_of(bundle: dict[str, float], available: dict[str, float]) -> dict[str, float]:
    """What the cluster has free of each resource the bundle asks for (the rest of Ray's list is noise here)."""
    return {name: round(available.get(name, 0.0), 4) for name in bundle}


async def place(bundle: dict[str, float], name: str, strategy: str, joined: bool, timeout_s: float,
                fleet: list[dict[str, float]]) -> PlacementGroup:
    """A placed group of one `bundle` named `name`; NoRoom when the cluster has (or gets) no room for it. `fleet`:
    the bundles of every worker the servers' pools hold now (the autoscaler is asked for them and this one)."""
    available = ray.available_resources()
    room = fits(bundle, available)
    if not room and not joined:
        raise NoRoom(f"the Ray cluster has no room for it: a worker needs {bundle}, the cluster has "
                     f"{free_of(bundle, available)} free; this Ray was started by pdserve itself (no ray_address), "
                     "so no autoscaler can add a node")
    if not room:
        log.warning("scaling: asking Ray's autoscaler for a node with %s (free now: %s)", bundle,
                    free_of(bundle, available))
        await set_fleet_shape([*fleet, bundle])
    group = placement_group([bundle], strategy=strategy, name=name)
    try:
        await asyncio.wait_for(group.ready(), timeout_s)
    except TimeoutError:
        remove_placement_group(group)
        if not room:
            await set_fleet_shape(fleet)
        asked = "Ray's autoscaler was asked for it, and " if not room else ""
        raise NoRoom(f"no room for it came within scaling.placement_timeout_s ({timeout_s:g} s): a worker needs "
                     f"{bundle}, {asked}the cluster has {free_of(bundle, ray.available_resources())} free") from None
    return group


async def set_fleet_shape(bundles: list[dict[str, float]]) -> None:
    """The autoscaler's standing request: room for these bundles in all (what runs counted in)."""
    from ray.autoscaler.sdk import request_resources  # the autoscaler's SDK, only on a joined cluster's path
    await asyncio.to_thread(request_resources, bundles=bundles)
