"""Prefix blocks lent to another worker and taken from one: a mixin of LLMEngine, whose public methods these are
(called by pool_worker.prefix_share on the holder's and the fetcher's engine).

A prompt's leading blocks may be held by another worker (its device prefix cache, or its host tier: docs/kv_tiers.md)
when this one holds none of them. Rather than computing them again, the fetcher reads them through kvtransfer:
- the holder lends them under a lease (`lend_prefix`): the longest run of the tokens' block hashes its device holds,
  then the run after it its host tier holds, copied up into fresh device blocks (and registered in its prefix cache
  like any restore); the lease's table holds them (ref counted) so nothing evicts or overwrites them until
  `end_lease`;
- the fetcher books blocks for the run (`book_prefix`: those its own prefix cache holds are shared, not read), pulls
  the rest from the lender's blocks, then `adopt_prefix` registers them under their hashes and ends its lease: they
  are cached blocks now, and the prompt's prefill finds them as prefix hits.
Owns the leases (`_leases`, made in LLMEngine.__init__): each is a block table of its own, counted as pinned by
check_integrity, until end_lease / adopt_prefix. Only full blocks move. Relies on LLMEngine's state and on
_offload_now (engine.host_kv).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine.core.block_manager import prefix_block_hashes

if TYPE_CHECKING:
    from engine.core.block_manager import BlockManager
    from engine.core.host_tier import HostTier
    from engine.core.scheduler import Scheduler
    from engine.engine_config import EngineConfig
    from engine.handoff_blocks import LaunchFence
    from engine.runner.host_tier_store import HostTierStore


class PrefixExchange:
    """LLMEngine's prefix lending and fetching (see the module)."""

    # LLMEngine's, set in its __init__
    config: EngineConfig
    device: torch.device
    block_manager: BlockManager
    host_tier: HostTier | None
    host_tier_store: HostTierStore | None
    scheduler: Scheduler
    _reserved: set[str]
    _leases: set[str]
    num_lent_blocks: int
    num_lent_host_blocks: int
    num_fetched_blocks: int

    def lend_prefix(self, lease_id: str, token_ids: Sequence[int]) -> tuple[list[int], torch.cuda.Event | None]:
        """Hold the longest run of `token_ids`' full blocks this engine has (device prefix cache, then host tier)
        under `lease_id`: (the run's device blocks in order, an event after their copies up from the host on CUDA,
        else None). An empty run holds nothing. The blocks stay held until end_lease(lease_id)."""
        self._check_new(lease_id)
        bm = self.block_manager  # without prefix caching nothing is held: an empty run
        hashes = prefix_block_hashes(token_ids, bm.block_size)
        on_device = bm.cached_blocks(hashes)
        tier = self.host_tier
        on_host = tier.find(hashes[len(on_device):]) if tier is not None else []
        if len(on_host) > bm.num_free_blocks - bm.num_unreferenced(on_device):
            on_host = []  # no room to copy the host run up: lend what the device holds
        n = len(on_device) + len(on_host)
        if n == 0 or not bm.allocate(lease_id, n * bm.block_size, on_device):
            return [], None
        slots = tier.take(hashes[len(on_device):n], len(on_host)) if on_host else []  # busy: no store takes them
        self._leases.add(lease_id)
        self._offload_now()  # the blocks taken may have evicted cached ones: their copies down go first
        table = list(bm.table(lease_id))
        done = None
        if slots:
            self.host_tier_store.move([], list(zip(slots, table[len(on_device):], strict=True)))
            tier.end_step()
            bm.cache_full_blocks(lease_id, token_ids, n * bm.block_size)  # restored: a device prefix hit from now
            self.num_lent_host_blocks += len(slots)
            if self.device.type == "cuda":
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(self.device))
        self.num_lent_blocks += n
        return table, done

    def book_prefix(self, lease_id: str, token_ids: Sequence[int]) -> tuple[list[int], int, LaunchFence] | None:
        """Book blocks under `lease_id` for the KV of `token_ids` (whole blocks) to be read in from another worker:
        (the blocks, how many leading ones this engine's prefix cache holds already and are not to be read, the
        fence a write into them waits for). None when the cache has no room now."""
        self._check_new(lease_id)
        bm = self.block_manager
        if len(token_ids) % bm.block_size:
            raise ValueError(f"lease {lease_id!r}: {len(token_ids)} tokens are not whole blocks of {bm.block_size}")
        hits = bm.cached_blocks(prefix_block_hashes(token_ids, bm.block_size))
        if not bm.allocate(lease_id, len(token_ids), hits):
            return None
        self._leases.add(lease_id)
        self._offload_now()
        return list(bm.table(lease_id)), len(hits), self.launch_fence()

    def adopt_prefix(self, lease_id: str, token_ids: Sequence[int], skip: int,
                     landed: Sequence[torch.cuda.Event] = ()) -> None:
        """The KV of `token_ids` has been read into `lease_id`'s booked blocks but the first `skip` (this engine's
        own prefix hits; `landed`: the copies' events on CUDA): register the blocks in the prefix cache under their
        hashes and end the lease, so they are cached blocks a prompt finds."""
        if lease_id not in self._leases:
            raise ValueError(f"lease {lease_id!r} is not held here")
        self.order_after(landed)
        self.block_manager.cache_full_blocks(lease_id, token_ids, len(token_ids))
        self.num_fetched_blocks += len(self.block_manager.table(lease_id)) - skip
        self.end_lease(lease_id)

    def end_lease(self, lease_id: str) -> bool:
        """Give a lease's blocks back (registered ones stay cached); False if it holds none."""
        if lease_id not in self._leases:
            return False
        self._leases.discard(lease_id)
        self.block_manager.free(lease_id)
        return True

    def _check_new(self, lease_id: str) -> None:
        if lease_id in self._leases or lease_id in self.scheduler.requests or lease_id in self._reserved:
            raise ValueError(f"id {lease_id!r} is already in use")
