"""HostTierStore: the host copies of the blocks the host tier (engine.core.host_tier) keeps, and their copies.

The data and the copies themselves are a HostSwapStore's (engine.runner.swap_store: one host tensor in the KV
cache's own dtype and per-block shape, pinned on CUDA; runs of consecutive blocks and slots move as one copy), so an
FP8 KV block moves at its own size. What this adds is where the copies run:
- on the CPU, in order, inside the call (memcpy);
- on CUDA, the copies out (evicted device blocks -> host) go on a copy stream of their own, so they overlap the step
  still on the device (async scheduling); the device's launch stream waits for them before the step that reuses
  those blocks (a wait on the device, never on the host). A block's KV is final before it is evicted: it was
  registered in the prefix cache after the step that computed it was read. The copies back (host -> device) go on
  the launch stream, ahead of the step that reads them; a later copy out into a slot waits for the copies back
  queued before it, so a slot is never overwritten while a copy still reads it.
Copies queued for blocks reserved for a write from outside (a KV handoff) go on the launch stream
(`copy_out_now`), so the launch fence taken after the reservation covers them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.runner.swap_store import HostSwapStore


@dataclass(frozen=True)
class CopyTimer:
    """How long one step's copies back from the host tier took: measured in the call on the CPU, between two
    device events on CUDA (read once the step that follows them has been read, when both have completed)."""

    host_s: float
    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None

    def seconds(self) -> float:
        if self.start is None or self.end is None or not self.end.query():
            return self.host_s
        return self.start.elapsed_time(self.end) / 1000


class HostTierStore:
    def __init__(self, kv_cache: torch.Tensor, num_slots: int) -> None:
        """`kv_cache` [NB, L, 2, bs, KVH, D]; `num_slots` host blocks."""
        self.copies = HostSwapStore(kv_cache, num_slots)
        self.block_bytes = self.copies.block_bytes
        self._device = kv_cache.device
        self._stream = torch.cuda.Stream(kv_cache.device) if kv_cache.is_cuda else None
        self._copied_back: torch.cuda.Event | None = None  # after the last copies back (launch stream)

    def move(self, out: Sequence[tuple[int, int]], back: Sequence[tuple[int, int]]) -> CopyTimer | None:
        """Queue a step's copies: `out` (block, slot) evicted blocks to the host, then `back` (slot, block) host
        blocks into the device blocks the step reads; both ordered before the step launched next. Returns the
        timer of the copies back (None without any)."""
        if self._stream is None:
            self.copies.copy_out(out)
            start = time.perf_counter()
            self.copies.copy_in(back)
            return CopyTimer(time.perf_counter() - start) if back else None
        launch = torch.cuda.current_stream(self._device)
        if out:
            with torch.cuda.stream(self._stream):
                if self._copied_back is not None:
                    self._stream.wait_event(self._copied_back)
                self.copies.copy_out(out)
                done = torch.cuda.Event()
                done.record(self._stream)
            launch.wait_event(done)  # the next step may overwrite the evicted blocks only after their copy
        if not back:
            return None
        timer = CopyTimer(0.0, torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        timer.start.record(launch)
        self.copies.copy_in(back)
        timer.end.record(launch)
        self._copied_back = timer.end
        return timer

    def copy_in_now(self, back: Sequence[tuple[int, int]]) -> None:
        """Queue copies of (slot, block) host blocks into device blocks on the launch stream, ahead of every later
        launch (a reservation's leading blocks: engine.handoff_blocks); later stores to the host wait for them."""
        self.copies.copy_in(back)
        if self._stream is not None and back:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self._device))
            self._copied_back = done

    def copy_out_now(self, out: Sequence[tuple[int, int]]) -> None:
        """Queue copies of evicted blocks on the launch stream (blocks reserved for a write from outside; the copies
        back that read the slots earlier are ahead of them on the same stream)."""
        self.copies.copy_out(out)


AUTO_FRACTION = 0.2  # kv_host_cache_bytes None: this share of the host memory available at start, split between
AUTO_MAX_BYTES = {"cuda": 32 << 30, "cpu": 1 << 30}  # the node's GPUs (a CUDA engine), at most this much
NVIDIA_GPUS = "/proc/driver/nvidia/gpus"  # one entry per GPU of the node (the driver's, whatever a process sees)


def auto_host_cache_bytes(device_type: str, meminfo: str = "/proc/meminfo", gpus: str = NVIDIA_GPUS) -> int:
    """The host tier's size when none is set: AUTO_FRACTION of the memory available now, divided by the node's
    GPUs for a CUDA engine (its peers on the node start alike: all of them pin together at most that share), at
    most AUTO_MAX_BYTES; 0 where the figure cannot be read (no tier)."""
    try:
        with open(meminfo, encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0
    share = 1
    if device_type == "cuda":
        try:
            share = max(1, len(os.listdir(gpus)))
        except OSError:
            share = 1
    return min(int(available * AUTO_FRACTION / share), AUTO_MAX_BYTES.get(device_type, AUTO_MAX_BYTES["cpu"]))


def build_host_tier_store(host_bytes: int, kv_cache: torch.Tensor) -> HostTierStore | None:
    """The host tier's store over `host_bytes` of host memory (None: fewer bytes than one KV block)."""
    block_bytes = kv_cache[0].numel() * kv_cache.element_size()
    num_slots = host_bytes // block_bytes
    return HostTierStore(kv_cache, num_slots) if num_slots >= 1 else None
