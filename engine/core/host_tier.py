"""HostTier: the bookkeeping of the host-memory tier under an engine's prefix cache (no tensors).

A full block evicted from the device's prefix cache (BlockManager: its least recently used cached block, taken for
another request) is copied to a host slot and indexed by the same chained block hash; a prompt whose prefix runs on
past what the device holds finds the next blocks here and has them copied back into fresh device blocks instead of
computing them again, when the copy is the cheaper of the two by the engine's measured rates (`cost`,
engine.core.copy_cost; a run it recomputes is counted in `chose_recompute`). The tier is inclusive: a block restored
to the device keeps its host copy (a second eviction then copies nothing).
Owns the slots: each is free or holds one block's KV under one hash (least recently used first: a store into a full
tier evicts the oldest entry). Slots a copy of the step being planned reads (a copy back to the device) or writes (a
store) are busy until `end_step()`: no store overwrites them before those copies are queued. The data movement is
the runner's (engine.runner.host_tier_store; SchedulerOutput.tier_out / tier_in, run before the step is launched).
Fleet hints: the hashes added and evicted since the last `take_changes()` (the worker reports them in batches to the
coordinator's prefix index; a lost hint costs a recompute, never a wrong token).
Counters (totals since start, for metrics): blocks looked up here at admissions and found (hits) or not (misses),
blocks stored (copied in) and restored (copied back), entries evicted for room, evicted device blocks not stored
(every slot was busy).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

from engine.core.copy_cost import CopyCost


class HostTier:
    def __init__(self, num_slots: int, block_bytes: int, cost: CopyCost | None = None) -> None:
        if num_slots < 1 or block_bytes < 1:
            raise ValueError(f"num_slots and block_bytes must be >= 1, got {num_slots}, {block_bytes}")
        self.num_slots, self.block_bytes = num_slots, block_bytes
        self.cost = cost or CopyCost()  # the rates a restore is weighed by (the engine measures them)
        self._free = list(range(num_slots))  # a heap: low slots first
        self._entries: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
        self._busy: set[int] = set()  # slots the step being planned copies from or into
        self._changes: dict[bytes, bool] = {}  # since take_changes(): hash -> held now (the last change wins)
        # totals since start
        self.hits = 0       # blocks found here at admissions (restored)
        self.misses = 0     # blocks looked up here at admissions and not found (computed)
        self.stored = 0     # blocks copied in from the device
        self.evictions = 0  # entries dropped to make room
        self.dropped = 0    # evicted device blocks not stored (no slot could be taken)
        self.chose_recompute = 0  # blocks found here at admission attempts whose copy cost more than computing

    @property
    def num_used(self) -> int:
        return len(self._entries)

    def find(self, hashes: Sequence[bytes]) -> list[int]:
        """Slots holding the longest run of `hashes` (from the first); no side effect (see `take`)."""
        slots = []
        for h in hashes:
            slot = self._entries.get(h)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def worth_restoring(self, slots: list[int], block_size: int) -> list[int]:
        """`slots` (a run from `find`) if copying them back beats computing their tokens, else none."""
        if not slots or self.cost.copy_pays(len(slots) * self.block_bytes, len(slots) * block_size):
            return slots
        self.chose_recompute += len(slots)
        return []

    def take(self, hashes: Sequence[bytes], looked_up: int) -> list[int]:
        """An admission restores the run of `hashes` (from `find`): their slots, read in the step being planned
        (busy until end_step), now most recently used; `looked_up` blocks were sought here."""
        slots = []
        for h in hashes:
            slot = self._entries[h]
            self._entries.move_to_end(h)
            self._busy.add(slot)
            slots.append(slot)
        self.hits += len(slots)
        self.misses += looked_up - len(slots)
        return slots

    def store(self, evicted: Sequence[tuple[int, bytes]]) -> list[tuple[int, int]]:
        """Device blocks evicted with their hashes: the (block, slot) copies that store those not held yet (each
        into a free slot, else the least recently used entry's that no copy of this step touches)."""
        copies = []
        for block, h in evicted:
            if h in self._entries:
                self._entries.move_to_end(h)
                continue
            slot = self._take_slot()
            if slot is None:
                self.dropped += 1
                continue
            self._entries[h] = slot
            self._busy.add(slot)
            self._changes[h] = True
            copies.append((block, slot))
        self.stored += len(copies)
        return copies

    def end_step(self) -> None:
        """The planned step's copies are queued: their slots may be overwritten by later stores."""
        self._busy.clear()

    def clear(self) -> None:
        """Forget every entry (the device's prefix cache was reset: e.g. new weights)."""
        self._changes.update(dict.fromkeys(self._entries, False))
        self._entries.clear()
        self._busy.clear()
        self._free = list(range(self.num_slots))

    def take_changes(self) -> tuple[list[bytes], list[bytes]]:
        """(hashes added, hashes evicted) since the last call, for the fleet's prefix index: net of each other (a
        hash stored then evicted since is only in the second list, one evicted then stored again only in the
        first), so the two are disjoint and their order does not matter."""
        changes, self._changes = self._changes, {}
        return [h for h, held in changes.items() if held], [h for h, held in changes.items() if not held]

    def check_integrity(self) -> dict[str, int]:
        """Assert every slot is free or holds one entry; return {"free", "cached", "busy", "total"}."""
        held = list(self._entries.values())
        assert len(set(held)) == len(held), "a host slot holds two entries"
        assert len(set(self._free)) == len(self._free), "a host slot is free twice"
        assert not set(held) & set(self._free), "a host slot is both free and held"
        assert self._busy <= set(held), "a host slot is copied from or into but holds nothing"
        assert len(held) + len(self._free) == self.num_slots, (
            f"host slots lost: {self.num_slots} in all, {len(held)} held, {len(self._free)} free")
        return {"free": len(self._free), "cached": len(held), "busy": len(self._busy), "total": self.num_slots}

    def _take_slot(self) -> int | None:
        if self._free:
            return heapq.heappop(self._free)
        for h, slot in self._entries.items():  # least recently used first
            if slot not in self._busy:
                del self._entries[h]
                self._changes[h] = False
                self.evictions += 1
                return slot
        return None
