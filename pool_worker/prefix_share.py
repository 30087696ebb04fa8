"""PrefixShare: a worker's part in moving a prompt's prefix from one worker to another (engine.prefix_exchange): as
the lender, the leases on blocks it holds for a fetcher; as the fetcher, the pull of a lender's blocks into its own
prefix cache before a prompt's prefill.

The coordinator arranges it (coordinator.backend.prefix_fetch): it asks the holder to `lend` the prompt's leading
blocks, hands what it lent to the prefill call of the fetcher, which `fetch`es them (kvtransfer's pull, the same
path as a handoff's), and then ends the lease (`end`). Owns the leases lent here (lease id -> the timer that ends
it): a lease the coordinator never ends (it died, or the fetcher never came) is ended after LEASE_TIMEOUTS x the
transfer timeout, well after any pull of it can have ended (the fetcher starts its pull at once, and a pull ends by
its deadline). A fetch is a cache fill: any failure (the lender died, no room, a failed pull) leaves the prompt to
be computed, with its booked blocks given back once no copy touches them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.async_engine import exit_process

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from kvtransfer.worker_agents import GroupRead, WorkerAgents

log = logging.getLogger("pdserve")
LEASE_TIMEOUTS = 4  # a lease nobody ends lasts this many transfer timeouts
MAX_ENDED = 10_000  # lease ids ended before their lend landed, remembered so that it is ended as it lands


@dataclass(frozen=True)
class PrefixSource:
    """Where a prefill's leading blocks may be fetched from (the coordinator's, for a prefill call): worker `peer`
    holds the KV of the prompt's first len(blocks) whole blocks in `blocks` under lease `lease_id`."""

    peer: str
    blocks: list[int]
    lease_id: str


class PrefixShare:
    def __init__(self, name: str, loop: AsyncEngine, agents: WorkerAgents, timeout_s: float) -> None:
        self.name, self.loop, self.agents, self.timeout_s = name, loop, agents, timeout_s
        self._leases: dict[str, asyncio.TimerHandle] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()  # ended before lent, oldest first (at most MAX_ENDED)

    async def lend(self, lease_id: str, token_ids: list[int]) -> list[int]:
        """Hold the longest run of `token_ids`' whole blocks this worker has (device, then host tier: copied up)
        for a fetcher; the blocks in order, readable once this returns ([] when it holds none)."""
        blocks, copied = await self.loop.call(lambda e: e.lend_prefix(lease_id, token_ids))
        if not blocks:
            return []
        if lease_id in self._ended:  # ended before it was lent (the coordinator gave up on it)
            del self._ended[lease_id]
            await self.loop.call(lambda e: e.end_lease(lease_id))
            return []
        loop = asyncio.get_running_loop()
        self._leases[lease_id] = loop.call_later(LEASE_TIMEOUTS * self.timeout_s, self._expire, lease_id)
        if copied is not None:  # the copies up from the host tier must have landed before anyone reads the blocks
            from kvtransfer.cache import event_done  # torch: the coordinator imports this module's worker

            try:
                await event_done(copied, time.monotonic() + self.timeout_s)
            except BaseException:
                await self.end(lease_id)
                raise
        return blocks

    async def end(self, lease_id: str) -> bool:
        """The fetcher is done with the lease (or never came): give its blocks back; False if none is held."""
        timer = self._leases.pop(lease_id, None)
        if timer is None:  # not lent (yet): a lend still on its way is ended as it lands
            self._ended[lease_id] = None
            while len(self._ended) > MAX_ENDED:
                self._ended.popitem(last=False)
            return False
        timer.cancel()
        return await self.loop.call(lambda e: e.end_lease(lease_id))

    async def fetch_from(self, source: PrefixSource, token_ids: list[int]) -> tuple[tuple[str, float], ...]:
        """Before a prefill of `token_ids` (prompt, then prior outputs): fetch its leading blocks from `source`;
        the phase it took (`kv_restore`, engine.core.request_timing's name for KV copied in instead of computed)
        if any block came, else nothing."""
        start = time.monotonic()
        tokens = token_ids[:len(source.blocks) * self.loop.engine.config.block_size]
        if await self.fetch(source.lease_id, source.peer, source.blocks, tokens):
            return (("kv_restore", time.monotonic() - start),)
        return ()

    async def fetch(self, lease_id: str, peer: str, peer_blocks: list[int], token_ids: list[int]) -> int:
        """Pull `token_ids`' KV (whole blocks) from worker `peer`'s `peer_blocks` into this worker's prefix cache,
        but for the blocks it holds already; the blocks pulled (0: the fetch failed or found no room, and the
        prompt's prefill computes them)."""
        booking = self.loop.submit(lambda e: e.book_prefix(lease_id, token_ids))
        try:
            booked = await asyncio.shield(booking)
        except asyncio.CancelledError:
            self.loop.submit(lambda e: e.end_lease(lease_id))  # queued after the booking: gives it back
            raise
        except Exception as e:  # noqa: BLE001 - e.g. the id in use: the prompt is computed, nothing was booked
            log.warning("worker %s: no booking for a prefix fetch from %s (%s); computing it", self.name, peer, e)
            return 0
        if booked is None:
            return 0
        blocks, skip, fence = booked
        pull: GroupRead | None = None
        try:
            if skip < len(blocks):
                pull = self.agents.read(peer, peer_blocks[skip:], blocks[skip:], ready=fence.event,
                                        after_launches=fence.follower_launches)
                await pull.landed()
            landed = pull.gpu_done or () if pull is not None else ()
            await self.loop.call(lambda e: e.adopt_prefix(lease_id, token_ids, skip, landed))
            return len(blocks) - skip
        except BaseException as e:  # a cache fill: whatever failed, the prompt is computed instead
            if isinstance(e, Exception):
                log.warning("worker %s: fetching %d prefix blocks from %s failed (%s); computing them", self.name,
                            len(blocks) - skip, peer, e)
            if pull is not None and not await asyncio.shield(_settled(pull)):
                exit_process(self.name, "a prefix fetch's copies did not end by their deadline")
            await asyncio.shield(self.loop.submit(lambda e: e.end_lease(lease_id)))  # a no-op once adopted
            if not isinstance(e, Exception):
                raise  # cancelled: its blocks are given back all the same
            return 0

    def _expire(self, lease_id: str) -> None:
        if self._leases.pop(lease_id, None) is not None:
            log.warning("worker %s: prefix lease %s ended by its timer (nobody ended it)", self.name, lease_id)
            self.loop.submit(lambda e: e.end_lease(lease_id))


async def _settled(pull: GroupRead) -> bool:
    """Wait until a failed pull's copies have ended, so its blocks are not reused under them; False if they had not
    by the pull's deadline (and a second more for the agent to report it)."""
    from kvtransfer.cache import event_done
    from kvtransfer.errors import TransferTimeout

    try:
        for event in pull.gpu_done or ():
            await event_done(event, pull.deadline, spin_s=0.0)
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(pull.future)),
                               max(pull.deadline - time.monotonic(), 0.0) + 1.0)
    except (TransferTimeout, asyncio.TimeoutError):
        return False
    except Exception:  # noqa: BLE001 - the pull's own failure, reported already: its copies have ended
        pass
    return True
