"""The `cuda_ipc` backend: one-sided block copies between two CUDA caches of one host over NVLink.

The exporting agent puts a CUDA IPC handle of its whole cache tensor in its metadata (`export`). A peer on
the same host that can see that GPU and reach it peer-to-peer maps it (`CudaIpcPeer.open`) and then moves
blocks itself, with no help from the owner's process:
  read:  gather on the owner's GPU (skipped if the blocks are one contiguous region) -> one peer copy
         over NVLink -> scatter on our GPU (skipped likewise);
  write: the same in the other direction.
Chunks alternate between two stream pairs so one chunk's gather overlaps the previous chunk's copy.
Staging slots on both GPUs come from pools this side owns and go back on every path.
Ordering with the owner's compute is the protocol's job: a reader reads after the owner's "blocks ready"
notification; a writer notifies after its copies completed (the agent sends the notify over UCX).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch

from ..cache import RegisteredCache, device_index, event_done
from ..descriptors import Chunk
from ..metadata import CacheInfo
from ..staging import Slot, StagingPool


def export(cache: RegisteredCache) -> bytes | None:
    """An IPC handle of the cache for same-host peers (None on the CPU)."""
    if not cache.is_cuda:
        return None
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(cache.kv)
    return pickle.dumps(args)


def _device_arg() -> int:
    import inspect

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return list(inspect.signature(rebuild_cuda_tensor).parameters).index("storage_device")


_DEVICE_ARG = _device_arg()


def _local_index(uuid: str | None) -> int | None:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    return None


def unavailable_reason(local: RegisteredCache | None, remote: CacheInfo | None) -> str | None:
    """None if a CudaIpcPeer can be opened for this pair, else why not."""
    if local is None or remote is None or not local.is_cuda or remote.device != "cuda":
        return "both caches must be CUDA tensors"
    if remote.ipc_handle is None:
        return "the peer exported no IPC handle"
    idx = _local_index(remote.device_uuid)
    if idx is None:
        return f"the peer's GPU {remote.device_uuid} is not visible in this process (CUDA_VISIBLE_DEVICES)"
    me = local.device.index
    if idx != me and not torch.cuda.can_device_access_peer(me, idx):
        return f"GPU {me} cannot access GPU {idx} peer-to-peer"
    return None


class CudaIpcPeer:
    def __init__(self, local: RegisteredCache, remote: CacheInfo, staging_bytes: int) -> None:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        idx = _local_index(remote.device_uuid)
        assert idx is not None and remote.ipc_handle is not None
        args = list(pickle.loads(remote.ipc_handle))  # trusted: same host, same cluster
        args[_DEVICE_ARG] = idx  # the exporter's device index, renumbered for this process
        kv = rebuild_cuda_tensor(*args)  # [num_blocks, num_layers, 2, block_size, heads, head_dim]
        self.remote = RegisteredCache(kv, remote.spec)
        self.local = local
        rdev, ldev = self.remote.device, local.device
        self._pairs = [(torch.cuda.Stream(rdev), torch.cuda.Stream(ldev)) for _ in range(2)]
        self._next = 0
        self.remote_pool = StagingPool(staging_bytes, rdev, "remote-GPU staging")
        self.local_pool = StagingPool(staging_bytes, ldev, "local-GPU staging")

    @contextmanager
    def _streams(self) -> Iterator[tuple[torch.cuda.Stream, torch.cuda.Stream]]:
        rs, ls = self._pairs[self._next % len(self._pairs)]
        self._next += 1
        with ExitStack() as st:
            st.enter_context(torch.cuda.stream(rs))
            if ls.device != rs.device:
                st.enter_context(torch.cuda.stream(ls))
            yield rs, ls

    async def chunk(self, op: str, chunk: Chunk, ready: torch.cuda.Event | None, deadline: float) -> int:
        """Move one chunk (read: remote -> local, write: local -> remote); returns its byte count."""
        src_cache, dst_cache = (self.remote, self.local) if op == "read" else (self.local, self.remote)
        src_ids, dst_ids = (
            (chunk.remote_ids, chunk.local_ids) if op == "read" else (chunk.local_ids, chunk.remote_ids)
        )
        src_pool, dst_pool = (
            (self.remote_pool, self.local_pool) if op == "read" else (self.local_pool, self.remote_pool)
        )
        nbytes = chunk.nbytes(self.local.spec)
        slots: list[tuple[StagingPool, Slot]] = []
        in_flight = False  # GPU work queued that may still use the slots
        try:
            src = src_cache.region(src_ids, chunk.layers)
            dst = dst_cache.region(dst_ids, chunk.layers)
            # A copy runs on the source GPU; into IPC-mapped memory of another GPU it crawls (~35 GB/s
            # measured on H200 NVLink), into our own allocation there it runs at link speed. So a write
            # always lands in a staging slot on the peer GPU, then moves locally there.
            stage_dst = dst is None or op == "write"
            if src is None:
                slots.append((src_pool, await src_pool.acquire(nbytes, deadline)))
            if stage_dst:
                slots.append((dst_pool, await dst_pool.acquire(nbytes, deadline)))
            with self._streams() as (rs, ls):
                s_stream, d_stream = (rs, ls) if op == "read" else (ls, rs)
                if ready is not None:
                    ls.wait_event(ready)  # the caller's work on our GPU comes first
                if src is None:
                    src = slots[0][1].view
                    _gather(src_cache, src_ids, chunk.layers, src)
                stage = slots[-1][1].view if stage_dst else dst
                assert stage is not None
                stage.copy_(src, non_blocking=True)  # the peer copy, on the source GPU's current stream
                if stage_dst and dst is not None:
                    dst.copy_(stage, non_blocking=True)  # same GPU, on its current stream
                elif stage_dst:
                    _scatter(dst_cache, dst_ids, chunk.layers, stage)
                done = torch.cuda.Event()
                done.record(d_stream)
                in_flight = True
            await event_done(done, deadline)
            in_flight = False
            return nbytes
        finally:
            for pool, slot in slots:
                (pool.quarantine if in_flight else pool.release)(slot)

    def close(self) -> None:
        self.remote_pool.clear()
        self.local_pool.clear()


def _gather(cache: RegisteredCache, ids: tuple[int, ...], layers: tuple[int, int], out: torch.Tensor) -> None:
    """Gather on the current stream of the cache's device (not the cache's own stream)."""
    idx = device_index(ids, cache.device)
    torch.index_select(cache.words[:, layers[0] : layers[1]], 0, idx, out=cache.as_words(out, len(ids), layers))


def _scatter(cache: RegisteredCache, ids: tuple[int, ...], layers: tuple[int, int], src: torch.Tensor) -> None:
    idx = device_index(ids, cache.device)
    cache.words[:, layers[0] : layers[1]].index_copy_(0, idx, cache.as_words(src, len(ids), layers))
