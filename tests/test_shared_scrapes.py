"""SharedScrapes (coordinator.observability.shared_scrapes), the /metrics builds behind every HTTP process: a scrape is
never answered with a text built before it arrived, concurrent scrapes share one build, and builds take at most
1 / (COST_FACTOR + 1) of the time however many scrapes come. Time is the test's own clock: each build takes
BUILD_S of it and each pause the class asks for passes it, so the figures are exact and no wall clock is read."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.observability.shared_scrapes import COST_FACTOR, MAX_GAP_S, SharedScrapes

BUILD_S = 0.03


class Server:
    """What a build reads (`state`), the builds made and the pauses asked for, on a clock of its own."""

    def __init__(self, build_s: float = BUILD_S) -> None:
        self.now, self.state, self.build_s = 100.0, 0, build_s
        self.builds: list[tuple[bool, float, float]] = []  # (audience, started, ended)
        self.pauses: list[float] = []
        self.gate: asyncio.Event | None = None  # set: a build waits for it (a scrape arriving meanwhile)
        self.begun = 0  # builds begun
        self.scrapes = SharedScrapes(self.build, clock=lambda: self.now, sleep=self.sleep)

    async def build(self, full: bool) -> bytes:
        started, state = self.now, self.state  # what the text holds: the state as the build begins
        self.begun += 1
        if self.gate is not None:
            await self.gate.wait()
        self.now += self.build_s
        await asyncio.sleep(0)
        self.builds.append((full, started, self.now))
        return f"{'full' if full else 'public'} {state}".encode()

    async def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


def test_each_scrape_after_an_action_sees_it():
    async def main(server: Server) -> list[bytes]:
        seen = []
        for action in range(1, 6):  # an action, then a scrape, again and again (as an operator or a test does)
            server.state = action
            seen.append(await server.scrapes.get(True))
        return seen
    server = Server()
    assert asyncio.run(main(server)) == [f"full {i}".encode() for i in range(1, 6)]
    # each build after the first waited its turn: COST_FACTOR times the build before it
    assert server.pauses == pytest.approx([COST_FACTOR * BUILD_S] * 4)


def test_concurrent_scrapes_share_one_build_and_latecomers_the_next():
    async def main(server: Server) -> tuple[list[bytes], list[bytes]]:
        server.gate = asyncio.Event()
        first = [asyncio.create_task(server.scrapes.get(True)) for _ in range(50)]
        while not server.begun:
            await asyncio.sleep(0)
        server.state = 7  # changed while the first build runs: the scrapes arriving now must see it
        later = [asyncio.create_task(server.scrapes.get(True)) for _ in range(30)]
        server.gate.set()
        return list(await asyncio.gather(*first)), list(await asyncio.gather(*later))
    server = Server()
    first, later = asyncio.run(main(server))
    assert set(first) == {b"full 0"} and set(later) == {b"full 7"}
    assert len(server.builds) == 2  # 80 scrapes, two builds
    assert server.pauses == pytest.approx([COST_FACTOR * BUILD_S])


def test_a_storm_of_scrapes_builds_at_most_a_share_of_the_time():
    async def main(server: Server) -> None:
        async def scraper(full: bool) -> None:
            for _ in range(40):
                await server.scrapes.get(full)
                await asyncio.sleep(0)
        await asyncio.gather(*[scraper(i % 2 == 0) for i in range(8)])  # both audiences, 320 scrapes
    server = Server()
    asyncio.run(main(server))
    busy = sum(end - start for _, start, end in server.builds)
    elapsed = server.builds[-1][2] - server.builds[0][1] + COST_FACTOR * BUILD_S  # with the last build's pause
    assert len(server.builds) == 2 * 40  # each build shared by the 4 scrapers of its audience
    assert busy / elapsed <= 1 / (COST_FACTOR + 1) + 1e-9
    assert {full for full, _, _ in server.builds} == {True, False}


def test_the_audiences_get_their_own_texts():
    async def main(server: Server) -> tuple[bytes, bytes]:
        return await asyncio.gather(server.scrapes.get(True), server.scrapes.get(False))
    assert asyncio.run(main(Server())) == [b"full 0", b"public 0"]


def test_a_slow_build_pauses_the_next_at_most_max_gap():
    async def main(server: Server) -> None:
        await server.scrapes.get(False)
        await server.scrapes.get(False)
    server = Server(build_s=1.0)
    asyncio.run(main(server))
    assert server.pauses == pytest.approx([MAX_GAP_S])


def test_a_scrape_whose_client_left_cancels_nobody_elses_build():
    async def main(server: Server) -> bytes:
        server.gate = asyncio.Event()
        leaving = asyncio.create_task(server.scrapes.get(True))
        staying = asyncio.create_task(server.scrapes.get(True))
        while not server.begun:
            await asyncio.sleep(0)
        leaving.cancel()
        server.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        return await staying
    assert asyncio.run(main(Server())) == b"full 0"
