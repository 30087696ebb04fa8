"""The UCX handshake tells a slow peer from an absent one (real ucxx, real processes), whether peers connect to the
agent's UCX listener or by its worker address (AgentConfig.ucx_connect): a peer that does not answer for a while
(SIGSTOPped during the handshake, then continued) is connected after a retry and serves a transfer; a port where
nothing listens, or a worker address whose process is gone, fails at once with a PeerLost naming the peer, without a
retry; a peer that died fails a transfer's reconnect the same way. Every outcome is counted in the agent's metrics."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvtransfer import AgentConfig, KVAgent, PeerLost, TransferTimeout
from kvtransfer.agent_config import UCX_CONNECT, HandshakePolicy
from kvtransfer.metadata import AgentMetadata
from tests.kvtransfer_helpers import SPEC, PeerProcess, bits, random_cache, wait_local

pytestmark = pytest.mark.timeout(180)

# short attempts so a stopped peer makes several of them time out; a deadline long enough for many
CONFIG = {"staging_bytes": 64 * SPEC.block_bytes, "timeout_s": 60.0, "connect_timeout_s": 90.0,
          "handshake_attempts": 40, "handshake_attempt_s": 0.5, "handshake_backoff_s": 0.05}


@pytest.fixture(params=UCX_CONNECT)
def mode(request) -> str:
    """How peers connect to an agent (both agents of a test use it)."""
    return request.param


@pytest.fixture
def local(mode: str) -> Iterator[tuple[KVAgent, torch.Tensor]]:
    agent = KVAgent("handshaker", AgentConfig(**CONFIG, ucx_connect=mode), address="127.0.0.1")
    kv = random_cache(SPEC, 16, seed=21)
    agent.register_cache(kv, SPEC)
    yield agent, kv
    agent.close()


def test_a_peer_slow_to_accept_is_connected_after_a_retry(local, mode: str) -> None:
    agent, kv = local
    peer = PeerProcess("sleepy", num_blocks=16, seed=22, config={**CONFIG, "ucx_connect": mode})
    outcome: list[BaseException | str] = []
    try:
        peer.stop()  # its listener cannot answer: the handshake's attempts time out while it is stopped
        t = threading.Thread(target=lambda: outcome.append(_try(lambda: agent.add_remote(peer.meta))))
        t.start()
        m = wait_local(agent, lambda m: m["handshakes"]["retried"] >= 2, timeout=60.0)
        assert m["handshakes"]["retried"] >= 2 and not outcome, (m["handshakes"], outcome)
        peer.cont()
        t.join(90.0)
        assert outcome == ["ok"], outcome
        m = agent.metrics()
        assert m["handshakes"]["connected"] == 1 and m["handshakes"]["refused"] == 0
        assert m["handshake_retries_total"] == m["handshakes"]["retried"] >= 2
        agent.read("sleepy", [3, 7, 1], [0, 1, 2]).wait(60.0)
        theirs = peer.call("blocks", [3, 7, 1])
        assert torch.equal(bits(kv[[0, 1, 2]]), bits(theirs))
        # the peer saw the stale attempts' connections too, and still serves: it reads from us
        peer.call("add_remote", agent.metadata().to_bytes())
        peer.call("read", "handshaker", [5], [9], 60.0)
        assert torch.equal(bits(peer.call("blocks", [9])), bits(kv[[5]]))
    finally:
        peer.cont()
        peer.close()


def test_a_port_where_nothing_listens_fails_at_once_with_peer_lost() -> None:
    # one attempt may take all of 60 s: only a refusal seen as such ends this quickly enough for the test's timeout
    config = {**CONFIG, "handshake_attempt_s": 60.0, "connect_timeout_s": 600.0}
    a = KVAgent("lonely", AgentConfig(**config), address="127.0.0.1")
    gone = KVAgent("gone", AgentConfig(ucx_connect="listener"), address="127.0.0.1")
    try:
        a.register_cache(random_cache(SPEC, 4, seed=10), SPEC)
        gone.register_cache(random_cache(SPEC, 4, seed=11), SPEC)
        meta = gone.metadata()
        gone.close()  # its listener is closed: nothing listens at that port
        with pytest.raises(PeerLost, match="'gone' at 127.0.0.1:[0-9]+: refused") as err:
            a.add_remote(meta)
        assert not isinstance(err.value, TransferTimeout)
        assert a.metrics()["handshakes"] == {"connected": 0, "retried": 0, "refused": 1, "failed": 0}
        assert a.remotes() == {}
    finally:
        gone.close()
        a.close()


def test_a_worker_address_whose_process_is_gone_fails_at_once_with_peer_lost() -> None:
    config = {**CONFIG, "handshake_attempt_s": 60.0, "connect_timeout_s": 600.0}
    a = KVAgent("lonely", AgentConfig(**config), address="127.0.0.1")
    peer = PeerProcess("gone", num_blocks=4, seed=11)
    try:
        a.register_cache(random_cache(SPEC, 4, seed=10), SPEC)
        assert AgentMetadata.from_bytes(peer.meta).worker_address is not None  # the default: no UCX listener
        peer.kill()
        with pytest.raises(PeerLost, match="'gone' by its UCX worker address: .*the peer is gone") as err:
            a.add_remote(peer.meta)
        assert not isinstance(err.value, TransferTimeout)
        assert a.metrics()["handshakes"] == {"connected": 0, "retried": 0, "refused": 1, "failed": 0}
        assert a.remotes() == {}
    finally:
        peer.close()
        a.close()


def test_a_dead_peers_reconnect_is_refused_not_retried(local, mode: str) -> None:
    agent, _ = local
    peer = PeerProcess("mortal", num_blocks=16, seed=23, config={**CONFIG, "ucx_connect": mode})
    try:
        agent.add_remote(peer.meta)
        agent.read("mortal", [1], [1]).wait(60.0)
        before = agent.metrics()["handshakes"]  # a loaded machine may have needed a retry to connect at all
        peer.kill()
        # the first transfer after the death may find the old connection still open and fail on it; the one after
        # must reconnect, and that handshake is refused
        for _ in range(2):
            with pytest.raises(PeerLost, match="mortal"):
                agent.read("mortal", [2], [2]).wait(60.0)
        after = agent.metrics()["handshakes"]
        assert after["refused"] - before["refused"] >= 1, (before, after)
        assert after["retried"] == before["retried"] and after["connected"] == before["connected"], (before, after)
    finally:
        peer.close()


def test_handshake_policy_bounds_its_retries() -> None:
    policy = HandshakePolicy(attempts=4, attempt_s=1.0, backoff_s=0.5)
    far = time.monotonic() + 1000.0
    assert list(policy.backoffs(far)) == [0.5, 1.0, 2.0]  # attempts - 1 waits, doubling
    assert list(policy.backoffs(time.monotonic() + 0.2)) == []  # no time left for another attempt
    assert list(HandshakePolicy(attempts=1).backoffs(far)) == []
    for bad in ({"handshake_attempts": 0}, {"handshake_attempt_s": math.nan}, {"handshake_attempt_s": 0.0},
                {"handshake_backoff_s": -1.0}, {"handshake_backoff_s": math.nan}):
        with pytest.raises(ValueError, match="handshake"):
            AgentConfig(**bad)
    with pytest.raises(ValueError, match="ucx_connect must be one of worker_address, listener, got 'sockaddr'"):
        AgentConfig(ucx_connect="sockaddr")
    with pytest.raises(ValueError, match="a UCX port \\(4242\\) needs AgentConfig.ucx_connect='listener'"):
        KVAgent("fixed-port", address="127.0.0.1", port=4242)


def _try(fn) -> BaseException | str:
    try:
        fn()
        return "ok"
    except BaseException as e:  # noqa: BLE001 - reported to the test's thread
        return e
