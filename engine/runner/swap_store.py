"""HostSwapStore: the host copies of swapped-out KV blocks (engine.core.swap_space keeps their books).

One tensor host[S, L, 2, bs, KVH, D] in the KV cache's own dtype and per-block shape (whatever that dtype is: the
bytes are copied as they are), pinned on a CUDA engine so the copies run asynchronously. Copies are queued on the
device's current (default) stream like every step, so a copy out of a block runs before any later step reuses the
block, a copy in runs before the step that reads it, and a slot freed by a copy in is overwritten by a later copy
out only after it (the host never reads nor writes the slots itself). On the CPU the copies are plain memcpy.
Runs of consecutive blocks and slots move as one copy.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence

import torch

from engine.core.copy_cost import CopyCost
from engine.core.swap_space import SwapSpace


class HostSwapStore:
    def __init__(self, kv_cache: torch.Tensor, num_slots: int) -> None:
        """`kv_cache` [NB, L, 2, bs, KVH, D]; `num_slots` host blocks."""
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.cache = kv_cache
        self.host = torch.empty((num_slots, *kv_cache.shape[1:]), dtype=kv_cache.dtype,
                                pin_memory=kv_cache.is_cuda)  # [S, L, 2, bs, KVH, D]
        self.block_bytes = kv_cache[0].numel() * kv_cache.element_size()

    def copy_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """host[slot] = cache[block] for each (block, slot)."""
        for b, s, n in _runs(pairs):
            self.host[s:s + n].copy_(self.cache[b:b + n], non_blocking=True)

    def copy_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """cache[block] = host[slot] for each (slot, block)."""
        for s, b, n in _runs(pairs):
            self.cache[b:b + n].copy_(self.host[s:s + n], non_blocking=True)

    def measure_bandwidth(self, max_bytes: int = 64 << 20, repeats: int = 3) -> float:
        """Bytes per second of copying KV blocks to the host and back: up to `max_bytes` each way between host slots
        0.. and a scratch device buffer of blocks (the cache itself is not touched: it may be serving already), on
        a stream of its own; the fastest of `repeats` (work on another stream can delay one)."""
        n = max(1, min(self.host.shape[0], max_bytes // self.block_bytes))
        scratch = torch.empty((n, *self.cache.shape[1:]), dtype=self.cache.dtype, device=self.cache.device)
        stream = torch.cuda.Stream(self.cache.device) if self.cache.is_cuda else None
        best = math.inf
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for i in range(repeats + 1):  # the first touches the host pages (page faults): not timed
                start = time.perf_counter()
                self.host[:n].copy_(scratch, non_blocking=True)
                scratch.copy_(self.host[:n], non_blocking=True)
                if stream is not None:
                    stream.synchronize()
                if i:
                    best = min(best, time.perf_counter() - start)
        return 2 * n * self.block_bytes / max(best, 1e-9)

    def sync(self) -> None:
        if self.cache.is_cuda:
            torch.cuda.synchronize(self.cache.device)


def _runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first a, first b, length) of each run where both sides of consecutive pairs go up by one."""
    runs: list[tuple[int, int, int]] = []
    for a, b in pairs:
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((a, b, 1))
    return runs


def build_swap(mode: str, swap_space_bytes: int, kv_cache: torch.Tensor,
               cost: CopyCost | None = None) -> tuple[SwapSpace, HostSwapStore] | None:
    """The swap space of EngineConfig.preemption_mode `mode` over `swap_space_bytes` of host memory (None for
    "recompute"), deciding by `cost`; with "auto" the copy bandwidth is measured now."""
    if mode == "recompute":
        return None
    block_bytes = kv_cache[0].numel() * kv_cache.element_size()
    num_slots = swap_space_bytes // block_bytes
    if num_slots < 1:
        raise ValueError(f"EngineConfig.swap_space_bytes {swap_space_bytes} holds no KV block ({block_bytes} bytes)")
    store = HostSwapStore(kv_cache, num_slots)
    space = SwapSpace(num_slots, mode, block_bytes, cost)
    if mode == "auto":
        space.copy_bytes_per_s = store.measure_bandwidth()
    return space, store
