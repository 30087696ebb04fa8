"""Pools: creates, starts, wires, replaces and stops the worker actors of both pools on the Ray cluster.

Each pool's workers go into one placement group, each worker slot in its own bundle
(coordinator.backend.placement_groups), so a pool lands only on nodes with its resources (`ray start --resources`, a
node type's `resources` under `ray up`).
start() returns once every worker has loaded its model and reported its KV capacity and the workers' transfer agents
are connected along coordinator.backend.peer_links' links (disaggregated: decode to prefill, and the other way round
with pushes; adaptive: every worker to every other). Adaptive workers start in their pool's role
(the pools' sizes are the starting split); `role_workers` then follows each worker's current role. `start_slot()`
brings one slot up again
(same config, same bundle: Ray re-places a bundle whose node died, when the cluster has room) and `connect()`
wires it to its live peers; the Supervisor (coordinator.backend.supervisor) decides when. The actor classes live in
pool_worker/ (one class: a worker's role is what the coordinator sends it).
With a namespace (`pdserve serve` always sets one) the workers and placement groups are detached and named
(coordinator.backend.fleet): they outlive this coordinator, and start() first adopts the fleet a dead one left
(coordinator.backend.adoption) instead of starting its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import ray

from coordinator.admission.router import WorkerState
from coordinator.backend.adoption import adopt
from coordinator.backend.fleet import actor_name, fingerprint, teardown
from coordinator.backend.launch_clock import since_launch
from coordinator.backend.peer_links import connect_link, peer_links, waves
from coordinator.backend.placement_groups import PlacementGroups, worker_bundle
from coordinator.backend.ray_start import init_ray
from coordinator.backend.warm_processes import WarmProcesses
from coordinator.config.serve_config import PoolConfig, ServeConfig
from engine.tiny import resolve_model_path
from kvtransfer import AgentConfig
from pool_worker.worker import Worker

START_TIMEOUT_S = 600.0

log = logging.getLogger(__name__)


class Pools:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.prefill: list[WorkerState] = []
        self.decode: list[WorkerState] = []
        self.model_path = ""
        self.groups = PlacementGroups(config)  # the pools', spares' and scaled slots' groups and bundles
        self.scaled: set[str] = set()  # slots the scaler added (coordinator.backend.scaler): they die with this
        self._started_ray = False
        self.fleet = ""  # the fleet's fingerprint when it has a namespace (coordinator.backend.fleet)
        self.adopted = False  # start() took over a dead coordinator's workers
        self.keep_fleet = False  # shutdown() leaves the workers running (a crash: the next coordinator adopts them)
        self.warm = WarmProcesses(config.recovery.warm_processes)  # processes started ahead for later worker starts

    @property
    def all_workers(self) -> list[WorkerState]:
        return self.prefill + self.decode

    def role_workers(self, role: str) -> list[WorkerState]:
        """The workers that take `role`'s work ("prefill": prompts for others; "decode": decoding)."""
        if self.config.adaptive:
            return [w for w in self.all_workers if (w.prefills if role == "prefill" else w.decodes)]
        return self.prefill if role == "prefill" else self.decode

    @property
    def roles(self) -> tuple[str, ...]:
        """The pools that must each have a live worker to serve (adaptive: a worker that decodes; any can prefill)."""
        return ("prefill", "decode") if self.config.mode == "disaggregated" else ("decode",)

    @property
    def pool_names(self) -> tuple[str, ...]:
        """The pools the workers are started from (their slots' configs and placement groups)."""
        return self.config.pool_names

    @property
    def transfers(self) -> bool:
        """Workers hand KV over to each other (not collocated)."""
        return self.config.transfers

    async def start(self) -> None:
        cfg = self.config
        self.model_path = str(resolve_model_path(cfg.model))  # builds `tiny` once, before the workers race to
        if not ray.is_initialized():
            init_ray(cfg.ray_address, cfg.namespace, transfers=self.transfers)
            self._started_ray = cfg.ray_address is None
        self.config = cfg = replace(cfg, model=self.model_path)  # workers load the resolved folder
        if cfg.namespace is not None:
            self.fleet = fingerprint(cfg, self.pool_names)
            found = await adopt(self)
            if found is not None:
                workers, fresh = found
                self.adopted = True
                self.prefill = [w for w in workers if w.info.role == "prefill"]
                self.decode = [w for w in workers if w.info.role != "prefill"]
                for w in fresh:
                    await self.connect(w)
                await self._warm_up_nodes()
                return
            await teardown("starting a new fleet")  # what a crash between two starts may have left
        for role in self.pool_names:
            self.groups.create(role, self.pool(role))
        await self.groups.placed()
        slots = [(role, i) for role in self.pool_names for i in range(self.pool(role).workers)]
        log.warning("requesting %d workers, %s", len(slots), since_launch())
        started = await asyncio.wait_for(asyncio.gather(*[self.start_slot(role, i, replace_process=False)
                                                          for role, i in slots]), START_TIMEOUT_S)
        for w in started:  # start-up time per phase, the operator's first question about a slow start
            log.warning("worker %s ready: %s (%s)", w.name, ", ".join(f"{k} {v:.2f} s" for k, v in w.info.startup_s),
                        since_launch() or "started")
        self.prefill = [w for w in started if w.info.role == "prefill"]
        self.decode = [w for w in started if w.info.role != "prefill"]
        for wave in waves(self._links(started)):  # one direction of every pair, then the other
            await asyncio.gather(*[connect_link(lambda a=a, b=b: a.handle.add_peer.remote(b.info.agent_metadata),
                                               f"{a.name} to {b.name}") for a, b in wave])
        await self._warm_up_nodes()

    async def _warm_up_nodes(self) -> None:
        """recovery.warm_processes worker processes started ahead on each node that holds a slot's bundle."""
        nodes = {await self.groups.node(role, i) for role in self.pool_names for i in range(self.pool(role).workers)}
        await asyncio.gather(*[self.warm.top_up(node, self.warm.count) for node in nodes if node is not None])

    def _links(self, workers: list[WorkerState]) -> list[tuple[WorkerState, WorkerState]]:
        return peer_links(workers, self.config.mode, self.pushes, self.prefills_connect)

    @property
    def prefills_connect(self) -> bool:
        """Disaggregated, with prefix fetching on (transfer.prefix_fetch_min_tokens, both pools at TP=1): prefill
        workers connect to each other too, so one can fetch a prompt's prefix another holds
        (coordinator.backend.prefix_fetch)."""
        cfg = self.config
        return (self.transfers and not cfg.adaptive and cfg.transfer.prefix_fetch_min_tokens is not None
                and cfg.prefill.tensor_parallel_size == 1 and cfg.decode.tensor_parallel_size == 1)

    @property
    def pushes(self) -> bool:
        """Prefill workers write the KV into decode workers' blocks (transfer.push, both pools at TP=1), so they
        connect to every decode worker as well."""
        cfg = self.config
        return (self.transfers and cfg.transfer.push and cfg.prefill.tensor_parallel_size == 1
                and cfg.decode.tensor_parallel_size == 1)

    async def start_slot(self, role: str, index: int, incarnation: int = 0, current_role: str = "",
                         name: str | None = None, replace_process: bool = True) -> WorkerState:
        """Create slot `index` of `role`'s pool in its bundle and wait until it has loaded the model; it takes
        `current_role` (adaptive: the role its slot had; "": its pool's). `name`: an actor of `role`'s config under
        another name (a warm spare), in the bundle `bundles` gives it. On any failure the new actor is killed,
        so a failed start leaves nothing behind. A worker that took a process started ahead has another started
        in its place (`replace_process`; not for the first workers: start() then tops every node up at once)."""
        handle = self._actor(role, index, incarnation, name)
        try:
            info = await handle.start.remote()
            load = await handle.load.remote()  # its gauges exist from the moment it is installed
        except BaseException:
            ray.kill(handle, no_restart=True)
            raise
        if replace_process and dict(info.startup_s).get("schedule") == 0:  # it took a process started ahead
            await self.warm.top_up(await self.groups.node(*self.groups.slot_bundle(name or f"{role}-{index}", role,
                                                                                   index)))
        return WorkerState(info, handle, incarnation=incarnation, load=load, role=current_role)

    async def connect(self, worker: WorkerState) -> None:
        """Exchange transfer metadata between a (replacement) worker and its live peers, along every link
        (coordinator.backend.peer_links) it has: it adds the agents it links to, and each live peer linked to it
        drops the old agent of its name and adds the new one."""
        live = [w for w in self.all_workers if w.alive and w.name != worker.name] + [worker]
        links = [(a, b) for a, b in self._links(live) if a is worker or b is worker]
        await asyncio.gather(*[
            connect_link(lambda b=b: worker.handle.add_peer.remote(b.info.agent_metadata), f"{a.name} to {b.name}")
            if a is worker else
            connect_link(lambda a=a: a.handle.replace_peer.remote(worker.name, worker.info.agent_metadata),
                        f"{a.name} to {b.name}")
            for a, b in links])

    async def disconnect(self, dead: WorkerState) -> None:
        """Every live worker linked to a dead one forgets its agent, releasing its mapped cache (a CUDA IPC mapping
        would keep the dead process's GPU memory allocated, and its replacement would find it taken)."""
        live = [w for w in self.all_workers if w.alive and w.name != dead.name] + [dead]
        peers = [a for a, b in self._links(live) if b is dead]
        await asyncio.gather(*[w.handle.drop_peer.remote(dead.name) for w in peers], return_exceptions=True)

    def install(self, worker: WorkerState) -> None:
        """Put `worker` into its slot (replacing the dead incarnation of the same name)."""
        workers = self.prefill if worker.info.role == "prefill" else self.decode  # its slot's pool
        for i, w in enumerate(workers):
            if w.name == worker.name:
                workers[i] = worker
                return
        workers.append(worker)

    def remove(self, worker: WorkerState) -> None:
        """Take slot `worker` out of its pool for good (a scale-in): nothing sees it again, nothing replaces it."""
        workers = self.prefill if worker.info.role == "prefill" else self.decode
        workers[:] = [w for w in workers if w.name != worker.name]

    def give_back(self, name: str, role: str) -> None:
        """Slot `name` of pool `role` is gone for good: its bundle goes back (PlacementGroups.release)."""
        self.scaled.discard(name)
        self.groups.release(name, role)

    @staticmethod
    def slot_index(worker: WorkerState) -> int:
        return int(worker.name.rsplit("-", 1)[1])

    async def shutdown(self) -> None:
        if self.keep_fleet:  # a crashed coordinator's: left running for the next one (coordinator.backend.adoption)
            return
        workers = self.all_workers
        await asyncio.gather(*[w.handle.shutdown.remote() for w in workers if w.alive], return_exceptions=True)
        for w in workers:
            ray.kill(w.handle, no_restart=True)
        self.groups.remove_all()
        if self.config.namespace is not None:  # on purpose: the namespace ends empty (a start under way included)
            await teardown("the server is stopping")
        if self._started_ray:
            ray.shutdown()

    def pool(self, role: str) -> PoolConfig:
        return self.config.prefill if role == "prefill" else self.config.decode

    def _actor(self, role: str, index: int, incarnation: int = 0, name: str | None = None):
        cfg, pool = self.config, self.pool(role)
        spare = name is not None
        name = name or f"{role}-{index}"
        options = dict(num_cpus=pool.num_cpus, num_gpus=worker_bundle(pool).get("GPU", 0),
                       resources=dict(pool.resources), max_concurrency=10_000,
                       scheduling_strategy=self.groups.strategy(name, role, index))
        # peers reach a worker's KV agent by its UCX worker address, so it has no UCX listener (which ucxx opens on
        # every interface); UCX's own sockets follow transfer.net_devices, else UCX_NET_DEVICES (a single host's: lo,
        # ray_network). docs/operations.md, Security model
        agent = AgentConfig(backends=cfg.transfer.backends, timeout_s=cfg.transfer.timeout_s,
                            ucx_connect="worker_address", net_devices=cfg.transfer.net_devices)
        seed = index if role == "prefill" else 1000 + index
        if cfg.namespace is not None and not spare and name not in self.scaled:  # outlives this coordinator
            # (coordinator.backend.fleet); a spare, and a slot the scaler added, die with it
            options |= dict(name=actor_name(role, index, incarnation), lifetime="detached")
        return ray.remote(Worker).options(**options).remote(
            name, cfg.engine_config(pool, seed=seed), agent if self.transfers else None, _threads(pool),
            cfg.admission.timeout_s, role=role if self.transfers else "collocated", stream=True, fleet=self.fleet,
            requested_at=time.time())  # the start's `schedule` and `process` phases (pool_worker.start_phases)


def _threads(pool: PoolConfig) -> int:
    return max(1, int(pool.num_cpus))
