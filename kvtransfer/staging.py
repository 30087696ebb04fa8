"""A bounded pool of contiguous staging buffers on one device, used between gather/scatter and the wire.

Owned by one agent and used only from its event-loop thread. `acquire()` waits (bounded by a deadline)
until `capacity_bytes` allows the slot, `release()` gives it back; freed buffers are cached for reuse so a
steady stream of transfers does not allocate. A slot whose buffer a cancelled network operation might
still touch is `quarantine()`d: never reused, and counted so tests can see it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch

from .errors import BadDescriptor, TransferTimeout


@dataclass
class Slot:
    buf: torch.Tensor  # [capacity] uint8, owned by the pool
    nbytes: int

    @property
    def view(self) -> torch.Tensor:
        """[nbytes] uint8: the part of the buffer this slot uses."""
        return self.buf[: self.nbytes]


class StagingPool:
    def __init__(self, capacity_bytes: int, device: torch.device, name: str = "staging") -> None:
        self.capacity_bytes = capacity_bytes
        self.device = device
        self.name = name
        self._free: list[torch.Tensor] = []  # cached buffers, not in use
        self._allocated = 0  # bytes of all buffers (free + in use)
        self._in_use: dict[int, Slot] = {}
        self._quarantined = 0
        self._cond: asyncio.Condition | None = None

    @property
    def in_use(self) -> int:
        """Number of slots handed out and not yet released (quarantined ones not counted)."""
        return len(self._in_use)

    @property
    def quarantined(self) -> int:
        return self._quarantined

    async def acquire(self, nbytes: int, deadline: float) -> Slot:
        """A slot of `nbytes`; waits for capacity until `deadline` (time.monotonic()), then TransferTimeout."""
        if nbytes > self.capacity_bytes:
            raise BadDescriptor(f"{nbytes} bytes exceed the {self.name} capacity of {self.capacity_bytes}")
        if self._cond is None:
            self._cond = asyncio.Condition()
        async with self._cond:
            while True:
                slot = self._try_take(nbytes)
                if slot is not None:
                    return slot
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferTimeout(f"no {self.name} memory for {nbytes} bytes before the deadline")
                try:
                    await asyncio.wait_for(self._cond.wait(), remaining)
                except asyncio.TimeoutError:
                    pass

    def _try_take(self, nbytes: int) -> Slot | None:
        fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
        if fits:
            buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        else:
            # evict cached buffers (smallest first) until a new one fits under the capacity
            self._free.sort(key=lambda b: b.numel())
            while self._free and self._allocated + nbytes > self.capacity_bytes:
                self._allocated -= self._free.pop(0).numel()
            if self._allocated + nbytes > self.capacity_bytes:
                return None
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._allocated += nbytes
        slot = Slot(buf, nbytes)
        self._in_use[id(slot)] = slot
        return slot

    def release(self, slot: Slot) -> None:
        if self._in_use.pop(id(slot), None) is None:
            return
        self._free.append(slot.buf)
        self._notify()

    def quarantine(self, slot: Slot) -> None:
        """Never reuse this slot's buffer (a cancelled receive may still write it); its bytes stay counted."""
        if self._in_use.pop(id(slot), None) is not None:
            self._quarantined += 1

    def _notify(self) -> None:
        cond = self._cond
        if cond is None:
            return

        async def wake() -> None:
            async with cond:
                cond.notify_all()

        asyncio.get_running_loop().create_task(wake())

    def clear(self) -> None:
        """Drop cached free buffers (on close)."""
        for b in self._free:
            self._allocated -= b.numel()
        self._free.clear()
