"""SwapSpace: the bookkeeping of the host swap space a preempted request's KV may be copied to (no tensors).

When blocks run out the scheduler preempts a running request (engine.core.waiting.victim). Its KV is either
dropped and recomputed when it resumes ("recompute"), or its computed blocks are copied to host slots and copied
back, into new block ids, when it resumes ("swap"); EngineConfig.preemption_mode chooses:
- "recompute": always recompute (no host memory);
- "swap": swap while the host space has slots for the request, else recompute (counted: `num_full`);
- "auto": swap when the copy is cheaper than the recompute by a simple model: a swap moves the request's blocks
  out and back in, 2 * blocks * block_bytes / copy_bytes_per_s (measured at start, engine.runner.swap_store), a
  recompute computes its tokens again, tokens * prefill_token_s (the engine's own prompt steps: seconds per prompt
  token, a running average; until one was timed, swap).
Owns the slots: each is free or held by exactly one waiting, swapped-out request (Request.swap_slots). The data
movement is the runner's (SchedulerOutput.swap_out / swap_in, executed before the step is launched).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from engine.engine_config import PREEMPTION_MODES

PREFILL_EWMA = 0.2  # weight of a newly timed prompt step in prefill_token_s
MIN_TIMED_PROMPT_TOKENS = 16  # shorter prompt steps are dominated by fixed costs: not timed


class SwapSpace:
    def __init__(self, num_slots: int, mode: str, block_bytes: int) -> None:
        if mode not in PREEMPTION_MODES[1:]:
            raise ValueError(f"SwapSpace mode must be one of {PREEMPTION_MODES[1:]}, got {mode!r}")
        if num_slots < 1 or block_bytes < 1:
            raise ValueError(f"num_slots and block_bytes must be >= 1, got {num_slots}, {block_bytes}")
        self.num_slots, self.mode, self.block_bytes = num_slots, mode, block_bytes
        self._free = list(range(num_slots))  # a heap: low slots first
        self.copy_bytes_per_s: float | None = None  # host <-> device copy bandwidth (set by the engine)
        self.prefill_token_s: float | None = None   # seconds a prompt token takes (the engine's prompt steps)
        # totals since start
        self.num_swapped_out = 0   # requests swapped out
        self.num_swapped_in = 0    # requests swapped back in
        self.blocks_out = 0        # blocks copied to the host
        self.blocks_in = 0         # blocks copied back (a block still in the prefix cache at swap-in is not copied)
        self.num_full = 0          # preemptions that would have swapped but found too few free slots: recomputed
        self.num_chose_recompute = 0  # auto: preemptions the cost model sent to recompute

    @property
    def num_free(self) -> int:
        return len(self._free)

    def wants_swap(self, tokens: int, blocks: int) -> bool:
        """Whether a preempted request of `tokens` computed tokens in `blocks` blocks should be swapped (by mode and
        cost model; the slots may still be missing: `take`)."""
        if self.mode == "swap":
            return True
        if self.copy_bytes_per_s is None or self.prefill_token_s is None:
            return True
        swap_s = 2 * blocks * self.block_bytes / self.copy_bytes_per_s
        if swap_s < tokens * self.prefill_token_s:
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

    def observe_prefill(self, prompt_tokens: int, seconds: float) -> None:
        """A step that computed `prompt_tokens` prompt tokens (beside any decode rows) took `seconds`."""
        if prompt_tokens < MIN_TIMED_PROMPT_TOKENS or seconds <= 0:
            return
        per_token = seconds / prompt_tokens
        old = self.prefill_token_s
        self.prefill_token_s = per_token if old is None else (1 - PREFILL_EWMA) * old + PREFILL_EWMA * per_token

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
