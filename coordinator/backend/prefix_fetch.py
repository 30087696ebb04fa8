"""PrefixFetch: the part of RayBackend that has a prefill worker fetch a prompt's leading blocks from another worker
instead of computing them (docs/kv_tiers.md, "Fetching from another worker").

Before a remote prefill, the router's prefix indexes (the device blocks it routed where, the host tiers' reports)
say how many of the prompt's leading whole blocks each worker likely holds. When a worker the prefill worker can
read from holds at least `transfer.prefix_fetch_min_tokens` tokens more of them than the prefill worker itself, that
worker lends them (pool_worker.prefix_share: its device run, then its host tier's run copied up, held under a
lease) and the prefill call carries where they are (PrefixSource): the prefill worker pulls them into its prefix
cache first, then its prefill finds them as prefix hits. The lease is ended once the prefill call has returned
(the pull is over by then), or by the lender's timer if this process dies first. Every index is a hint: a lender
that holds less than the hint lends what it has, one that died or holds nothing lends nothing, and a fetch that
fails leaves the blocks to be computed; no request fails for a fetch.
Who can read whom: the workers' agents connect as the layout needs (coordinator.backend.pools): in the adaptive
layout every pair; in the disaggregated one a prefill worker reads a decode worker's blocks with pushes (it connects
to them to write), and the other prefill workers' (Pools.prefills_connect: they connect to each other while fetching
is on). A drained worker still lends (a read of what it holds, no compute). Tensor parallelism (either pool above
1): no fetch.
Counted in `prefix_fetches` (lent, nothing, failed).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from coordinator.admission.router import WorkerState
from coordinator.backend.ray_calls import quietly
from pool_worker.prefix_share import PrefixSource

if TYPE_CHECKING:
    from coordinator.admission.admission import Admission
    from coordinator.backend.pools import Pools
    from coordinator.config.serve_config import ServeConfig

log = logging.getLogger("pdserve")
LEND_TIMEOUT_S = 5.0  # a lender that does not answer by then is skipped: the prefill computes the prefix


class PrefixFetch:
    # RayBackend's, set in its __init__
    config: ServeConfig
    pools: Pools
    admission: Admission | None
    prefix_fetches: dict[str, int]

    async def _lend_prefix(self, attempt: str, tokens: list[int], prefill: WorkerState, own: int
                           ) -> tuple[WorkerState, PrefixSource] | None:
        """Ask the worker likely holding the most more of `tokens`' leading whole blocks than `prefill` (`own` of
        them, as the indexes said before it was picked: Placement.prefill_held_tokens), by at least
        transfer.prefix_fetch_min_tokens, to lend them: (the lender, where they are), or None."""
        lender, lent_tokens = self._best_lender(tokens, prefill, own)
        if lender is None:
            return None
        lease = f"{attempt}/prefix"
        try:
            blocks = await asyncio.wait_for(lender.handle.lend_prefix.remote(lease, tokens[:lent_tokens]),
                                            LEND_TIMEOUT_S)
        except BaseException as e:  # it died, is stuck, or the request ended meanwhile: the prompt is computed
            self._end_lease((lender, PrefixSource(lender.name, [], lease)))  # a lend that lands later is ended
            if not isinstance(e, Exception):
                raise
            log.info("request %s: %s could not lend its prefix (%s)", attempt, lender.name, e)
            self.prefix_fetches["failed"] += 1
            return None
        if not blocks:
            self.prefix_fetches["nothing"] += 1
            return None
        self.prefix_fetches["lent"] += 1
        return lender, PrefixSource(lender.name, list(blocks), lease)

    def _best_lender(self, tokens: list[int], prefill: WorkerState, own: int) -> tuple[WorkerState | None, int]:
        """The live worker `prefill` can read from that likely holds the longest run of `tokens`' leading whole
        blocks (the last token left to compute), if it is longer than `prefill`'s own by the minimum: (it, the
        run's tokens)."""
        cfg = self.config
        least = cfg.transfer.prefix_fetch_min_tokens
        if least is None or self.admission is None or not self.pools.transfers or \
                cfg.prefill.tensor_parallel_size > 1 or cfg.decode.tensor_parallel_size > 1:
            return None, 0
        router = self.admission.router
        usable = (len(tokens) - 1) // router.block_size * router.block_size
        floor = min(own, usable) + least
        readable = [w for w in self.pools.all_workers if w is not prefill and w.alive and self._readable(prefill, w)]
        held = router.held_by(tokens, [w.name for w in readable])
        options = [(min(held[w.name], usable), w.prefills, w) for w in readable]
        options = [o for o in options if o[0] >= floor]
        if not options:
            return None, 0
        # a tie goes to a worker that prefills: a lend takes a decode worker's engine thread from its streams
        held, _, lender = max(options, key=lambda o: o[:2])
        return lender, held

    def _readable(self, reader: WorkerState, holder: WorkerState) -> bool:
        """Whether `reader`'s agents are connected to `holder`'s (coordinator.backend.pools)."""
        if self.config.adaptive:
            return True
        if reader not in self.pools.prefill:
            return False
        return self.pools.pushes if holder in self.pools.decode else self.pools.prefills_connect

    def _end_lease(self, lent: tuple[WorkerState, PrefixSource] | None) -> None:
        if lent is not None and lent[0].alive:
            lender, source = lent
            self._spawn(quietly(lender.handle.end_lease.remote(source.lease_id)))
