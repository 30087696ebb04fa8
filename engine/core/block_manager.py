"""BlockManager: owns the KV block pool's bookkeeping: block tables, reference counts and the prefix cache.

Every block is in exactly one state:
- free:   no owner, no cached content (low ids first, so a new request gets contiguous runs: a min-heap of the
          blocks given back, below a mark past which no block was ever handed out);
- cached: no owner, but holds the KV of a full block identified by its hash chain; reusable by a later request
          with the same prefix, evictable least-recently-used first;
- used:   referenced by one or more block tables (ref_count = number of tables holding it).
A full block's hash chains over its parent's hash and its own token ids, so equal hashes mean equal prefixes.
Block tables are keyed by request id; the manager never knows what a request is doing with them.

Evictions: with `record_evictions`, every cached block evicted to be reused is listed with its hash
(`take_evicted`) for the host tier below this cache (engine.core.host_tier) to copy before the block is written.

Forks (n choices of one prompt): fork(src, dst, num_tokens) gives dst a table that shares src's FULL blocks
holding the first num_tokens tokens (ref_count + 1 each) and a private new block for the partial last one, whose
KV the caller copies from src's (the manager moves no data). Invariant: a block shared by several tables is full
and never written again (a table only writes positions at or past its own computed tokens, which start at
num_tokens, beyond every shared block), so sharing is copy-on-write without any copy on write.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def chain_hashes(parent: bytes | None, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Hash of each full block of `token_ids`, each chained to the one before (the first to `parent`): stable across
    processes (routing uses them too). The ids are converted once for all blocks (one by one, a 2,048-token prompt's
    128 blocks took ~0.5 ms on an H200 host, between two engine steps)."""
    n = len(token_ids) // block_size
    data = np.asarray(token_ids[:n * block_size], dtype=np.int64).tobytes()
    step = block_size * 8
    hashes: list[bytes] = []
    for i in range(n):
        h = hashlib.blake2b(digest_size=16)
        h.update(parent or b"root")
        h.update(data[i * step:(i + 1) * step])
        parent = h.digest()
        hashes.append(parent)
    return hashes


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Hashes of every full block of `token_ids`, in order."""
    return chain_hashes(None, token_ids, block_size)


@dataclass
class _Block:
    ref_count: int = 0
    hash: bytes | None = None


class _BlockStates(dict):
    """Block id -> _Block, made on first use: a block nobody touched is free (ref_count 0, no hash). Bookkeeping
    grows with the blocks in use, not the pool: a small model on a large GPU has millions of blocks (a tiny test
    model on an H200: 7.5 million, whose eager list took seconds per engine)."""

    def __missing__(self, block_id: int) -> _Block:
        state = self[block_id] = _Block()
        return state


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 record_evictions: bool = False) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = _BlockStates()
        self._free: list[int] = []  # heap of blocks given back; every block >= _fresh is free too, never handed out
        self._fresh = 0
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU order: first = evict first
        self._hash_to_block: dict[bytes, int] = {}
        self._tables: dict[str, list[int]] = {}
        self._num_hashed: dict[str, int] = {}  # per table: how many leading blocks are registered in the cache
        self._evicted: list[tuple[int, bytes]] | None = [] if record_evictions else None

    # ---- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free plus evictable cached)."""
        return len(self._free) + (self.num_blocks - self._fresh) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def table(self, owner: str) -> list[int]:
        return self._tables.get(owner, [])

    def owners(self) -> dict[str, list[int]]:
        """Every owner's block table (a read-only view: do not modify)."""
        return self._tables

    def has_table(self, owner: str) -> bool:
        return owner in self._tables

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached prefix of `token_ids`, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        return self.cached_blocks(prefix_block_hashes(token_ids[:-1], self.block_size))

    def cached_blocks(self, hashes: Sequence[bytes]) -> list[int]:
        """Blocks holding the longest cached run of `hashes` (a prefix's chained block hashes, from the first)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for h in hashes:
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_evictions(self) -> None:
        """List evicted cached blocks from now on (a host tier joined: take_evicted)."""
        if self._evicted is None:
            self._evicted = []

    def take_evicted(self) -> list[tuple[int, bytes]]:
        """(block, hash) of every cached block evicted for reuse since the last call (record_evictions): its KV is
        still there until a step or a transfer writes the block."""
        if not self._evicted:
            return []
        evicted, self._evicted = self._evicted, []
        return evicted

    def num_unreferenced(self, block_ids: Sequence[int]) -> int:
        """How many of `block_ids` no table holds (cached: counted in num_free_blocks until taken)."""
        return sum(1 for b in block_ids if self._blocks[b].ref_count == 0)

    # ---- changes
    def allocate(self, owner: str, num_tokens: int, prefix_blocks: Sequence[int] = ()) -> bool:
        """Grow `owner`'s table to hold `num_tokens` tokens; on a new table, start it with `prefix_blocks`
        (from cached_prefix). Returns False, changing nothing, when there are not enough blocks."""
        table = self._tables.get(owner)
        reused = [] if table is not None else list(prefix_blocks)
        have = len(table) if table is not None else len(reused)
        need = self.blocks_needed(num_tokens) - have
        reused_from_cache = sum(1 for b in reused if self._blocks[b].ref_count == 0)
        if need > self.num_free_blocks - reused_from_cache:
            return False
        if table is None:
            table = self._tables[owner] = []
            self._num_hashed[owner] = len(reused)
            for b in reused:
                self._take(b)
                table.append(b)
        for _ in range(max(need, 0)):
            table.append(self._pop_free())
        return True

    def fork(self, src: str, dst: str, num_tokens: int) -> list[tuple[int, int]] | None:
        """Start `dst`'s table as a copy-on-write fork of `src`'s first `num_tokens` tokens (see the module
        docstring). Returns the (src block, dst block) pairs whose KV the caller must copy (the partial last
        block, if any), or None, changing nothing, when no block is free for it."""
        if dst in self._tables:
            raise ValueError(f"fork: owner {dst!r} already has a table")
        table = self._tables[src]
        full, partial = divmod(num_tokens, self.block_size)
        if self.blocks_needed(num_tokens) > len(table):
            raise ValueError(f"fork: {src!r} holds {len(table)} blocks, fewer than {num_tokens} tokens need")
        if partial and self.num_free_blocks < 1:
            return None
        shared = table[:full]
        for b in shared:
            self._take(b)
        new = list(shared)
        copies = []
        if partial:
            new.append(self._pop_free())
            copies.append((table[full], new[-1]))
        self._tables[dst] = new
        self._num_hashed[dst] = min(self._num_hashed.get(src, 0), full)
        return copies

    def cache_full_blocks(self, owner: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register `owner`'s blocks that are now full of computed KV under their prefix hashes."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[owner]
        start = self._num_hashed[owner]
        num_full = num_computed_tokens // self.block_size
        if num_full <= start:
            return
        parent = self._blocks[table[start - 1]].hash if start > 0 else None
        bs = self.block_size
        for i, h in enumerate(chain_hashes(parent, token_ids[start * bs:num_full * bs], bs), start):
            block = self._blocks[table[i]]
            if block.hash is None and h not in self._hash_to_block:
                block.hash = h
                self._hash_to_block[h] = table[i]
        self._num_hashed[owner] = num_full

    def free(self, owner: str) -> None:
        """Drop `owner`'s table. Blocks left unreferenced become cached (if hashed) or free. Tail blocks are
        marked least recently used, since a shared prefix outlives its continuations."""
        table = self._tables.pop(owner, None)
        self._num_hashed.pop(owner, None)
        for b in reversed(table or []):
            block = self._blocks[b]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self._cached[b] = None
                else:
                    heapq.heappush(self._free, b)

    def reset_prefix_cache(self) -> None:
        """Forget all cached content (e.g. after new weights); used blocks keep their data but lose their hash."""
        for b in list(self._cached):
            self._evict(b, to_free_heap=True)
        for block in self._blocks.values():
            block.hash = None
        self._hash_to_block.clear()

    def check_integrity(self) -> dict[str, int]:
        """Assert the invariants; return {"free", "cached", "used", "total"}."""
        refs: dict[int, int] = {}
        for owner, table in self._tables.items():
            assert len(set(table)) == len(table), f"table {owner} repeats a block"
            for b in table:
                refs[b] = refs.get(b, 0) + 1
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "free heap holds a block twice"
        assert not free & cached, "a block is both free and cached"
        beyond = [b for b in (*free, *cached, *refs) if not 0 <= b < self._fresh]
        assert not beyond, f"blocks {beyond[:5]} are past the never-handed-out mark {self._fresh}"
        for b in range(self._fresh):
            block = self._blocks.get(b, _Block())
            expected = refs.get(b, 0)
            assert block.ref_count == expected, f"block {b}: ref_count {block.ref_count} but {expected} tables"
            if b in free:
                assert block.ref_count == 0 and block.hash is None, f"free block {b} is referenced or hashed"
            elif b in cached:
                assert block.ref_count == 0 and block.hash is not None, f"cached block {b} is referenced or bare"
            else:
                assert block.ref_count > 0, f"block {b} is lost: not free, cached or used"
        for b, block in self._blocks.items():
            if b >= self._fresh:
                assert block.ref_count == 0 and block.hash is None, f"block {b} was never handed out but is used"
        for h, b in self._hash_to_block.items():
            assert self._blocks[b].hash == h, f"hash index points block {b} at a stale hash"
        num_free = len(free) + self.num_blocks - self._fresh
        used = self.num_blocks - num_free - len(cached)
        return {"free": num_free, "cached": len(cached), "used": used, "total": self.num_blocks}

    # ---- internals
    def _take(self, b: int) -> None:
        if self._blocks[b].ref_count == 0:
            del self._cached[b]
        self._blocks[b].ref_count += 1

    def _pop_free(self) -> int:
        if self._free:  # every block given back is below the mark: the lowest free block either way
            b = heapq.heappop(self._free)
        elif self._fresh < self.num_blocks:
            b = self._fresh
            self._fresh += 1
        else:
            b = next(iter(self._cached))
            self._evict(b, to_free_heap=False)
        self._blocks[b].ref_count = 1
        return b

    def _evict(self, b: int, to_free_heap: bool) -> None:
        del self._cached[b]
        block = self._blocks[b]
        if block.hash is not None and self._hash_to_block.get(block.hash) == b:
            del self._hash_to_block[block.hash]
            if self._evicted is not None and not to_free_heap:
                self._evicted.append((b, block.hash))
        block.hash = None
        if to_free_heap:
            heapq.heappush(self._free, b)
