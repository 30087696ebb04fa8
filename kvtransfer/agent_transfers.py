"""AgentTransfers: KVAgent's data path, a mixin (kvtransfer.agent builds the state it reads).

`read` / `write` check a transfer at once (BadDescriptor / PeerLost, counted as failures like one in flight), plan
its chunks (kvtransfer.head_slices) and hand the work to the agent's loop thread, returning a TransferHandle: on
CUDA to a peer mapped through cuda_ipc the copies are queued from the caller's thread and the loop awaits their
event; otherwise the loop moves the chunks over UCX through the staging pool. A notification asked for goes after
the data has landed (kvtransfer.agent_notifications).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import torch

from .cache import RegisteredCache, event_done
from .client import ucx_chunk
from .descriptors import Chunk
from .errors import BadDescriptor, TransferTimeout
from .faults import NO_FAULT
from .handle import TransferHandle
from .head_slices import plan_transfer
from .remotes import DROP_WAIT_S, Remote, run_transfer


class AgentTransfers:
    def read(self, remote: str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
             layers: tuple[int, int] | None = None, notify: bytes | None = None,
             timeout: float | None = None, heads: tuple[int, int] | None = None,
             ready: torch.cuda.Event | None = None) -> TransferHandle:
        """Pull remote blocks into local blocks (pairwise), layers [l0, l1) or all, the global KV heads [h0, h1)
        (held by both caches; see kvtransfer.head_slices) or all (equal head ranges); then send `notify`. On CUDA
        the copies start after `ready` (an event on the cache's device: the local blocks' last writer), or with
        None after everything the caller's current stream has queued now."""
        return self._submit("read", remote, local_block_ids, remote_block_ids, layers, notify, timeout, heads,
                            ready)

    def write(self, remote: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
              layers: tuple[int, int] | None = None, notify: bytes | None = None,
              timeout: float | None = None) -> TransferHandle:
        """Push local blocks into remote blocks (pairwise), layers [l0, l1) or all; then send `notify`,
        which the peer sees only after the data is in its cache."""
        return self._submit("write", remote, local_block_ids, remote_block_ids, layers, notify, timeout, None)

    def _submit(self, op: str, remote: str, local_ids: Sequence[int], remote_ids: Sequence[int],
                layers: tuple[int, int] | None, notify: bytes | None, timeout: float | None,
                heads: tuple[int, int] | None, ready: torch.cuda.Event | None = None) -> TransferHandle:
        def check() -> tuple[Remote, list[Chunk]]:
            r = self._notify_check(remote, notify)
            if self._info is None or r.meta.cache is None:
                raise BadDescriptor(f"{op}: both {self.name!r} and {remote!r} need a registered cache")
            size = self.config.ucx_chunk_bytes if r.backend == "ucx" else self.config.max_chunk_bytes
            return r, plan_transfer(op, local_ids, remote_ids, layers, heads, self._info, r.meta.cache, remote,
                                    min(size, self.config.staging_bytes))

        r, chunks = self._refused(op, check)
        cache = self._cache
        assert cache is not None
        nbytes = sum(c.nbytes(cache.spec) for c in chunks)
        fault = self._faults.decide(remote) if r.lost is None else NO_FAULT
        if ready is None:
            ready = cache.caller_event()
        t0 = time.monotonic()
        deadline = t0 + (timeout or self.config.timeout_s)
        gpu_done = None
        ipc = r.ipc  # read once: the agent's loop may drop the remote meanwhile (then launch raises PeerLost)
        if ipc is not None and fault.none and r.lost is None:  # queue the GPU copies now, from this thread
            done = gpu_done = self._refused(op, lambda: ipc.launch(op, chunks, ready))
            work = lambda: self._finish_ipc(op, r, done, nbytes, notify, deadline, t0)  # noqa: E731
        elif ipc is not None:  # a faulted cuda_ipc transfer launches (if at all) from the loop, after its fault
            work = lambda: self._launch_ipc(op, r, chunks, ready, nbytes, notify, deadline, t0)  # noqa: E731
        else:
            work = lambda: self._transfer(op, r, cache, chunks, ready, notify, deadline, t0)  # noqa: E731
        reason = f"dropped by fault injection after {self._faults.config.drop_peer_after} transfers"
        fut = self._loop.submit(run_transfer(op, r, fault, deadline, work, self._metrics, self._in_flight, reason))
        return TransferHandle(fut, op, remote, nbytes, gpu_done=gpu_done if notify is None else None)

    async def _launch_ipc(self, op: str, r: Remote, chunks: list[Chunk], ready: torch.cuda.Event | None,
                          nbytes: int, notify: bytes | None, deadline: float, t0: float) -> None:
        r.check()
        assert r.ipc is not None
        await self._finish_ipc(op, r, r.ipc.launch(op, chunks, ready), nbytes, notify, deadline, t0)

    async def _finish_ipc(self, op: str, r: Remote, done: torch.cuda.Event, nbytes: int, notify: bytes | None,
                          deadline: float, t0: float) -> None:
        try:
            # Without a notification the caller's handle watches the event itself; spinning here as well would
            # only fight the caller for the GIL, so this thread blocks in cudaEventSynchronize instead.
            await event_done(done, deadline, spin_s=0.05 if notify is not None else 0.0)
        except BaseException:
            # the copies are queued already: let them end before the handle reports the failure, so nothing
            # lands in the destination afterwards and the peer's cache is never unmapped under them
            settle = asyncio.get_running_loop().run_in_executor(None, done.synchronize)
            await asyncio.wait({settle}, timeout=DROP_WAIT_S)
            raise
        if notify is not None:
            await self._send_notify(r, notify, deadline)
        self._metrics.record_ok(op, nbytes, time.monotonic() - t0)

    async def _transfer(self, op: str, r: Remote, cache: RegisteredCache, chunks: list[Chunk],
                        ready: torch.cuda.Event | None, notify: bytes | None, deadline: float, t0: float) -> None:
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
            await self._send_notify(r, notify, deadline)
        self._metrics.record_ok(op, sum(results), time.monotonic() - t0)  # type: ignore[arg-type]
