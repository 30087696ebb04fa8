"""A registered KV cache: the engine's tensor plus the byte-level views and gather/scatter the wire needs.

The engine owns the tensor; the agent only borrows it between `register_cache` and `deregister_cache`. All reshaping
follows `engine.kv_layout`: kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] is viewed as
u8[num_blocks, num_layers, layer_bytes] (a view, no copy); a head slice of it (the cache holds the global KV heads
`heads`, engine.kv_heads) moves through a strided view of `kv` instead. On CUDA every gather/scatter runs on the
cache's own transfer stream, after the caller's stream (see `caller_event`), never on the engine's stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import torch

from engine.kv_heads import KVHeadRange
from engine.kv_layout import KVCacheSpec

from .descriptors import contiguous_start
from .metadata import CacheInfo

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "float8_e4m3fn": torch.float8_e4m3fn}


class RegisteredCache:
    def __init__(self, kv: torch.Tensor, spec: KVCacheSpec, heads: KVHeadRange | None = None) -> None:
        # kv: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        if kv.dtype != _TORCH_DTYPES[spec.dtype]:
            raise ValueError(f"cache dtype {kv.dtype} does not match spec dtype {spec.dtype}")
        if kv.dim() != 6 or tuple(kv.shape[1:]) != spec.shape(1)[1:]:
            raise ValueError(f"cache shape {tuple(kv.shape)} does not match spec shape {spec.shape(-1)}")
        if not kv.is_contiguous():
            raise ValueError("the KV cache tensor must be contiguous")
        self.heads = heads if heads is not None else KVHeadRange.full(spec.num_kv_heads)
        self.heads.check_spec(spec)
        self.kv = kv
        self.spec = spec
        self.num_blocks = kv.shape[0]
        # u8: [num_blocks, num_layers, layer_bytes], a view of kv
        self.u8 = kv.view(torch.uint8).view(self.num_blocks, spec.num_layers, spec.layer_bytes)
        # words: [num_blocks, num_layers, layer_bytes / word], the same bytes in the widest integer type
        # that divides a layer: gather/scatter kernels move 8 bytes per element instead of 1
        self.word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8)
                         if spec.layer_bytes % w.itemsize == 0)
        self.words = self.u8.view(self.word)
        self.device = kv.device
        self.stream = torch.cuda.Stream(device=kv.device) if kv.is_cuda else None

    @property
    def is_cuda(self) -> bool:
        return self.kv.is_cuda

    def info(self, ipc_handle: bytes | None = None) -> CacheInfo:
        uuid = str(torch.cuda.get_device_properties(self.device).uuid) if self.is_cuda else None
        return CacheInfo(self.spec, self.num_blocks, "cuda" if self.is_cuda else "cpu", uuid, ipc_handle, self.heads)

    def slots(self, heads: tuple[int, int] | None) -> tuple[int, int] | None:
        """This cache's head slots of the global heads `heads`, or None when that is all of them (or heads is None)."""
        if heads is None or heads == self.heads.as_tuple():
            return None
        return self.heads.local(*heads)

    def caller_event(self) -> torch.cuda.Event | None:
        """Record, on the calling thread's current stream, the point after which blocks may be read/written."""
        if not self.is_cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def region(self, ids: Sequence[int], layers: tuple[int, int]) -> torch.Tensor | None:
        """[nbytes] u8 view of the cache if (ids, layers) is one contiguous region, else None (zero-copy)."""
        first = contiguous_start(ids, layers, self.spec)
        if first is None:
            return None
        return self.u8[first : first + len(ids), layers[0] : layers[1]].reshape(-1)

    def _index(self, ids: Sequence[int]) -> torch.Tensor:
        return device_index(ids, self.device)

    def gather(self, ids: Sequence[int], layers: tuple[int, int], out: torch.Tensor,
               slots: tuple[int, int] | None = None) -> None:
        """out[nbytes] u8 <- blocks `ids` x `layers` (head slots `slots` only, if given), block after block."""
        with self._on_stream():
            src, view = self._sliced(ids, layers, out, slots)
            torch.index_select(src, 0, self._index(ids), out=view)

    def scatter(self, ids: Sequence[int], layers: tuple[int, int], src: torch.Tensor,
                slots: tuple[int, int] | None = None) -> None:
        """blocks `ids` x `layers` (head slots `slots` only, if given) <- src[nbytes] u8 (as `gather` writes it)."""
        with self._on_stream():
            dst, view = self._sliced(ids, layers, src, slots)
            dst.index_copy_(0, self._index(ids), view)

    def _sliced(self, ids: Sequence[int], layers: tuple[int, int], buf: torch.Tensor,
                slots: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the cache's view of `layers` x `slots`, `buf` viewed as its `len(ids)` blocks)."""
        l0, l1 = layers
        if slots is None:
            return self.words[:, l0:l1], self.as_words(buf, len(ids), layers)
        s0, s1 = slots
        part = self.kv[:, l0:l1, :, :, s0:s1]  # strided: the heads are not the outer dimension
        return part, buf.view(self.kv.dtype).view(len(ids), *part.shape[1:])

    def as_words(self, buf: torch.Tensor, n: int, layers: tuple[int, int]) -> torch.Tensor:
        """[nbytes] u8 staging buffer -> [n, l1 - l0, layer_bytes / word] view in the word type."""
        return buf.view(self.word).view(n, layers[1] - layers[0], -1)

    def _on_stream(self):
        if self.stream is None:
            return _Null()
        return torch.cuda.stream(self.stream)

    def wait_event(self, ev: torch.cuda.Event | None) -> None:
        """Make the transfer stream wait (on the device, not the CPU) for a caller's event."""
        if ev is not None and self.stream is not None:
            self.stream.wait_event(ev)

    def record(self) -> torch.cuda.Event | None:
        """An event after all work queued so far on the transfer stream (None on the CPU: work is done)."""
        if self.stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev


def device_index(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """[n] int64 block ids on `device`, copied on the current stream.

    From pageable memory (measured faster here than pinning a small tensor per call on H200).
    """
    host = torch.tensor(list(ids), dtype=torch.long)
    return host if device.type != "cuda" else host.to(device, non_blocking=True)


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


async def event_done(ev: torch.cuda.Event | None, deadline: float, spin_s: float = 0.05) -> None:
    """Wait until a CUDA event has completed, at most until `deadline`, without blocking the event loop.

    Polls with asyncio.sleep(0) (each poll yields to the loop's other work and releases the GIL in the
    selector) for up to `spin_s`, then hands the wait to a thread blocked in cudaEventSynchronize.
    Measured on H200 (docs/benchmark-log.md): polling with asyncio.sleep(1e-4) rounds every sleep up to
    epoll's 1 ms, and a thread per wait from the start slowed 16 concurrent chunks down.
    """
    if ev is None:
        return
    spin_until = time.monotonic() + spin_s
    while not ev.query():
        now = time.monotonic()
        if now > deadline:
            from .errors import TransferTimeout

            raise TransferTimeout("GPU copy did not finish before the deadline")
        if now > spin_until:
            fut = asyncio.get_running_loop().run_in_executor(None, ev.synchronize)
            try:
                await asyncio.wait_for(asyncio.shield(fut), max(0.0, deadline - now))
                return
            except asyncio.TimeoutError as e:
                from .errors import TransferTimeout

                raise TransferTimeout("GPU copy did not finish before the deadline") from e
        await asyncio.sleep(0)
