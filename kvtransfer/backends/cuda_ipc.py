"""The `cuda_ipc` backend: one-sided block copies between two CUDA caches of one host over NVLink.

The exporting agent puts a CUDA IPC handle of its whole cache tensor in its metadata (`export`). A peer on the same
host that can see that GPU and reach it peer-to-peer maps it (`CudaIpcPeer`) and then moves blocks itself, with no
help from the owner's process: one `engine.kernels.block_copy.copy_blocks` launch per chunk, scattered blocks to
scattered blocks, with no staging buffer; a head-sliced read (`Chunk.heads`) instead runs strided copies straight
from the mapped tensor (`kvtransfer.head_slices.copy_heads`), no staging either. The kernel runs on our GPU: a read
pulls the peer's blocks over NVLink, a write pushes ours. `launch()` queues the work from the caller's thread, so a
transfer costs one kernel launch and an event of host time; only the completion wait goes to the agent's loop.
`close()` (the remote dropped or the agent closing) unmaps the peer's cache only after every copy queued on it ended.
Ordering with the owner's compute is the protocol's job: a reader reads after the owner's "blocks ready"
notification; a writer notifies after its copies completed (the agent sends the notify over UCX).
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Sequence

import torch

from ..cache import RegisteredCache
from ..descriptors import Chunk
from ..errors import PeerLost
from ..metadata import CacheInfo


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
    def __init__(self, local: RegisteredCache, remote: CacheInfo) -> None:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        idx = _local_index(remote.device_uuid)
        assert idx is not None and remote.ipc_handle is not None
        _enable_peer_access(local.device, torch.device("cuda", idx))
        args = list(pickle.loads(remote.ipc_handle))  # trusted: same host, same cluster
        # Opened in OUR device's context: the mapping then points over NVLink at the peer's memory, torch labels the
        # tensor with our device, and kernels on our GPU may dereference it (Triton refuses pointers mapped only in
        # the peer's context). Reads pull and writes push, both run by our GPU.
        args[_DEVICE_ARG] = local.device.index
        kv = rebuild_cuda_tensor(*args)  # [num_blocks, num_layers, 2, block_size, heads, head_dim]
        self.remote = RegisteredCache(kv, remote.spec, remote.heads)
        self.local = local
        self._stream = torch.cuda.Stream(local.device)  # every copy with this peer runs on it, in launch order
        # launch() runs on callers' threads, close() on the agent's loop: the lock orders them, so a copy is either
        # queued before close looks (and close waits for it) or refused
        self._lock = threading.Lock()
        self._closed = False

    def launch(self, op: str, chunks: Sequence[Chunk], ready: torch.cuda.Event | None) -> torch.cuda.Event:
        """Queue the copies of a read (remote -> local) or write (local -> remote), after `ready` (the caller's
        stream event); returns the event that completes with the last copy. Called from the caller's thread.
        PeerLost once close() began."""
        with self._lock:
            if self._closed:
                raise PeerLost("the peer's cache is no longer mapped here (its remote was dropped)")
            return self._launch(op, chunks, ready)

    def _launch(self, op: str, chunks: Sequence[Chunk], ready: torch.cuda.Event | None) -> torch.cuda.Event:
        from engine.kernels.block_copy import copy_blocks

        from ..head_slices import copy_heads

        src, dst = (self.remote, self.local) if op == "read" else (self.local, self.remote)
        stream = self._stream
        with torch.cuda.device(self.local.device), torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)  # the caller's work on our GPU comes first
            for c in chunks:
                src_ids, dst_ids = (c.remote_ids, c.local_ids) if op == "read" else (c.local_ids, c.remote_ids)
                if c.heads is not None:  # only reads are sliced (kvtransfer.head_slices.resolve_heads)
                    s_slots, d_slots = src.heads.local(*c.heads), dst.heads.local(*c.heads)
                    copy_heads(src.kv, src_ids, s_slots, dst.kv, dst_ids, d_slots, c.layers)
                    continue
                ids = _pinned(src_ids + dst_ids).to(self.local.device, non_blocking=True)  # [2n] int32
                n = len(src_ids)
                copy_blocks(src.kv, ids[:n], dst.kv, ids[n:], c.layers[0], c.layers[1])
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def close(self) -> None:
        """Unmap the peer's cache once every copy queued on it has ended (one launched from another thread an
        instant before included); later launches raise PeerLost. Blocks the calling thread until then."""
        with self._lock:
            self._closed = True
        self._stream.synchronize()
        self.remote = None  # type: ignore[assignment]  # drops the mapping of the peer's cache


def _enable_peer_access(a: torch.device, b: torch.device) -> None:
    """The kernels dereference the other GPU's memory: torch turns peer access on at a pair's first copy."""
    if a != b:
        x, y = torch.zeros(1, device=a), torch.zeros(1, device=b)
        x.copy_(y)
        y.copy_(x)
        torch.cuda.synchronize(a)


def _pinned(values: tuple[int, ...]) -> torch.Tensor:
    """[n] int32 in pinned host memory: its copy to the GPU does not wait for the GPU's queue."""
    return torch.tensor(values, dtype=torch.int32).pin_memory()
