"""SwapSpace: the bookkeeping of the host swap space a preempted request's KV may be copied to (no tensors).

When blocks run out the scheduler preempts a running request (engine.core.waiting.victim). Its KV is either
dropped and recomputed when it resumes ("recompute"), or its computed blocks are copied to host slots and copied
back, into new block ids, when it resumes ("swap"); EngineConfig.preemption_mode chooses:
- "recompute": always recompute (no host memory);
- "swap": swap while the host space has slots for the request, else recompute (counted: `num_full`);
- "auto": swap when the copy is cheaper than the recompute (engine.core.copy_cost: a swap moves the request's blocks
  out and back in, 2 * blocks * block_bytes, against its tokens computed again; until both rates are measured, swap).
Owns the slots: each is free or held by exactly one waiting, swapped-out request (Request.swap_slots). The data
movement is the runner's (SchedulerOutput.swap_out / swap_in, executed before the step is launched).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from engine.core.copy_cost import CopyCost
from engine.engine_config import PREEMPTION_MODES


class SwapSpace:
    def __init__(self, num_slots: int, mode: str, block_bytes: int, cost: CopyCost | None = None) -> None:
        if mode not in PREEMPTION_MODES[1:]:
            raise ValueError(f"SwapSpace mode must be one of {PREEMPTION_MODES[1:]}, got {mode!r}")
        if num_slots < 1 or block_bytes < 1:
            raise ValueError(f"num_slots and block_bytes must be >= 1, got {num_slots}, {block_bytes}")
        self.num_slots, self.mode, self.block_bytes = num_slots, mode, block_bytes
        self._free = list(range(num_slots))  # a heap: low slots first
        self.cost = cost or CopyCost()  # the rates auto decides by (shared with the engine's host tier)
        # totals since start
        self.num_swapped_out = 0   # requests swapped out
        self.num_swapped_in = 0    # requests swapped back in
        self.blocks_out = 0        # blocks copied to the host
        self.blocks_in = 0         # blocks copied back (a block still in the prefix cache at swap-in is not copied)
        self.num_full = 0          # preemptions that would have swapped but found too few free slots: recomputed
        self.num_chose_recompute = 0  # auto: preemptions the cost model sent to recompute

    @property
    def copy_bytes_per_s(self) -> float | None:
        return self.cost.copy_bytes_per_s

    @copy_bytes_per_s.setter
    def copy_bytes_per_s(self, value: float | None) -> None:
        self.cost.copy_bytes_per_s = value

    @property
    def prefill_token_s(self) -> float | None:
        return self.cost.prefill_token_s

    def observe_prefill(self, prompt_tokens: int, seconds: float) -> None:
        self.cost.observe_prefill(prompt_tokens, seconds)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def wants_swap(self, tokens: int, blocks: int) -> bool:
        """Whether a preempted request of `tokens` computed tokens in `blocks` blocks should be swapped (by mode and
        cost model; the slots may still be missing: `take`)."""
        if self.mode == "swap":
            return True
        if self.cost.copy_pays(2 * blocks * self.block_bytes, tokens):
            return True
        self.num_chose_recompute += 1
        return False

    def take(self, n: int) -> list[int] | None:
        """`n` free slots, or None (counted in num_full) when fewer are free."""
        if n > len(self._free):
            self.num_full += 1
            return None
        return [heapq.heappop(self._free) for _ in range(n)]

    def give_back(self, slots: Iterable[int]) -> None:
        for s in slots:
            heapq.heappush(self._free, s)

    def check_integrity(self, held: Iterable[list[int]]) -> int:
        """Assert every slot is free or held by one request (`held`: each swapped-out request's slots); returns
        the slots held."""
        taken = [s for slots in held for s in slots]
        assert len(set(taken)) == len(taken), "a swap slot is held twice"
        assert not set(taken) & set(self._free), "a swap slot is both free and held"
        assert len(self._free) == len(set(self._free)), "a swap slot is free twice"
        assert len(taken) + len(self._free) == self.num_slots, (
            f"swap slots lost: {self.num_slots} in all, {len(taken)} held, {len(self._free)} free")
        return len(taken)
