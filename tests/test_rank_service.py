"""Calls from rank 0 to a follower's rank service (engine.runner.rank_service), over a real pipe and threads:
answers come back matched to their calls whatever their order, a raised exception is re-raised in the caller,
and a call pending when the follower's end closes fails instead of hanging; a follower's LaunchClock lets a call wait
for its launches."""

import multiprocessing
import threading

import pytest

from engine.runner.rank_service import RankCallError, RankCalls, serve_calls


class Service:
    def __init__(self) -> None:
        self.release = threading.Event()

    def slow(self, x: int) -> int:
        assert self.release.wait(10)
        return x + 1

    def fast(self, x: int) -> int:
        return x * 2

    def broken(self) -> None:
        raise KeyError("no such peer")


def test_answers_match_their_calls_in_any_order_and_errors_are_reraised():
    ours, theirs = multiprocessing.Pipe()
    service = Service()
    serve_calls(theirs, service)
    calls = RankCalls([ours])
    slow = calls.call(1, "slow", 1)
    fast = calls.call(1, "fast", 21)
    assert fast.result(10) == 42 and not slow.done()  # the slow call does not hold the fast one back
    service.release.set()
    assert slow.result(10) == 2
    with pytest.raises(KeyError, match="no such peer"):
        calls.call(1, "broken").result(10)
    with pytest.raises(AttributeError):
        calls.call(1, "missing").result(10)


def test_a_call_pending_when_the_follower_goes_away_fails():
    ours, theirs = multiprocessing.Pipe()
    calls = RankCalls([ours])
    pending = calls.call(1, "slow", 1)  # nobody serves the other end
    theirs.close()
    with pytest.raises(RankCallError, match="rank 1 stopped before answering"):
        pending.result(10)


def test_a_launch_clock_waits_for_the_followers_launches():
    from engine.runner.tp_follower import LaunchClock
    clock = LaunchClock()
    assert clock.wait_for(0, 0.01) and not clock.wait_for(1, 0.01)  # nothing launched yet: times out
    ticker = threading.Thread(target=lambda: [clock.tick() for _ in range(3)])
    ticker.start()
    assert clock.wait_for(3, 10) and clock.count == 3
    ticker.join()
