"""`KVAgent`: one per worker; registers its KV cache, connects to peers, moves blocks, carries notifications.

NIXL-style API, synchronous and non-blocking for the caller: `read`/`write` validate at once (raising
BadDescriptor / PeerLost synchronously), then return a `TransferHandle` while the work runs on the agent's
own event-loop thread (`LoopThread`). Ownership: the engine owns the cache tensor; between `read`/`write`
and the handle finishing, the named blocks belong to the transfer and must not be reused. On CUDA, the
transfer starts after the work already queued on the caller's current stream (an event recorded in
`read`/`write`), so a prefill worker can `write` layer l right after launching it (layer-wise streaming).

The UCX backend is always the control plane (hello, requests, notifications); data goes through the
first available backend in `AgentConfig.backends` for that remote (see `kvtransfer.backends`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import torch

from engine.kv_layout import KVCacheSpec

from . import backends, wire
from .backends.cuda_ipc import CudaIpcPeer, export
from .backends.ucx import UcxConnection, UcxServer
from .cache import RegisteredCache, event_done
from .client import ucx_chunk
from .descriptors import Chunk, plan
from .errors import BadDescriptor, PeerLost, TransferError, TransferTimeout
from .handle import TransferHandle
from .inbox import Inbox
from .loop import LoopThread
from .metadata import AgentMetadata, CacheInfo, check_compatible, default_address, host_identity
from .metrics import TransferMetrics
from .serve import Server
from .staging import StagingPool


@dataclass(frozen=True)
class AgentConfig:
    max_chunk_bytes: int = 4 << 30  # one cuda_ipc kernel launch moves at most this much
    ucx_chunk_bytes: int = 512 << 20  # one UCX message carries at most this much (fewer round trips)
    staging_bytes: int = 1 << 30  # per staging pool (client side, serving side, and per IPC peer GPU)
    timeout_s: float = 30.0  # default deadline of a transfer
    connect_timeout_s: float = 10.0
    backends: tuple[str, ...] = ("cuda_ipc", "ucx")  # preference order


@dataclass
class _Remote:
    meta: AgentMetadata
    backend: str
    conn: UcxConnection | None = None
    ipc: CudaIpcPeer | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class KVAgent:
    def __init__(self, name: str, config: AgentConfig | None = None, address: str | None = None,
                 port: int = 0) -> None:
        self.name = name
        self.config = config or AgentConfig()
        self._address = address or default_address()
        self._metrics = TransferMetrics()
        self._inbox = Inbox()
        self._xids = itertools.count(1)
        self._cache: RegisteredCache | None = None
        self._info: CacheInfo | None = None
        self._client_pool: StagingPool | None = None
        self._serve_pool: StagingPool | None = None
        self._remotes: dict[str, _Remote] = {}
        self._loop = LoopThread(name)
        self._server = UcxServer(
            Server(lambda: self._cache, lambda: self._info, lambda: self._serve_pool, self._metrics, self._inbox)
        )
        self._port = self._loop.call(self._start(port), self.config.connect_timeout_s)
        self._closed = False

    async def _start(self, port: int) -> int:
        return self._server.start(port)

    # ---- memory registration -------------------------------------------------------------------------
    def register_cache(self, kv: torch.Tensor, spec: KVCacheSpec) -> None:
        """Register the engine's KV cache (host or CUDA), kv: [num_blocks, num_layers, 2, block, heads, dim].

        Call before `metadata()` is handed to peers: the metadata describes this cache.
        """
        if self._cache is not None:
            raise ValueError(f"agent {self.name!r} already has a registered cache; deregister it first")
        cache = RegisteredCache(kv, spec)
        ipc = export(cache) if "cuda_ipc" in self.config.backends else None
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
        return AgentMetadata(self.name, self._address, self._port, host_identity(), os.getpid(), self._info)

    # ---- peers ---------------------------------------------------------------------------------------
    def add_remote(self, meta: AgentMetadata | bytes) -> str:
        """Load a peer's metadata, check layouts (IncompatibleLayout), connect (PeerLost / TransferTimeout)."""
        if isinstance(meta, bytes | bytearray):
            meta = AgentMetadata.from_bytes(bytes(meta))
        check_compatible(self._info, meta)
        if meta.name == self.name:
            raise ValueError(f"an agent cannot add itself ({meta.name!r})")
        backend, _ = backends.choose(self.config.backends, self._cache, meta,
                                     meta.same_host_as(self.metadata()))
        self._loop.call(self._add_remote(meta, backend), self.config.connect_timeout_s + 5.0)
        return meta.name

    async def _add_remote(self, meta: AgentMetadata, backend: str) -> None:
        old = self._remotes.pop(meta.name, None)
        if old is not None:
            await _close_remote(old)
        remote = _Remote(meta, backend)
        await self._connect(remote, time.monotonic() + self.config.connect_timeout_s)
        if backend == "cuda_ipc":
            assert self._cache is not None and meta.cache is not None
            remote.ipc = CudaIpcPeer(self._cache, meta.cache)
        self._remotes[meta.name] = remote

    async def _connect(self, remote: _Remote, deadline: float) -> UcxConnection:
        async with remote.lock:
            if remote.conn is None or remote.conn.broken is not None:
                hello = {"op": "hello", "meta": wire.b64(self.metadata().to_bytes())}
                m = remote.meta
                remote.conn = await UcxConnection.open(m.address, m.port, m.name, hello, deadline)
            return remote.conn

    def remove_remote(self, name: str) -> None:
        """Disconnect and forget a peer; its in-flight transfers fail with PeerLost."""
        self._loop.call(self._remove_remote(name), 10.0)

    async def _remove_remote(self, name: str) -> None:
        remote = self._remotes.pop(name, None)
        if remote is not None:
            await _close_remote(remote)

    def remotes(self) -> dict[str, str]:
        """{remote name: backend used for its data}."""
        return {k: r.backend for k, r in self._remotes.items()}

    # ---- transfers -----------------------------------------------------------------------------------
    def read(self, remote: str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
             layers: tuple[int, int] | None = None, notify: bytes | None = None,
             timeout: float | None = None) -> TransferHandle:
        """Pull remote blocks into local blocks (pairwise), layers [l0, l1) or all; then send `notify`."""
        return self._submit("read", remote, local_block_ids, remote_block_ids, layers, notify, timeout)

    def write(self, remote: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
              layers: tuple[int, int] | None = None, notify: bytes | None = None,
              timeout: float | None = None) -> TransferHandle:
        """Push local blocks into remote blocks (pairwise), layers [l0, l1) or all; then send `notify`,
        which the peer sees only after the data is in its cache."""
        return self._submit("write", remote, local_block_ids, remote_block_ids, layers, notify, timeout)

    def notify(self, remote: str, msg: bytes, timeout: float | None = None) -> TransferHandle:
        """Send a small message; it arrives after every transfer to `remote` that finished before."""
        self._remote(remote)
        deadline = time.monotonic() + (timeout or self.config.timeout_s)
        fut = self._loop.submit(self._notify(remote, bytes(msg), deadline))
        return TransferHandle(fut, "notify", remote, len(msg))

    def notify_after(self, remote: str, msg: bytes, handles: Sequence[TransferHandle],
                     timeout: float | None = None) -> TransferHandle:
        """Send `msg` once all `handles` succeeded (without blocking the caller); if one fails, the
        message is not sent and this handle fails with that error."""
        self._remote(remote)
        deadline = time.monotonic() + (timeout or self.config.timeout_s)

        async def run() -> None:
            for h in handles:
                await asyncio.wrap_future(h.future)
            await self._notify(remote, bytes(msg), deadline)

        return TransferHandle(self._loop.submit(run()), "notify", remote, len(msg))

    def get_notifications(self) -> dict[str, list[bytes]]:
        """Drain received notifications: {sender agent name: [msg, ...]} in arrival order."""
        return self._inbox.drain()

    def wait_notifications(self, timeout: float) -> dict[str, list[bytes]]:
        """Like get_notifications, but first wait up to `timeout` s for at least one."""
        self._inbox.wait(timeout)
        return self._inbox.drain()

    def _remote(self, name: str) -> _Remote:
        r = self._remotes.get(name)
        if r is None:
            raise PeerLost(f"agent {self.name!r} has no remote {name!r} (add_remote first, or it was removed)")
        return r

    def _submit(self, op: str, remote: str, local_ids: Sequence[int], remote_ids: Sequence[int],
                layers: tuple[int, int] | None, notify: bytes | None, timeout: float | None) -> TransferHandle:
        if self._closed:
            raise TransferError(f"agent {self.name!r} is closed")
        r = self._remote(remote)
        cache = self._cache
        if cache is None or r.meta.cache is None:
            raise BadDescriptor(f"{op}: both {self.name!r} and {remote!r} need a registered cache")
        chunk = self.config.ucx_chunk_bytes if r.backend == "ucx" else self.config.max_chunk_bytes
        chunks = plan(local_ids, remote_ids, layers, cache.spec, cache.num_blocks, r.meta.cache.num_blocks,
                      min(chunk, self.config.staging_bytes))
        nbytes = sum(c.nbytes(cache.spec) for c in chunks)
        ready = cache.caller_event()
        deadline = time.monotonic() + (timeout or self.config.timeout_s)
        if r.ipc is not None:  # queue the GPU copies now, from this thread; the loop only awaits completion
            t0 = time.monotonic()
            done = r.ipc.launch(op, chunks, ready)
            fut = self._loop.submit(self._finish_ipc(op, r, done, nbytes, notify, deadline, t0))
            return TransferHandle(fut, op, remote, nbytes, gpu_done=done if notify is None else None)
        fut = self._loop.submit(self._transfer(op, r, cache, chunks, ready, notify, deadline))
        return TransferHandle(fut, op, remote, nbytes)

    async def _finish_ipc(self, op: str, r: _Remote, done: torch.cuda.Event, nbytes: int, notify: bytes | None,
                          deadline: float, t0: float) -> None:
        async with self._recorded(op, r):
            # Without a notification the caller's handle watches the event itself; spinning here as well would
            # only fight the caller for the GIL, so this thread blocks in cudaEventSynchronize instead.
            await event_done(done, deadline, spin_s=0.05 if notify is not None else 0.0)
            if notify is not None:
                await self._notify(r.meta.name, notify, deadline)
            self._metrics.record_ok(op, nbytes, time.monotonic() - t0)

    async def _transfer(self, op: str, r: _Remote, cache: RegisteredCache, chunks: list[Chunk],
                        ready: torch.cuda.Event | None, notify: bytes | None, deadline: float) -> None:
        t0 = time.monotonic()
        async with self._recorded(op, r):
            conn = await self._connect(r, deadline)
            cache.wait_event(ready)
            pool = self._client_pool
            assert pool is not None
            jobs = [ucx_chunk(op, conn, cache, pool, c, next(self._xids), deadline) for c in chunks]
            results = await asyncio.gather(*jobs, return_exceptions=True)
            errors = [e for e in results if isinstance(e, BaseException)]
            if errors:  # a timeout aborts the connection, failing the others: report the timeout
                raise next((e for e in errors if isinstance(e, TransferTimeout)), errors[0])
            if notify is not None:
                await self._notify(r.meta.name, notify, deadline)
            self._metrics.record_ok(op, sum(results), time.monotonic() - t0)  # type: ignore[arg-type]

    @contextlib.asynccontextmanager
    async def _recorded(self, op: str, r: _Remote) -> AsyncIterator[None]:
        """Count a failure in the metrics and surface anything unexpected as a TransferError."""
        try:
            yield
        except TransferError as e:
            self._metrics.record_failure(op, e)
            raise
        except Exception as e:  # noqa: BLE001
            self._metrics.record_failure(op, e)
            raise TransferError(f"{op} with {r.meta.name!r} failed: {e!r}") from e

    async def _notify(self, remote: str, msg: bytes, deadline: float) -> None:
        r = self._remote(remote)
        conn = await self._connect(r, deadline)
        await conn.send_request({"op": "notify", "msg": wire.b64(msg)}, deadline)

    # ---- observability and shutdown ------------------------------------------------------------------
    def metrics(self) -> dict:
        """Counters (see TransferMetrics.snapshot) plus staging slots in use / quarantined and remotes."""
        snap = self._metrics.snapshot()
        pools = [p for p in (self._client_pool, self._serve_pool) if p is not None]
        snap["staging_in_use"] = sum(p.in_use for p in pools)
        snap["staging_quarantined"] = sum(p.quarantined for p in pools)
        snap["remotes"] = self.remotes()
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
        for name in list(self._remotes):
            await self._remove_remote(name)
        await self._server.close()

    def __enter__(self) -> KVAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _close_remote(remote: _Remote) -> None:
    if remote.conn is not None:
        await remote.conn.close()
    if remote.ipc is not None:
        remote.ipc.close()


async def _clear(pool: StagingPool) -> None:
    pool.clear()
