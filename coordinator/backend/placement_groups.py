"""The pools' placement groups on the Ray cluster, and which bundle each worker slot sits in.

One group per pool (`placement: pack` -> PACK, as few nodes as possible; `spread` -> SPREAD), a bundle per worker
slot with its CPUs/GPUs and the pool's custom resources (`resources:`), so a pool lands only on nodes started with
them; one more group per pool's warm spares (coordinator.backend.spares), and one per slot the scaler added
(coordinator.backend.scaler). A slot sits in bundle `index` of its pool's group unless `bundles` says otherwise
(spares, a slot a spare took over, scaled slots); the bundles of slots a scale-in removed wait in `free` for the
pool's next new slot (Ray cannot shrink a group). Owned by coordinator.backend.pools (Pools.groups).
"""

from __future__ import annotations

import asyncio

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from coordinator.backend.fleet import group_name
from coordinator.backend.warm_processes import bundle_node
from coordinator.config.serve_config import PoolConfig, ServeConfig

PLACEMENT_TIMEOUT_S = 60.0


class PlacementGroups:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self._groups: dict[str, object] = {}  # key (a pool's role, "<pool>-spares", "<pool>-slot-<i>") -> group
        self.bundles: dict[str, tuple[str, int]] = {}  # actor name -> (group key, bundle) where not its slot's own
        self.free: dict[str, list[tuple[str, int]]] = {}  # pool -> bundles of slots it removed (reused first)

    def create(self, key: str, pool: PoolConfig, count: int | None = None) -> None:
        """Group `key` of `count` bundles of `pool` (None: the pool's workers, detached with a namespace: the pools'
        groups outlive this coordinator, coordinator.backend.fleet; others do not). Not yet placed: `placed()`."""
        strategy = "PACK" if self.config.placement == "pack" else "SPREAD"
        lifetime = "detached" if self.config.namespace is not None and count is None else None
        self._groups[key] = placement_group([worker_bundle(pool)] * (pool.workers if count is None else count),
                                            strategy=strategy, name=group_name(key), lifetime=lifetime)

    async def placed(self) -> None:
        """Wait until every group has its resources; fail clearly when the cluster lacks them."""
        groups = list(self._groups.values())
        try:
            await asyncio.wait_for(asyncio.gather(*[g.ready() for g in groups]), PLACEMENT_TIMEOUT_S)
        except TimeoutError:
            wanted = [g.bundle_specs for g in groups]
            raise RuntimeError(f"the Ray cluster cannot place the pools within {PLACEMENT_TIMEOUT_S:.0f} s: they need "
                               f"{wanted}, the cluster has {ray.available_resources()}; lower num_cpus / num_gpus "
                               "or workers in the config") from None

    async def add(self, key: str, pool: PoolConfig, count: int) -> None:
        """Another group `key` of `count` bundles of `pool` (warm spares), once it is placed; removed at shutdown
        with the pools' own."""
        self.create(key, pool, count)
        await self.placed()

    def own(self, key: str, group: object, name: str) -> None:
        """Group `key` (placed) is slot `name`'s own, bundle 0 (a scale-out: coordinator.backend.scaler)."""
        self._groups[key] = group
        self.bundles[name] = (key, 0)

    def release(self, name: str, role: str) -> None:
        """Slot `name` of pool `role` is gone: its own group (a scaled slot's) is removed, giving its resources back to
        the cluster; a bundle in a shared group is kept for the pool's next new slot."""
        key, index = self.bundles.pop(name, None) or (role, int(name.rsplit("-", 1)[1]))
        if key.startswith(f"{role}-slot-"):
            remove_placement_group(self._groups.pop(key))
        else:
            self.free.setdefault(role, []).append((key, index))

    def adopt(self, groups: dict[str, object]) -> None:
        """The groups of an adopted fleet (replacements start in their bundles)."""
        self._groups = dict(groups)

    def slot_bundle(self, name: str, role: str, index: int) -> tuple[str, int]:
        """(group key, bundle) of slot `name` (slot `index` of pool `role`, unless `bundles` places it elsewhere)."""
        return self.bundles.get(name, (role, index))

    def strategy(self, name: str, role: str, index: int) -> PlacementGroupSchedulingStrategy:
        group, bundle = self.slot_bundle(name, role, index)
        return PlacementGroupSchedulingStrategy(self._groups[group], placement_group_bundle_index=bundle)

    async def node(self, key: str, bundle: int) -> str | None:
        """The node that holds bundle `bundle` of group `key` (None: no such group, or unplaced)."""
        return await asyncio.to_thread(bundle_node, self._groups[key], bundle) if key in self._groups else None

    def remove_all(self) -> None:
        for group in self._groups.values():
            remove_placement_group(group)
        self._groups.clear()


def worker_bundle(pool: PoolConfig) -> dict[str, float]:
    """What one worker of `pool` reserves on its node: CPUs, GPUs and the pool's custom resources."""
    gpus = pool.num_gpus * pool.tensor_parallel_size  # one actor drives every rank of its tensor-parallel group
    return {"CPU": pool.num_cpus} | ({"GPU": gpus} if gpus else {}) | pool.resources
