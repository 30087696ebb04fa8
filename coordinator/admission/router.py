"""WorkerState and Router: what the coordinator knows of each worker, and which workers a request goes to.

WorkerState is one incarnation of a worker slot (decode-0 after its second restart is a new WorkerState with the
same name and `incarnation` 2): its handle, last reported load and life-cycle state (starting -> live -> dead;
the slot's supervisor then brings up a replacement). Bookings are kept in the Ledger under `key` (name and
incarnation), so a replacement never inherits its predecessor's books.

Router: prefill picks the least pressure (booked prompt tokens plus what the worker reports queued), but a worker
that already computed the prompt's leading blocks (its prefix cache likely still holds them) wins while its
pressure is within `affinity_slack_tokens` of the least loaded. Decode picks the most unbooked KV room, then the
fewest running sequences. A request run whole (collocated: `pick_whole`), or decoded in the adaptive layout, goes
where its prompt's leading blocks are, while that worker's room is within `affinity_slack_tokens` of the
roomiest's, else to the roomiest. It remembers which workers computed which leading blocks, and which decode
worker holds a finished request's prompt and reply (up to OWNERS per block, the latest first: `remember`), and
says how many of a prompt's tokens a worker likely holds (`cached_tokens`, for the adaptive layout's placement;
`held_by` with the host tiers, for a prefix fetch).
The router only reads numbers the caller gives it; it never calls a worker.
Host tiers (engine.core.host_tier): the workers' reports of the blocks their host tiers added and evicted
(`host_report`, in batches) make a second index; a prompt's blocks past a worker's device run that its host tier
holds count for it too, each at HOST_HIT_VALUE of a device-held block (a restore is a copy: cheaper than computing
the block, dearer than finding it on the device): in the prefill pick's affinity and in `effective_cached_tokens`
(placement's estimate of the prompt tokens left to compute). Every index is a hint: a missed one costs a recompute.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from engine.core.block_manager import prefix_block_hashes
from engine.load import EngineLoad, WorkerInfo

STATES = ("starting", "live", "dead", "restarting", "failed", "removed")  # removed: a scale-in took it out
OWNERS = 4  # workers remembered per prefix block
HOST_HIT_VALUE = 0.75  # a block a worker's host tier holds, for routing, against one its device holds (1.0)


@dataclass
class WorkerState:
    info: WorkerInfo
    handle: Any                      # the Ray actor handle
    load: EngineLoad | None = None   # last reported
    state: str = "live"              # one of STATES; only "live" workers get requests
    incarnation: int = 0             # 0 for the first actor of this slot, +1 per replacement
    served: int = 0                  # requests routed here (for tests and metrics)
    requests: set[str] = field(default_factory=set)  # worker-side ids of requests running here
    link: Any = None                 # a worker's stream while connected (decode_pool.worker_stream.StreamLink)
    # what the coordinator sends it: "prefill", "decode", "collocated", or (adaptive) "mixed"; the adaptive layout's
    # planner changes it while serving (coordinator.backend.planner); "" until set: the role it started in
    role: str = ""

    def __post_init__(self) -> None:
        self.role = self.role or self.info.role

    def report(self, load: EngineLoad) -> None:
        """The worker's load as a reply or its stream brought it: kept unless one taken later on the worker is kept
        already (replies and stream messages arrive in any order: a decode() reply carries the load of the request's
        join, which may land after the stream's loads of the steps that followed)."""
        if self.load is None or load.taken_at_s >= self.load.taken_at_s or not load.taken_at_s:
            self.load = load

    @property
    def prefills(self) -> bool:
        """It takes prompts for other workers."""
        return self.role in ("prefill", "mixed")

    @property
    def decodes(self) -> bool:
        """It decodes (and runs whole requests)."""
        return self.role in ("decode", "mixed", "collocated")

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def key(self) -> str:
        """The ledger's key: unique across replacements of the same slot."""
        return f"{self.info.name}#{self.incarnation}"

    @property
    def alive(self) -> bool:
        return self.state == "live"


class Router:
    def __init__(self, block_size: int, affinity_slack_tokens: int = 4096, max_prefix_entries: int = 200_000) -> None:
        self.block_size = block_size
        self.affinity_slack_tokens = affinity_slack_tokens
        self.max_prefix_entries = max_prefix_entries
        self._prefix_owner: OrderedDict[bytes, tuple[str, ...]] = OrderedDict()  # block hash -> workers, LRU
        self._host_owner: OrderedDict[bytes, frozenset[str]] = OrderedDict()  # block hash -> host tiers holding it
        self.affinity_hits = 0

    def pick_prefill(self, prompt: list[int], candidates: list[WorkerState],
                     pressure: Callable[[WorkerState], int], remember: bool = True) -> WorkerState | None:
        """Among `candidates` (live, with room in their backlog), the least pressed or the prefix owner. With
        `remember`, the prompt's blocks are remembered as the chosen worker's (else the caller does so)."""
        if not candidates:
            return None
        hashes = prefix_block_hashes(prompt, self.block_size)
        least = min(candidates, key=lambda w: (pressure(w), w.served))
        chosen = least
        preferred = self._holder(hashes, candidates)
        if preferred is not None and pressure(preferred) <= pressure(least) + self.affinity_slack_tokens:
            chosen = preferred
            self.affinity_hits += 1
        if remember:
            self._remember(hashes, chosen.name)
        chosen.served += 1
        return chosen

    def remember(self, tokens: list[int], worker: str) -> None:
        """`worker` computed (or received) the KV of `tokens`: its prefix cache likely holds their full blocks."""
        self._remember(prefix_block_hashes(tokens, self.block_size), worker)

    def cached_tokens(self, tokens: list[int], worker: str) -> int:
        """How many leading tokens of `tokens` `worker`'s prefix cache likely holds (whole blocks)."""
        n = 0
        for h in prefix_block_hashes(tokens, self.block_size):
            if worker not in self._prefix_owner.get(h, ()):
                break
            n += 1
        return n * self.block_size

    def tier_tokens(self, tokens: list[int], worker: str) -> tuple[int, int]:
        """(leading tokens of `tokens` `worker`'s device likely holds, tokens after those its host tier holds), in
        whole blocks: what its engine would find on the device, then restore."""
        device, host = self._tier_blocks(prefix_block_hashes(tokens, self.block_size), worker)
        return device * self.block_size, host * self.block_size

    def held_by(self, tokens: list[int], workers: Iterable[str]) -> dict[str, int]:
        """Per worker, the leading tokens of `tokens` (whole blocks) it likely holds on its device or in its host
        tier (the prompt hashed once, whatever the number of workers)."""
        hashes = prefix_block_hashes(tokens, self.block_size)
        return {w: sum(self._tier_blocks(hashes, w)) * self.block_size for w in workers}

    def effective_cached_tokens(self, tokens: list[int], worker: str) -> int:
        """The tokens a prefill of `tokens` on `worker` likely need not compute, a host-held one counted at
        HOST_HIT_VALUE (placement's estimate of the prompt work)."""
        device, host = self.tier_tokens(tokens, worker)
        return device + int(host * HOST_HIT_VALUE)

    def host_report(self, worker: str, added: list[bytes], removed: list[bytes]) -> None:
        """A worker's host tier added and evicted these block hashes since its last report."""
        for h in removed:
            holders = self._host_owner.get(h, frozenset()) - {worker}
            if holders:
                self._host_owner[h] = holders
            else:
                self._host_owner.pop(h, None)
        for h in added:
            self._host_owner[h] = self._host_owner.get(h, frozenset()) | {worker}
            self._host_owner.move_to_end(h)
        while len(self._host_owner) > self.max_prefix_entries:
            self._host_owner.popitem(last=False)

    def forget_host(self, worker: str) -> None:
        """`worker` died: its host tier went with it."""
        for h in [h for h, holders in self._host_owner.items() if worker in holders]:
            self.host_report(worker, [], [h])

    def host_blocks(self) -> dict[str, int]:
        """Per worker, the blocks the index says its host tier holds (for /metrics)."""
        counts: dict[str, int] = {}
        for holders in self._host_owner.values():
            for w in holders:
                counts[w] = counts.get(w, 0) + 1
        return counts

    def pick_decode(self, candidates: list[WorkerState], room: Callable[[WorkerState], int],
                    blocks_needed: int) -> WorkerState | None:
        """The candidate with the most unbooked room, or None if none has `blocks_needed` blocks of it."""
        fitting = [w for w in candidates if room(w) >= blocks_needed]
        if not fitting:
            return None
        best = _most_room(fitting, room)
        best.served += 1
        return best

    def pick_whole(self, prompt: list[int], candidates: list[WorkerState], room: Callable[[WorkerState], int],
                   blocks_needed: int, remember: bool = True) -> WorkerState | None:
        """A worker to run a request whole (collocated), or to decode it (adaptive): the one whose device, then
        host tier, holds the longest run of the prompt's leading blocks, while its room is within
        `affinity_slack_tokens` of the roomiest's (a conversation's next turn finds its history there); else the
        roomiest. None if none has `blocks_needed` blocks of room. With `remember`, the prompt's blocks are
        remembered as the chosen worker's (the adaptive layout does so once it has placed the prompt)."""
        fitting = [w for w in candidates if room(w) >= blocks_needed]
        if not fitting:
            return None
        hashes = prefix_block_hashes(prompt, self.block_size)
        chosen = roomiest = _most_room(fitting, room)
        preferred = self._holder(hashes, fitting)
        slack_blocks = self.affinity_slack_tokens // self.block_size
        if preferred is not None and preferred is not roomiest and room(preferred) + slack_blocks >= room(roomiest):
            chosen = preferred
            self.affinity_hits += 1
        if remember:
            self._remember(hashes, chosen.name)
        chosen.served += 1
        return chosen

    def _remember(self, hashes: list[bytes], worker: str) -> None:
        for h in hashes:
            owners = self._prefix_owner.get(h, ())
            self._prefix_owner[h] = (worker, *(o for o in owners if o != worker))[:OWNERS]
            self._prefix_owner.move_to_end(h)
        while len(self._prefix_owner) > self.max_prefix_entries:
            self._prefix_owner.popitem(last=False)

    def _tier_blocks(self, hashes: list[bytes], worker: str) -> tuple[int, int]:
        device = 0
        while device < len(hashes) and worker in self._prefix_owner.get(hashes[device], ()):
            device += 1
        host = device
        while host < len(hashes) and worker in self._host_owner.get(hashes[host], ()):
            host += 1
        return device, host - device

    def _holder(self, hashes: list[bytes], candidates: list[WorkerState]) -> WorkerState | None:
        """The candidate whose run of `hashes` (device, then host tier) is worth the most (_best_holder), the device
        index's latest owner of the longest run among equals; None when no candidate holds the first block. That
        owner alone may be no candidate: a decode worker holding a conversation's reply, for a prefill pick."""
        owner = self._best_holder(hashes, candidates, self._longest_prefix_owner(hashes))
        return next((w for w in candidates if w.name == owner), None)

    def _best_holder(self, hashes: list[bytes], candidates: list[WorkerState], owner: str | None) -> str | None:
        """The candidate whose device run then host run of `hashes` is worth the most (HOST_HIT_VALUE a host
        block); `owner` (the device index's) where it is worth as much."""
        def worth(name: str) -> float:
            device, host = self._tier_blocks(hashes, name)
            return device + host * HOST_HIT_VALUE
        best = max(candidates, key=lambda w: (worth(w.name), w.name == owner))
        baseline = worth(owner) if any(w.name == owner for w in candidates) else 0.0
        return best.name if worth(best.name) > baseline else owner

    def _longest_prefix_owner(self, hashes: list[bytes]) -> str | None:
        """The latest worker to compute the longest run of the leading blocks (None: nobody computed the first)."""
        owner = None
        for h in hashes:
            owners = self._prefix_owner.get(h)
            if not owners:
                break
            owner = owners[0]
        return owner


def _most_room(fitting: list[WorkerState], room: Callable[[WorkerState], int]) -> WorkerState:
    """The most unbooked room; among equals the fewest running, then the least served."""
    return max(fitting, key=lambda w: (room(w), -(w.load.num_running if w.load else 0), -w.served))
