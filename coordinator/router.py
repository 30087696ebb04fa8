"""Router: picks the prefill and the decode worker of each request from the loads the workers last reported.

Prefill: least outstanding prompt tokens, but a worker that already computed the prompt's leading blocks (its
prefix cache likely still holds them) wins while its load is within `affinity_slack_tokens` of the least loaded.
Decode: most free KV blocks (minus what the coordinator has promised but the worker has not reported yet), then
fewest running sequences. The router only reads and books numbers; it never calls a worker.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from engine.block_manager import prefix_block_hashes
from engine.load import EngineLoad, WorkerInfo


@dataclass
class WorkerState:
    info: WorkerInfo
    handle: Any                      # the Ray actor handle
    load: EngineLoad | None = None   # last reported
    outstanding_tokens: int = 0      # prompt tokens sent and not yet answered
    promised_blocks: int = 0         # blocks of requests routed here and not yet reflected in `load`
    alive: bool = True
    served: int = 0                  # requests routed here (for tests and metrics)
    requests: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def free_blocks(self) -> int:
        free = self.load.free_blocks if self.load else self.info.num_kv_blocks
        return free - self.promised_blocks


class Router:
    def __init__(self, block_size: int, affinity_slack_tokens: int = 4096, max_prefix_entries: int = 200_000) -> None:
        self.block_size = block_size
        self.affinity_slack_tokens = affinity_slack_tokens
        self.max_prefix_entries = max_prefix_entries
        self._prefix_owner: OrderedDict[bytes, str] = OrderedDict()  # block hash -> prefill worker, LRU
        self.affinity_hits = 0

    def pick_prefill(self, prompt: list[int], workers: list[WorkerState]) -> WorkerState:
        alive = _alive(workers, "prefill")
        hashes = prefix_block_hashes(prompt, self.block_size)
        least = min(alive, key=lambda w: (w.outstanding_tokens + _queued(w), w.served))
        chosen = least
        owner = self._longest_prefix_owner(hashes)
        if owner is not None:
            preferred = next((w for w in alive if w.name == owner), None)
            if preferred is not None and _pressure(preferred) <= _pressure(least) + self.affinity_slack_tokens:
                chosen = preferred
                self.affinity_hits += 1
        for h in hashes:
            self._prefix_owner[h] = chosen.name
            self._prefix_owner.move_to_end(h)
        while len(self._prefix_owner) > self.max_prefix_entries:
            self._prefix_owner.popitem(last=False)
        chosen.served += 1
        return chosen

    def pick_decode(self, workers: list[WorkerState], blocks_needed: int) -> WorkerState | None:
        """The decode worker with the most room, or None if none has `blocks_needed` free blocks now."""
        alive = _alive(workers, "decode")
        best = max(alive, key=lambda w: (w.free_blocks, -(w.load.num_running if w.load else 0), -w.served))
        if best.free_blocks < blocks_needed:
            return None
        best.served += 1
        return best

    def _longest_prefix_owner(self, hashes: list[bytes]) -> str | None:
        owner = None
        for h in hashes:
            name = self._prefix_owner.get(h)
            if name is None:
                break
            owner = name
        return owner


def _alive(workers: list[WorkerState], role: str) -> list[WorkerState]:
    alive = [w for w in workers if w.alive]
    if not alive:
        raise LookupError(f"no live {role} worker")
    return alive


def _queued(w: WorkerState) -> int:
    return w.load.queued_prompt_tokens if w.load else 0


def _pressure(w: WorkerState) -> int:
    return w.outstanding_tokens + _queued(w)
