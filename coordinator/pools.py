"""Pools: creates, starts, wires and stops the worker actors of both pools on the Ray cluster.

Each pool's workers go into one placement group (PACK keeps them on as few nodes as possible, SPREAD across
nodes), each worker in its own bundle with its CPUs/GPUs and the pool's custom resources (`resources:`), so a
pool lands only on nodes started with them (`ray start --resources`, a node type's `resources` under `ray up`).
start() returns once every worker has loaded its model and reported its KV capacity; in disaggregated mode every
decode worker then connects to every prefill worker's transfer agent. The actor classes live in prefill_pool/
and decode_pool/.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from coordinator.router import WorkerState
from coordinator.serve_config import PoolConfig, ServeConfig
from decode_pool.worker import DecodeWorker
from engine.tiny import resolve_model_path
from kvtransfer import AgentConfig
from prefill_pool.worker import PrefillWorker

START_TIMEOUT_S = 600.0
PLACEMENT_TIMEOUT_S = 60.0


class Pools:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.prefill: list[WorkerState] = []
        self.decode: list[WorkerState] = []
        self.model_path = ""
        self._groups: list = []
        self._started_ray = False

    @property
    def all_workers(self) -> list[WorkerState]:
        return self.prefill + self.decode

    async def start(self) -> None:
        cfg = self.config
        self.model_path = str(resolve_model_path(cfg.model))  # builds `tiny` once, before the workers race to
        if not ray.is_initialized():
            _init_ray(cfg.ray_address)
            self._started_ray = cfg.ray_address is None
        cfg = replace(cfg, model=self.model_path)  # workers load the resolved folder
        agent = AgentConfig(backends=cfg.transfer.backends, timeout_s=cfg.transfer.timeout_s)
        roles = [("decode", cfg.decode)] + ([("prefill", cfg.prefill)] if cfg.mode == "disaggregated" else [])
        for role, pool in roles:
            self._groups.append(self._group(pool, role))
        await self._placed()
        decode_actors = self._actors(DecodeWorker, cfg.decode, self._groups[0], lambda i: (
            f"decode-{i}", cfg.engine_config(cfg.decode, seed=1000 + i),
            agent if cfg.mode == "disaggregated" else None, _threads(cfg.decode), cfg.admission.timeout_s))
        prefill_actors = []
        if cfg.mode == "disaggregated":
            prefill_actors = self._actors(PrefillWorker, cfg.prefill, self._groups[1], lambda i: (
                f"prefill-{i}", cfg.engine_config(cfg.prefill, seed=i), agent, _threads(cfg.prefill)))
        infos = await asyncio.wait_for(
            asyncio.gather(*[a.start.remote() for a in prefill_actors + decode_actors]), START_TIMEOUT_S)
        n = len(prefill_actors)
        self.prefill = [WorkerState(info, a) for info, a in zip(infos[:n], prefill_actors, strict=True)]
        self.decode = [WorkerState(info, a) for info, a in zip(infos[n:], decode_actors, strict=True)]
        await asyncio.gather(*[d.handle.add_peer.remote(p.info.agent_metadata)
                               for d in self.decode for p in self.prefill])

    async def shutdown(self) -> None:
        workers = self.all_workers
        await asyncio.gather(*[w.handle.shutdown.remote() for w in workers if w.alive], return_exceptions=True)
        for w in workers:
            ray.kill(w.handle, no_restart=True)
        for group in self._groups:
            remove_placement_group(group)
        self._groups.clear()
        if self._started_ray:
            ray.shutdown()

    async def _placed(self) -> None:
        """Wait until the placement groups have their resources; fail clearly when the cluster lacks them."""
        try:
            await asyncio.wait_for(asyncio.gather(*[g.ready() for g in self._groups]), PLACEMENT_TIMEOUT_S)
        except TimeoutError:
            wanted = [g.bundle_specs for g in self._groups]
            raise RuntimeError(f"the Ray cluster cannot place the pools within {PLACEMENT_TIMEOUT_S:.0f} s: they need "
                               f"{wanted}, the cluster has {ray.available_resources()}; lower num_cpus / num_gpus "
                               "or workers in the config") from None

    def _group(self, pool: PoolConfig, role: str):
        strategy = "PACK" if self.config.placement == "pack" else "SPREAD"
        return placement_group([worker_bundle(pool)] * pool.workers, strategy=strategy, name=f"pdserve-{role}")

    def _actors(self, cls: type, pool: PoolConfig, group, args) -> list:
        remote_cls = ray.remote(cls)
        return [remote_cls.options(
            num_cpus=pool.num_cpus, num_gpus=pool.num_gpus, resources=dict(pool.resources), max_concurrency=10_000,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
        ).remote(*args(i)) for i in range(pool.workers)]


def worker_bundle(pool: PoolConfig) -> dict[str, float]:
    """What one worker of `pool` reserves on its node: CPUs, GPUs and the pool's custom resources."""
    return {"CPU": pool.num_cpus} | ({"GPU": pool.num_gpus} if pool.num_gpus else {}) | pool.resources


def _init_ray(address: str | None) -> None:
    """Join `address` ("auto": the running cluster) or start a local Ray. A local start waits a fixed 30 s
    for its raylet; on a loaded machine that can run out, so a local start is tried twice."""
    env = {"PDSERVE_CACHE": os.environ["PDSERVE_CACHE"]} if os.environ.get("PDSERVE_CACHE") else {}
    for attempt in (1, 2):
        try:
            ray.init(address=address, include_dashboard=False, logging_level="WARNING",
                     runtime_env={"env_vars": env} if env else None)
            return
        except Exception as e:  # Ray raises a bare Exception for this
            if address is not None or attempt == 2 or "timed out during startup" not in str(e):
                raise
            ray.shutdown()


def _threads(pool: PoolConfig) -> int:
    return max(1, int(pool.num_cpus))

