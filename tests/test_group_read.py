"""GroupRead.landed(): when a worker's pull counts as landed (kvtransfer.worker_agents).

A cuda_ipc pull at TP=1 is done when its GPU copies are; landed() polls their events on the caller's loop instead
of waiting for the agent's loop thread to complete the future. CUDA events do not exist on this machine, so the
events here are stand-ins with the two methods kvtransfer.cache.event_done uses (query, synchronize); the futures
are real concurrent futures, completed from another thread as the agent's loop does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from kvtransfer.errors import PeerLost, TransferTimeout
from kvtransfer.worker_agents import GroupRead


class CopyEvent:
    """Completes after `polls` queries, or when set()."""

    def __init__(self, polls: int = 3) -> None:
        self.polls = polls
        self._done = threading.Event()

    def query(self) -> bool:
        self.polls -= 1
        if self.polls <= 0:
            self._done.set()
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()

    def set(self) -> None:
        self._done.set()


def _read(events: tuple | None, timeout_s: float = 30.0) -> tuple[GroupRead, concurrent.futures.Future]:
    future: concurrent.futures.Future = concurrent.futures.Future()
    return GroupRead(future, events, time.monotonic() + timeout_s), future


def test_landed_once_the_copies_are_done_without_the_agents_future() -> None:
    read, future = _read((CopyEvent(), CopyEvent(polls=10)))
    asyncio.run(asyncio.wait_for(read.landed(), 5))
    assert not future.done()  # the agent's loop has not reported yet: the copies' events were enough


def test_copies_that_ended_landed_whatever_the_agent_heard_of_the_peer_since() -> None:
    read, future = _read((CopyEvent(),))
    future.set_exception(PeerLost("the remote was lost"))  # after the copies were queued: they read mapped memory
    asyncio.run(asyncio.wait_for(read.landed(), 5))


def test_without_events_the_agents_future_decides() -> None:
    read, future = _read(None)
    threading.Timer(0.05, future.set_result, (None,)).start()
    asyncio.run(asyncio.wait_for(read.landed(), 5))
    read, future = _read(None)
    threading.Timer(0.05, future.set_exception, (PeerLost("gone"),)).start()
    with pytest.raises(PeerLost):
        asyncio.run(asyncio.wait_for(read.landed(), 5))


def test_a_copy_past_the_deadline_is_left_to_the_agent_which_reports_the_timeout() -> None:
    stuck = CopyEvent(polls=10**9)
    read, future = _read((stuck,), timeout_s=0.05)
    timeout = TransferTimeout("GPU copy did not finish before the deadline")
    threading.Timer(0.3, future.set_exception, (timeout,)).start()  # the agent gives up; the copy runs on
    threading.Timer(1.0, stuck.set).start()  # then ends: the loop's executor thread blocked on it may go
    with pytest.raises(TransferTimeout):
        asyncio.run(asyncio.wait_for(read.landed(), 5))


def test_a_copy_that_ended_while_the_agent_settled_it_has_landed() -> None:
    late = CopyEvent(polls=10**9)
    read, future = _read((late,), timeout_s=0.05)

    def agent_gives_up() -> None:  # as the agent does: its copies settle, then it reports the timeout
        late.set()
        future.set_exception(TransferTimeout("GPU copy did not finish before the deadline"))
    threading.Timer(0.3, agent_gives_up).start()
    asyncio.run(asyncio.wait_for(read.landed(), 5))
