"""AdmissionQueue: order (priority, FIFO, aging), the head-of-line rule, timeouts, cancellation without losing
capacity, notify, cost by counts, and a low-priority flood against high-priority arrivals (counted, no wall clock)."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.admission.admission_queue import AdmissionQueue, AdmissionTimeout

FAR = 1e9  # a deadline that never comes in a test


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Pool:
    """Capacity in units; try_take(label, n) books n units if they are free. Every call is counted."""

    def __init__(self, free: int = 0) -> None:
        self.free = free
        self.calls: list[str] = []
        self.served: list[str] = []

    def taker(self, label: str, n: int = 1):
        def take() -> str | None:
            self.calls.append(label)
            if self.free < n:
                return None
            self.free -= n
            self.served.append(label)
            return label
        return take


def start(queue: AdmissionQueue, pool: Pool, label: str, priority: int, deadline: float = FAR, n: int = 1,
          **kw) -> asyncio.Task:
    return asyncio.get_running_loop().create_task(queue.acquire(priority, deadline, pool.taker(label, n), **kw))


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_priority_order_then_fifo_within_a_priority() -> None:
    async def main() -> None:
        queue, pool = AdmissionQueue(aging_s=10, clock=FakeClock()), Pool()
        tasks = [start(queue, pool, f"p{p}-{i}", p) for i, p in enumerate([3, 1, 2, 1, 3, 2])]
        await settle()
        assert len(queue) == 6 and queue.waiting_by_priority() == {1: 2, 2: 2, 3: 2}
        pool.free = 6
        queue.notify()
        assert pool.served == ["p1-1", "p1-3", "p2-2", "p2-5", "p3-0", "p3-4"]
        assert await asyncio.gather(*tasks) == ["p3-0", "p1-1", "p2-2", "p1-3", "p3-4", "p2-5"]
        assert len(queue) == 0 and queue.waiting_by_priority() == {}
    asyncio.run(main())


def test_effective_priority_improves_one_class_per_aging_period_down_to_best() -> None:
    queue = AdmissionQueue(aging_s=10)
    assert [queue.effective_priority(3, w) for w in (0, 9.99, 10, 25, 35, 1e6, -5)] == [3, 3, 2, 1, 0, 0, 3]
    assert queue.effective_priority(0, 1e6) == 0 and queue.effective_priority(-2, 50) == -2
    assert AdmissionQueue(aging_s=10, best=1).effective_priority(3, 1e6) == 1
    for bad in (0, -1, True, "10"):
        with pytest.raises(ValueError, match="AdmissionQueue.aging_s"):
            AdmissionQueue(aging_s=bad)


def test_aging_lets_an_old_low_waiter_go_before_newer_ones_of_the_class_it_reached() -> None:
    async def main() -> None:
        clock = FakeClock()
        queue, pool = AdmissionQueue(aging_s=10, clock=clock), Pool()
        tasks = [start(queue, pool, "low", 3)]
        await settle()
        clock.now = 5
        tasks.append(start(queue, pool, "high", 1))
        tasks.append(start(queue, pool, "normal", 2))
        await settle()
        clock.now = 15            # low has aged to 2: behind high, ahead of the newer normal
        pool.free = 1
        queue.notify()
        assert pool.served == ["high"]
        clock.now = 20            # low aged to 1 and normal (15 s) too: both older than a new high
        tasks.append(start(queue, pool, "high2", 1))
        await settle()
        pool.free = 2
        queue.notify()
        assert pool.served == ["high", "low", "normal"]
        pool.free = 1
        queue.notify()
        assert pool.served[-1] == "high2"
        await asyncio.gather(*tasks)
    asyncio.run(main())


def test_head_of_line_nobody_passes_a_head_that_does_not_fit() -> None:
    async def main() -> None:
        queue, pool = AdmissionQueue(aging_s=10, clock=FakeClock()), Pool(free=4)
        big = start(queue, pool, "big", 1, n=8)
        small = [start(queue, pool, f"small{i}", 2) for i in range(3)]
        await settle()
        assert pool.served == [] and pool.calls == ["big"] * 4  # each arrival asks only the head
        queue.notify()
        assert pool.calls == ["big"] * 5 and len(queue) == 4
        pool.free = 9
        queue.notify()
        assert pool.served == ["big", "small0"] and pool.free == 0
        better = start(queue, pool, "better", 0)  # a newcomer better than the head goes first
        await settle()
        pool.free = 1
        queue.notify()
        assert pool.served[-1] == "better"
        pool.free = 2
        queue.notify()
        assert pool.served[-2:] == ["small1", "small2"] and len(queue) == 0
        await asyncio.gather(big, better, *small)
    asyncio.run(main())


def test_timeout_at_the_deadline_by_the_queue_clock_leaves_no_waiter() -> None:
    async def main() -> None:
        clock = FakeClock()
        queue, pool = AdmissionQueue(aging_s=10, clock=clock), Pool()
        task = start(queue, pool, "a", 2, deadline=5.0)
        other = start(queue, pool, "b", 2)
        await settle()
        clock.now = 5.0
        pool.free = 1
        queue.notify()            # the pass expires "a" first: capacity goes to "b", never to "a"
        assert pool.served == ["b"] and pool.calls.count("a") == 2
        with pytest.raises(AdmissionTimeout):
            await task
        assert await other == "b" and len(queue) == 0 and queue.waiting_by_priority() == {}
    asyncio.run(main())


def test_timeout_fires_without_notify_and_unblocks_the_waiters_behind() -> None:
    async def main() -> None:
        clock = FakeClock()
        queue, pool = AdmissionQueue(aging_s=10, clock=clock, timeout_error=TimeoutError), Pool(free=2)
        head = start(queue, pool, "big", 1, deadline=0.01, n=8)  # the loop's timer expires it; no notify
        small = start(queue, pool, "small", 2)
        with pytest.raises(TimeoutError):
            await head
        assert await small == "small" and len(queue) == 0
        past = start(queue, pool, "late", 1, deadline=-1.0)
        with pytest.raises(TimeoutError):
            await past
        assert "late" not in pool.calls
    asyncio.run(main())


def test_cancelled_waiter_leaves_no_trace_and_is_never_asked_again() -> None:
    async def main() -> None:
        queue, pool = AdmissionQueue(aging_s=10, clock=FakeClock()), Pool()
        a, b, c = (start(queue, pool, x, 1) for x in "abc")
        await settle()
        a.cancel()                # cancelled, its handler has not run yet: the pass must skip it
        pool.free = 1
        queue.notify()
        assert pool.served == ["b"] and pool.calls.count("a") == 3
        await asyncio.gather(a, return_exceptions=True)
        assert a.cancelled() and len(queue) == 1
        c.cancel()
        await asyncio.gather(c, return_exceptions=True)
        assert len(queue) == 0 and queue.waiting_by_priority() == {} and await b == "b"
    asyncio.run(main())


def test_cancel_after_grant_gives_the_capacity_back_to_the_next_waiter() -> None:
    async def main() -> None:
        queue, pool = AdmissionQueue(aging_s=10, clock=FakeClock()), Pool()
        released: list[str] = []

        def release(label: str) -> None:
            released.append(label)
            pool.free += 1

        a = start(queue, pool, "a", 1, release=release)
        b = start(queue, pool, "b", 1, release=release)
        await settle()
        pool.free = 1
        queue.notify()
        assert pool.served == ["a"]
        a.cancel()                # granted, not yet resumed: the result must not be lost
        await asyncio.gather(a, return_exceptions=True)
        assert a.cancelled() and released == ["a"]
        assert await b == "b" and pool.free == 0 and len(queue) == 0
    asyncio.run(main())


def test_a_failing_try_take_fails_only_its_own_waiter() -> None:
    async def main() -> None:
        queue, pool = AdmissionQueue(aging_s=10, clock=FakeClock()), Pool()

        def broken() -> None:
            raise RuntimeError("worker gone")

        bad = asyncio.get_running_loop().create_task(queue.acquire(1, FAR, broken))
        good = start(queue, pool, "good", 1)
        await settle()
        pool.free = 1
        queue.notify()
        with pytest.raises(RuntimeError, match="worker gone"):
            await bad
        assert await good == "good" and len(queue) == 0
    asyncio.run(main())


def test_notify_wakes_exactly_as_many_as_fit_and_asks_one_more() -> None:
    async def main() -> None:
        queue, pool = AdmissionQueue(aging_s=10, clock=FakeClock()), Pool()
        tasks = [start(queue, pool, f"w{i}", 2) for i in range(5)]
        await settle()
        pool.calls.clear()
        pool.free = 2
        queue.notify()
        assert pool.calls == ["w0", "w1", "w2"] and pool.served == ["w0", "w1"]
        await settle()
        assert [t.done() for t in tasks] == [True, True, False, False, False]
        queue.notify()            # nothing freed: the head is asked once, nobody else
        assert pool.calls[3:] == ["w2"]
        for t in tasks[2:]:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert len(queue) == 0
    asyncio.run(main())


class CountingQueue(AdmissionQueue):
    """Counts how many waiters the wake passes rank (each ranking computes one effective priority)."""

    ranked = 0

    def effective_priority(self, priority: int, waited_s: float) -> int:
        self.ranked += 1
        return super().effective_priority(priority, waited_s)


def test_a_thousand_waiters_cost_per_grant_not_per_waiter() -> None:
    async def main() -> None:
        queue, pool = CountingQueue(aging_s=10, clock=FakeClock()), Pool()
        tasks = [start(queue, pool, f"w{i}", 1 + i % 3) for i in range(1000)]
        await settle()
        assert len(queue) == 1000 and len(pool.calls) == 1000   # one ask per arrival
        assert queue.ranked <= 3 * 1000
        for t in tasks[1::2]:
            t.cancel()
        await asyncio.gather(*tasks[1::2], return_exceptions=True)
        assert len(queue) == 500
        queue.ranked, pool.calls = 0, []
        pool.free = 500
        queue.notify()
        assert len(pool.calls) == 500 and pool.free == 0 and len(queue) == 0
        assert queue.ranked <= 3 * 501   # at most one head per priority per grant, not a scan of the waiters
        assert sorted(await asyncio.gather(*tasks[::2])) == sorted(f"w{i}" for i in range(0, 1000, 2))
        assert queue._entries + len(queue._deadlines) <= 256  # removed waiters were compacted away
    asyncio.run(main())


def flood(aging_s: float, k: int = 4, steps: int = 400) -> list[str]:
    """K slots. 200 low waiters, then 20 high ones; then each step one request ends (FIFO) and, once the 20 are
    served, one new high request arrives per step, with the clock one second later. Returns the service order."""
    async def main() -> list[str]:
        clock = FakeClock()
        queue, pool = AdmissionQueue(aging_s=aging_s, clock=clock), Pool(free=k)
        tasks = [start(queue, pool, f"low{i}", 3) for i in range(200)]
        await settle()
        tasks += [start(queue, pool, f"high{i}", 1) for i in range(20)]
        await settle()
        for step in range(steps):
            if len(pool.served) >= 24:
                clock.now += 1.0
                tasks.append(start(queue, pool, f"late{step}", 1))
                await settle()
            pool.free += 1
            queue.notify()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert len(queue) == 0
        return pool.served
    return asyncio.run(main())


def test_high_priority_arrivals_go_before_a_waiting_low_flood_and_aging_serves_every_low() -> None:
    served = flood(aging_s=10)
    assert served[:4] == [f"low{i}" for i in range(4)]       # the flood took the free slots before they came
    assert served[4:24] == [f"high{i}" for i in range(20)]   # then every high before any waiting low
    lows = [s for s in served if s.startswith("low")]
    assert lows == [f"low{i}" for i in range(200)]           # every low served, in arrival order
    late = [i for i, s in enumerate(served) if s.startswith("late")]
    assert late and late[-1] > served.index("low199")        # the high stream resumes after them

    starved = flood(aging_s=1e9)                              # no aging: the high stream takes every slot
    assert [s for s in starved if s.startswith("low")] == [f"low{i}" for i in range(4)]


def test_a_small_request_passes_a_head_that_does_not_fit_until_the_head_has_waited_bypass_s() -> None:
    """Within bypass_s of the head's arrival, waiters behind it take what it cannot use; after that, what frees
    stays for the head (no stream of small requests starves it)."""
    async def main() -> None:
        clock = FakeClock()
        queue, pool = AdmissionQueue(aging_s=100, clock=clock, bypass_s=5), Pool(free=4)
        big = start(queue, pool, "big", 2, n=8)
        small = [start(queue, pool, f"small{i}", 2) for i in range(6)]  # the head's class
        await settle()
        assert pool.served == [f"small{i}" for i in range(4)] and queue.bypassed == 4  # the head would not fit
        clock.now = 6                  # the head has waited past bypass_s: nobody passes it now
        pool.free = 2
        queue.notify()
        assert pool.served[4:] == [] and pool.free == 2
        pool.free = 8
        queue.notify()
        assert pool.served[4:] == ["big"] and pool.free == 0
        pool.free = 2
        queue.notify()
        assert pool.served[5:] == ["small4", "small5"] and len(queue) == 0
        await asyncio.gather(big, *small)
    asyncio.run(main())


def test_bypass_s_must_be_a_number() -> None:
    with pytest.raises(ValueError, match="bypass_s"):
        AdmissionQueue(aging_s=1, bypass_s=-1)


def test_a_lower_class_never_passes_a_higher_head() -> None:
    async def main() -> None:
        queue, pool = AdmissionQueue(aging_s=100, clock=FakeClock(), bypass_s=5), Pool(free=4)
        big = start(queue, pool, "big-high", 1, n=8)
        low = start(queue, pool, "small-low", 3)
        same = start(queue, pool, "small-high", 1)
        await settle()
        assert pool.served == ["small-high"]  # its own class may pass it; the low one waits
        pool.free = 8
        queue.notify()
        assert pool.served == ["small-high", "big-high"]
        pool.free = 1
        queue.notify()
        await asyncio.gather(big, low, same)
        assert pool.served[-1] == "small-low"
    asyncio.run(main())
