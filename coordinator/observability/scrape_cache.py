"""ScrapeCache: /metrics texts reused for a while, so scrapes cannot take the serving loop from the streams.

A whole exposition is milliseconds of Python on the event loop that also runs every stream of the process; 8
clients scraping 40 times a second tripled running streams' inter-token gaps (issue 46). Here each text (one per
audience: with or without the tenant-labelled families) is built by one scrape at a time, the scrapes that arrive
meanwhile wait for that build, and it is reused for COST_FACTOR times as long as it took to build: however often
/metrics is scraped, building it takes at most about 1 / (COST_FACTOR + 1) of the loop's time, and a text is never
older than that multiple of its own build time (a few tens of milliseconds on an idle server; at most
MAX_AGE_S). Not thread-safe: the event loop's only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

COST_FACTOR = 10.0
MAX_AGE_S = 5.0


class ScrapeCache:
    def __init__(self, build: Callable[[bool], Awaitable[bytes]], clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self._build, self._clock = build, clock
        self._texts: dict[bool, tuple[float, bytes]] = {}  # audience -> (reusable until, text)
        self._building: dict[bool, asyncio.Future[bytes]] = {}

    async def get(self, full: bool) -> bytes:
        """The exposition for `full` (with the tenants' families) or the public one."""
        kept = self._texts.get(full)
        if kept is not None and self._clock() < kept[0]:
            return kept[1]
        building = self._building.get(full)
        if building is None:
            building = asyncio.ensure_future(self._rebuild(full))
            self._building[full] = building
        return await asyncio.shield(building)  # a scrape whose client left does not cancel the others' build

    async def _rebuild(self, full: bool) -> bytes:
        started = self._clock()
        try:
            text = await self._build(full)
        finally:
            del self._building[full]
        ended = self._clock()
        self._texts[full] = (ended + min(MAX_AGE_S, COST_FACTOR * (ended - started)), text)
        return text
