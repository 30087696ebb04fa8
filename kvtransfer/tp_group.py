"""Transfers between tensor-parallel groups: a worker's ranks (`GroupMetadata`) and which heads to pull from
which of them (`plan_pieces`, a pure function).

A TP worker is a group of ranks, each with its own KVAgent and its own cache holding a range of the model's
KV heads (engine.kv_heads). Every rank of a group has the same block tables, so block ids name the same
tokens on every rank. A decode rank that owns heads [s, e) pulls, for each piece of [s, e), that piece from
one prefill rank that holds it: each piece is its own read, all pieces in flight at once, each moving only
the piece's heads straight between the two ranks (no gather through one device).
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.kv_heads import KVHeadRange

from .agent import KVAgent
from .errors import BadDescriptor, IncompatibleLayout
from .handle import TransferHandle
from .metadata import AgentMetadata, check_compatible
from .remotes import DROP_WAIT_S

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Piece:
    """Pull global KV heads [start, stop) from rank `rank` (an index into the group's ranks)."""

    rank: int
    start: int
    stop: int

    @property
    def heads(self) -> tuple[int, int]:
        return (self.start, self.stop)


def plan_pieces(want: tuple[int, int], ranks: Sequence[tuple[int, int]], spread: int = 0) -> list[Piece]:
    """The pieces that cover the heads `want` = [start, stop) exactly once each, from the ranks whose head
    ranges are `ranks` (rank i holds [ranks[i][0], ranks[i][1])), in head order, consecutive heads from one
    rank merged into one piece. A head held by several ranks (replicated: fewer heads than ranks) comes from
    the `spread`-th of them (modulo their count): give each puller its own index to spread the load.
    ValueError if some wanted head is held by no rank."""
    start, stop = want
    if not start < stop:
        raise ValueError(f"the wanted head range [{start}, {stop}) is empty")
    pieces: list[Piece] = []
    for h in range(start, stop):
        holders = [i for i, (s, e) in enumerate(ranks) if s <= h < e]
        if not holders:
            raise ValueError(f"KV head {h} is held by none of the ranks {list(ranks)}")
        rank = holders[spread % len(holders)]
        if pieces and pieces[-1].rank == rank and pieces[-1].stop == h:
            pieces[-1] = Piece(rank, pieces[-1].start, h + 1)
        else:
            pieces.append(Piece(rank, h, h + 1))
    return pieces


@dataclass(frozen=True)
class GroupMetadata:
    """A worker's transfer metadata: its name and its ranks' agent metadata (rank order), each with a registered
    cache; together the ranks hold every one of the model's KV heads, and their caches agree on everything but
    their head ranges. A worker without TP is a group of one rank holding all heads."""

    name: str
    ranks: tuple[AgentMetadata, ...]

    def __post_init__(self) -> None:
        if not self.ranks:
            raise IncompatibleLayout(f"worker {self.name!r} lists no ranks")
        first = self.ranks[0]
        for m in self.ranks:
            if m.cache is None:
                raise IncompatibleLayout(f"rank {m.name!r} of worker {self.name!r} has no registered cache")
            if m is not first:
                check_compatible(first.cache, m, first.name)
        total = self.head_ranges[0].total
        held = {h for r in self.head_ranges for h in range(r.start, r.stop)}
        if held != set(range(total)):
            missing = sorted(set(range(total)) - held)
            raise IncompatibleLayout(f"the ranks of worker {self.name!r} hold no KV heads {missing} "
                                     f"(of {total}): {self.describe()}")

    @property
    def head_ranges(self) -> list[KVHeadRange]:
        return [m.cache.head_range for m in self.ranks]  # type: ignore[union-attr]

    def describe(self) -> str:
        return ", ".join(f"{m.name!r} [{r.start}, {r.stop})" for m, r in zip(self.ranks, self.head_ranges, strict=True))

    def pieces_for(self, want: KVHeadRange, spread: int = 0) -> list[tuple[AgentMetadata, tuple[int, int]]]:
        """(rank metadata, global head range) to pull so that a cache holding `want` gets each of its heads once."""
        if want.total != self.head_ranges[0].total:
            raise IncompatibleLayout(f"a cache of {want.total} total KV heads cannot pull from worker "
                                     f"{self.name!r} of {self.head_ranges[0].total}")
        pieces = plan_pieces(want.as_tuple(), [r.as_tuple() for r in self.head_ranges], spread)
        return [(self.ranks[p.rank], p.heads) for p in pieces]

    def to_bytes(self) -> bytes:
        return json.dumps({"name": self.name, "ranks": [m.to_bytes().decode() for m in self.ranks]}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> GroupMetadata:
        try:
            d = json.loads(data)
            ranks = tuple(AgentMetadata.from_bytes(r.encode()) for r in d["ranks"])
            return cls(str(d["name"]), ranks)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise IncompatibleLayout(f"unreadable worker metadata: {e}") from e


def read_from_group(agent: KVAgent, group: GroupMetadata, remote_block_ids: Sequence[int],
                    local_block_ids: Sequence[int], layers: tuple[int, int] | None = None,
                    timeout: float | None = None, spread: int = 0,
                    ready: torch.cuda.Event | None = None) -> list[TransferHandle]:
    """Pull the heads `agent`'s cache holds, of blocks `remote_block_ids` (the same ids on every rank) x `layers`,
    from the ranks of `group` (each already added with `add_remote`) into `local_block_ids`: one head-sliced read
    per piece, all started at once (after `ready`, as `KVAgent.read`). Wait on every handle (or
    `agent.notify_after` them) before using the blocks. A piece refused at its start raises only after the pieces
    started before it have ended: their copies write our blocks and read the peer's, so neither side may free or
    reuse them until then."""
    own = agent.cache_info
    if own is None:
        raise BadDescriptor(f"agent {agent.name!r} has no registered cache to pull into")
    handles: list[TransferHandle] = []
    try:
        for rank, heads in group.pieces_for(own.head_range, spread):
            handles.append(agent.read(rank.name, remote_block_ids, local_block_ids, layers=layers, timeout=timeout,
                                      heads=heads, ready=ready))
    except BaseException:
        # each started piece ends by its own deadline (a copy still queued then settles within DROP_WAIT_S)
        concurrent.futures.wait([h.future for h in handles], (timeout or agent.config.timeout_s) + DROP_WAIT_S)
        raise
    return handles
