"""`KVAgent`: one per worker; registers its KV cache, connects to peers, moves blocks, carries notifications.

NIXL-style API, synchronous and non-blocking for the caller: `read`/`write` validate at once (raising BadDescriptor
/ PeerLost), then return a `TransferHandle` while the work runs on the agent's event-loop thread (`LoopThread`).
The engine owns the cache tensor; between `read`/`write` and the handle finishing, the named blocks belong to the
transfer. On CUDA, a transfer starts after the work already queued on the caller's current stream (an event recorded
in `read`/`write`), so a prefill worker can `write` layer l right after launching it (layer-wise streaming).

The UCX backend is always the control plane (hello, requests, notifications); data goes through the first available
backend in `AgentConfig.backends` for that remote (see `kvtransfer.backends`). Caches of TP ranks hold different KV
head ranges: a read then names the heads it moves (`kvtransfer.head_slices`, `kvtransfer.tp_group`).

Failures: every one, refused at once or in flight, is counted in `metrics()` by operation and error class. Injected
faults (`AgentConfig.faults`, `set_faults`, $PDSERVE_KV_FAULTS) end the handle with a real fault's error before any
byte moves. After a real failure (or `remove_remote`) the destination blocks hold undefined data, but nothing lands
in them once the handle reports it: UCX operations and cuda_ipc copies are awaited (a receive not confirmed stopped
2 s after its abort quarantines its staging buffer, except one straight into a cache region).

Layout: this module holds the agent's start, cache registration, faults, peers, metrics and close; its data path
(read/write) is kvtransfer.agent_transfers, its notifications kvtransfer.agent_notifications (mixins).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from engine.kv_heads import KVHeadRange
from engine.kv_layout import KVCacheSpec

from . import backends, wire
from .agent_config import AgentConfig
from .agent_notifications import AgentNotifications
from .agent_transfers import AgentTransfers
from .backends.cuda_ipc import CudaIpcPeer, export
from .backends.ucx import UcxConnection, ucx_context
from .backends.ucx_server import UcxServer
from .cache import RegisteredCache
from .errors import PeerLost, TransferError
from .faults import FaultConfig, FaultInjector
from .inbox import Inbox
from .loop import LoopThread
from .metadata import AgentMetadata, CacheInfo, check_compatible, default_address, host_identity
from .metrics import TransferMetrics
from .notify_channel import NotifyListener
from .remotes import DROP_WAIT_S, Remote
from .serve import Server
from .staging import StagingPool
from .step_times import StepTimes, maybe_step

# the agent's own start (UCX's context and listeners: nothing remote) is bounded by this, not by connect_timeout_s:
# on a loaded 2-core CI machine starting several Ray nodes it once took longer than 10 s
START_TIMEOUT_S = 60.0


class KVAgent(AgentTransfers, AgentNotifications):
    def __init__(self, name: str, config: AgentConfig | None = None, address: str | None = None,
                 port: int = 0) -> None:
        self.name = name
        self.config = config or AgentConfig()
        if port and self.config.ucx_connect != "listener":
            raise ValueError(f"agent {name!r}: a UCX port ({port}) needs AgentConfig.ucx_connect='listener'")
        faults = self.config.faults if self.config.faults is not None else FaultConfig.from_env()
        self._faults = FaultInjector(faults)
        self._address = address or self.config.address or default_address()
        self._metrics = TransferMetrics()
        self._handshake = self.config.handshake
        self._inbox = Inbox()
        self._xids = itertools.count(1)
        self._cache: RegisteredCache | None = None
        self._info: CacheInfo | None = None
        self._client_pool: StagingPool | None = None
        self._serve_pool: StagingPool | None = None
        self._remotes: dict[str, Remote] = {}
        self._in_flight: set[asyncio.Task] = set()  # transfers started here and not ended
        # the agent's start and its cache's registration, step by step (a worker logs them: pool_worker.worker)
        self.start_steps = StepTimes()
        with self.start_steps.step("loop_thread"):
            self._loop = LoopThread(name)
        self._server = UcxServer(
            Server(lambda: self._cache, lambda: self._info, lambda: self._serve_pool, self._metrics, self._inbox, name)
        )
        self._notify_listener = NotifyListener(self._inbox.put)
        self._port, self._notify_port = 0, None
        self._worker_address: bytes | None = None
        self._accept_tag: int | None = None
        self._loop.call(self._start(port), max(self.config.connect_timeout_s, START_TIMEOUT_S))
        self._closed = False

    async def _start(self, port: int) -> None:
        steps = self.start_steps
        with steps.step("ucx_context"):  # the process's first agent creates it (UCX context, worker, threads)
            ucx_context()
        with steps.step("ucx_listen"):
            if self.config.ucx_connect == "listener":
                self._port = self._server.start(port)
            else:
                self._worker_address, self._accept_tag = self._server.start_by_worker_address()
        with steps.step("notify_listen"):
            self._notify_port = await self._notify_listener.start(self._address)

    # ---- memory registration -------------------------------------------------------------------------
    def register_cache(self, kv: torch.Tensor, spec: KVCacheSpec, heads: KVHeadRange | None = None) -> None:
        """Register the engine's KV cache (host or CUDA), kv: [num_blocks, num_layers, 2, block, heads, dim], holding
        the global KV heads `heads` (a TP rank's; None: all). Call before `metadata()` is handed to peers."""
        if self._cache is not None:
            raise ValueError(f"agent {self.name!r} already has a registered cache; deregister it first")
        steps = self.start_steps
        with steps.step("cache_views"):
            cache = RegisteredCache(kv, spec, heads)
        with steps.step("ipc_export"):  # one CUDA IPC handle, of the whole cache tensor
            ipc = export(cache) if "cuda_ipc" in self.config.backends else None
        with steps.step("cache_info"):
            self._client_pool = StagingPool(self.config.staging_bytes, cache.device, "client staging")
            self._serve_pool = StagingPool(self.config.staging_bytes, cache.device, "serve staging")
            self._info = cache.info(ipc)
        self._cache = cache

    def deregister_cache(self) -> None:
        """Forget the cache (no transfer may be in flight); cached staging memory is freed."""
        self._cache, self._info = None, None
        for pool in (self._client_pool, self._serve_pool):
            if pool is not None:
                self._loop.call(_clear(pool), 5.0)
        self._client_pool = self._serve_pool = None

    def metadata(self) -> AgentMetadata:
        return AgentMetadata(self.name, self._address, self._port, host_identity(), os.getpid(), self._info,
                             self._notify_port, self._worker_address, self._accept_tag)

    @property
    def cache_info(self) -> CacheInfo | None:
        """The registered cache's description (None before register_cache): metadata().cache without building the
        rest, which reads the host's identity from /proc (kept off every transfer's path)."""
        return self._info

    # ---- faults --------------------------------------------------------------------------------------
    @property
    def faults(self) -> FaultConfig:
        """The faults injected now."""
        return self._faults.config

    def set_faults(self, faults: FaultConfig | Mapping[str, object] | None) -> FaultConfig:
        """Inject `faults` from now on (a FaultConfig or a mapping of its fields; None or {}: none), with a fresh
        RNG from its seed and every peer's transfer count at 0. Transfers already started keep their fault."""
        config = faults if isinstance(faults, FaultConfig) else FaultConfig.from_dict(faults or {})
        self._faults = FaultInjector(config)
        return config

    # ---- peers ---------------------------------------------------------------------------------------
    def add_remote(self, meta: AgentMetadata | bytes, steps: StepTimes | None = None) -> str:
        """Load a peer's metadata, check layouts (IncompatibleLayout), connect (PeerLost / TransferTimeout).

        The same metadata again is a no-op. Other metadata under a known name replaces that remote (a new
        agent under its predecessor's name): the old one is dropped as by `remove_remote`, then the new one is
        connected. A remote lost to fault injection is reconnected even by the same metadata. `steps`: where to
        record how long each step took (None: not timed)."""
        with maybe_step(steps, "check"):
            if isinstance(meta, bytes | bytearray):
                meta = AgentMetadata.from_bytes(bytes(meta))
            check_compatible(self._info, meta, self.name)
            if meta.name == self.name:
                raise ValueError(f"an agent cannot add itself ({meta.name!r})")
            backend, _ = backends.choose(self.config.backends, self._cache, meta,
                                         meta.same_host_as(self.metadata()))
        self._loop.call(self._add_remote(meta, backend, steps, time.monotonic()),
                        self.config.connect_timeout_s + DROP_WAIT_S + 5.0)
        return meta.name

    async def _add_remote(self, meta: AgentMetadata, backend: str, steps: StepTimes | None = None,
                          submitted: float | None = None) -> None:
        if steps is not None and submitted is not None:  # how long the loop thread took to get to it
            steps.add("loop_wait", time.monotonic() - submitted)
        old = self._remotes.get(meta.name)
        if old is not None:
            same = old.meta == meta and old.backend == backend
            if same and old.lost is None:
                return
            # the same agent again after an injected drop: its own connection to us stays up
            with maybe_step(steps, "drop_old"):
                await self._remove_remote(meta.name, "replaced by a new agent of the same name", incoming=not same)
        remote = Remote(meta, backend)
        await self._connect(remote, time.monotonic() + self.config.connect_timeout_s, steps)
        if backend == "cuda_ipc":
            assert self._cache is not None and meta.cache is not None
            with maybe_step(steps, "ipc_open"):  # cudaIpcOpenMemHandle of the peer's whole cache
                remote.ipc = CudaIpcPeer(self._cache, meta.cache)
        self._remotes[meta.name] = remote

    async def _connect(self, r: Remote, deadline: float, steps: StepTimes | None = None) -> UcxConnection:
        """`r`'s UCX connection, opened (with the handshake's retries) if there is none or it broke."""
        return await r.connect(self._hello, deadline, self._handshake, self._metrics, steps)

    def _hello(self) -> dict:
        return {"op": "hello", "meta": wire.b64(self.metadata().to_bytes())}

    def remove_remote(self, name: str) -> bool:
        """Forget a peer: its metadata, our connection to it, the connections it opened to us and the mapping
        of its cache. Every transfer in flight with it has failed with PeerLost when this returns; later ones
        are refused (PeerLost) until a peer of that name is added again. False if `name` was not known."""
        return self._loop.call(self._remove_remote(name, "removed"), DROP_WAIT_S + 10.0)

    async def _remove_remote(self, name: str, reason: str, incoming: bool = True) -> bool:
        r = self._remotes.pop(name, None)
        self._faults.forget(name)
        if r is None:
            return False
        await r.drop(reason)
        if incoming:  # only the endpoints this very agent opened (a successor of the same name may be connected)
            key = r.meta.identity
            self._server.abort_peers(lambda p: p.meta is not None and p.meta.identity == key, f"{name!r} {reason}")
        return True

    def remotes(self) -> dict[str, str]:
        """{remote name: backend used for its data}, for the remotes that are not lost."""
        return {k: r.backend for k, r in self._remotes.items() if r.lost is None}

    def _remote(self, name: str) -> Remote:
        r = self._remotes.get(name)
        if r is None:
            raise PeerLost(f"agent {self.name!r} has no remote {name!r} (add_remote first, or it was removed)")
        return r

    def _refused(self, op: str, check: Callable[[], Any]) -> Any:
        """Run the synchronous checks of a call; a refusal counts as a failure of `op`, like one in flight."""
        try:
            if self._closed:
                raise TransferError(f"agent {self.name!r} is closed")
            return check()
        except TransferError as e:
            self._metrics.record_failure(op, e)
            raise

    # ---- observability and shutdown ------------------------------------------------------------------
    def metrics(self) -> dict:
        """Counters (see TransferMetrics.snapshot) plus staging slots in use / quarantined, transfers in flight,
        the usable remotes {name: backend} and the lost ones {name: why}."""
        snap = self._metrics.snapshot()
        pools = [p for p in (self._client_pool, self._serve_pool) if p is not None]
        snap["staging_in_use"] = sum(p.in_use for p in pools)
        snap["staging_quarantined"] = sum(p.quarantined for p in pools)
        snap["in_flight"] = len(self._in_flight)
        snap["remotes"] = self.remotes()
        snap["lost_remotes"] = {k: r.lost for k, r in self._remotes.items() if r.lost is not None}
        return snap

    def close(self) -> None:
        """Disconnect from every peer, stop listening, stop the loop thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.call(self._aclose(), 15.0)
        finally:
            self._loop.stop()

    async def _aclose(self) -> None:
        remotes, self._remotes = list(self._remotes.values()), {}
        for r in remotes:
            await r.close()
        await self._notify_listener.close()
        await self._server.close()

    def __enter__(self) -> KVAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _clear(pool: StagingPool) -> None:
    pool.clear()
