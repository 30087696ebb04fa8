"""SharedScrapes: /metrics texts built at a bounded rate and shared by the scrapes waiting for them, so scrapes cannot
take the serving loop from the streams, and no scrape is answered with figures from before it arrived.

A whole exposition is milliseconds of Python on the event loop that also runs every stream of the process; 8
clients scraping 40 times a second tripled running streams' inter-token gaps (issue 46). Here the texts (one per
audience: with or without the tenant-labelled families) are built one at a time, and a build starts no sooner than
COST_FACTOR times the previous build's duration after it ended (at most MAX_GAP_S later): however often /metrics is
scraped, building takes at most about 1 / (COST_FACTOR + 1) of the loop's time.

A scrape is never given a text whose build began before the scrape arrived: it joins the next build of its audience
that has not started, so it reads what this process knew when it asked (a request just answered is counted, a
worker just drained shows so), as without any sharing. A storm of scrapes pays in waiting (up to the gap and two
builds), never in staleness; an occasional scrape (Prometheus: one every 15 s) finds no build due and waits only for
its own. Not thread-safe: the event loop's only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

COST_FACTOR = 10.0  # the pause after a build, in build times
MAX_GAP_S = 1.0     # the longest pause after a build (a slow build's scrapes wait no longer than this for a turn)


class SharedScrapes:
    def __init__(self, build: Callable[[bool], Awaitable[bytes]], clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self._build, self._clock, self._sleep = build, clock, sleep
        self._next: dict[bool, asyncio.Task[bytes]] = {}  # audience -> its build that has not started: arrivals join
        self._turn = asyncio.Lock()  # one build at a time, either audience
        self._due = float("-inf")  # when the next build may start

    async def get(self, full: bool) -> bytes:
        """The exposition for `full` (with the tenants' families) or the public one, built after this call began."""
        build = self._next.get(full)
        if build is None:
            build = self._next[full] = asyncio.create_task(self._run(full))
        return await asyncio.shield(build)  # a scrape whose client left does not cancel the others' build

    async def _run(self, full: bool) -> bytes:
        me = asyncio.current_task()
        try:
            async with self._turn:
                wait = self._due - self._clock()
                if wait > 0:
                    await self._sleep(wait)
                del self._next[full]  # a scrape arriving from now on needs a build that starts after it
                started = self._clock()
                try:
                    return await self._build(full)
                finally:
                    ended = self._clock()
                    self._due = ended + min(MAX_GAP_S, COST_FACTOR * (ended - started))
        finally:  # cancelled before it started (the loop closing): later scrapes must not join it
            if self._next.get(full) is me:
                del self._next[full]
