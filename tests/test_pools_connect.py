"""Pools' peer connections at start-up and after a replacement: a connect that times out (PeerLost, as Ray raises it
from the worker) is tried again up to CONNECT_ATTEMPTS times, after waits that double; any other error is raised at
once."""

import asyncio

import pytest
from ray.exceptions import RayTaskError

from coordinator.backend import peer_links
from coordinator.backend.peer_links import CONNECT_ATTEMPTS, connect_link
from kvtransfer.errors import PeerLost


def _calls(*outcomes):
    made = []

    def call():
        made.append(len(made))
        outcome = outcomes[len(made) - 1]

        async def run():
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome
        return run()
    return call, made


def _from_worker(error: Exception) -> Exception:
    """The error as a Ray actor call raises it: a RayTaskError that is also an instance of its cause."""
    return RayTaskError("add_peer", "traceback", error).as_instanceof_cause()


@pytest.fixture(autouse=True)
def waits(monkeypatch):
    """The waits connect_link takes between attempts (the sleep recorded, not slept)."""
    taken = []

    async def sleep(seconds):
        taken.append(seconds)
    monkeypatch.setattr(peer_links.asyncio, "sleep", sleep)
    return taken


def test_a_timed_out_connect_is_tried_again_until_it_succeeds(waits):
    lost = _from_worker(PeerLost("cannot connect to 'prefill-0': TimeoutError"))
    call, made = _calls(*([lost] * (CONNECT_ATTEMPTS - 1)), "prefill-0")
    asyncio.run(connect_link(call, "decode-0 to prefill-0"))
    assert len(made) == CONNECT_ATTEMPTS
    assert waits == [peer_links.CONNECT_BACKOFF_S * 2 ** i for i in range(CONNECT_ATTEMPTS - 1)]


def test_it_gives_up_after_the_last_attempt_and_other_errors_are_not_retried():
    lost = _from_worker(PeerLost("cannot connect"))
    call, made = _calls(*([lost] * CONNECT_ATTEMPTS))
    with pytest.raises(PeerLost):
        asyncio.run(connect_link(call, "decode-0 to prefill-0"))
    assert len(made) == CONNECT_ATTEMPTS
    call, made = _calls(_from_worker(ValueError("incompatible agents")), "never")
    with pytest.raises(ValueError):
        asyncio.run(connect_link(call, "decode-0 to prefill-0"))
    assert len(made) == 1
