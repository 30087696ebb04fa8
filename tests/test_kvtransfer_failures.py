"""Failures are explicit and bounded: a peer killed mid-transfer, a stalled peer, incompatible metadata,
bad descriptors, unknown peers. Each raises a clear TransferError within the timeout and leaves no
staging slot behind, on either side (real ucxx, real processes)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest
import torch

from kvtransfer import (
    AgentConfig,
    AgentMetadata,
    BadDescriptor,
    IncompatibleLayout,
    KVAgent,
    PeerLost,
    TransferError,
    TransferState,
    TransferTimeout,
)
from tests.kvtransfer_helpers import SPEC, PeerError, PeerProcess, bits, random_cache, wait_local

pytestmark = pytest.mark.timeout(150)

CONFIG = {"max_chunk_bytes": 2 * SPEC.block_bytes, "ucx_chunk_bytes": 2 * SPEC.block_bytes,
          "staging_bytes": 64 * SPEC.block_bytes, "timeout_s": 30.0, "connect_timeout_s": 10.0}


@pytest.fixture
def local() -> Iterator[tuple[KVAgent, torch.Tensor]]:
    agent = KVAgent("survivor", AgentConfig(**CONFIG), address="127.0.0.1")
    kv = random_cache(SPEC, 32, seed=5)
    agent.register_cache(kv, SPEC)
    yield agent, kv
    agent.close()


def _clean(agent: KVAgent) -> dict:
    m = wait_local(agent, lambda m: m["staging_in_use"] == 0)
    assert m["staging_in_use"] == 0 and m["staging_quarantined"] == 0
    return m


def test_peer_killed_mid_transfer_fails_fast_on_survivor(local) -> None:
    agent, _ = local
    peer = PeerProcess("victim", num_blocks=32, seed=6, config=CONFIG)
    try:
        agent.add_remote(peer.meta)
        peer.stop()  # frozen: the transfer is certainly in flight when it dies
        reads = [agent.read("victim", [1, 5, 9, 2, 7], [3, 4, 8, 0, 11], timeout=60.0),
                 agent.read("victim", list(range(20, 26)), list(range(20, 26)), timeout=60.0)]
        write = agent.write("victim", [12, 13, 30], [0, 1, 2], timeout=60.0)
        time.sleep(0.3)
        assert all(h.poll() is TransferState.PENDING for h in [*reads, write])
        peer.kill()
        for h in [*reads, write]:
            # PeerLost, not TransferTimeout: the death is noticed long before the 60 s deadline
            with pytest.raises(PeerLost):
                h.wait(30.0)
            assert h.poll() is TransferState.FAILED
        m = _clean(agent)
        assert m["failures"]["PeerLost"] >= 3
        # the dead peer cannot be reconnected either: refused (PeerLost) or, if that is slower than
        # the deadline, TransferTimeout; never a hang
        with pytest.raises((PeerLost, TransferTimeout)):
            agent.read("victim", [1], [1], timeout=10.0).wait(30.0)
    finally:
        peer.kill()


def test_notify_to_a_dead_peer_fails_its_handle(local) -> None:
    agent, _ = local
    peer = PeerProcess("gone", num_blocks=8, seed=9, config=CONFIG)
    try:
        agent.add_remote(peer.meta)
        agent.notify("gone", b"hello").wait(30.0)
        assert peer.call("notifications", 10.0) == {"survivor": [b"hello"]}
        peer.kill()
        failed: TransferError | None = None
        end = time.monotonic() + 60.0
        while failed is None and time.monotonic() < end:  # one may still be sent before the death is seen
            h = agent.notify("gone", b"anyone there?", timeout=10.0)
            try:
                h.wait(30.0)
            except TransferError as e:
                failed = e
        assert isinstance(failed, (PeerLost, TransferTimeout)), failed
        assert h.poll() is TransferState.FAILED
        assert agent.metrics()["ops"]["notify"]["failures"] >= 1
    finally:
        peer.kill()


def test_stalled_peer_times_out_then_recovers(local) -> None:
    agent, kv = local
    peer = PeerProcess("sleepy", num_blocks=32, seed=7, config=CONFIG)
    try:
        agent.add_remote(peer.meta)
        peer.stop()
        h_read = agent.read("sleepy", [1, 3, 5, 7, 9], [0, 2, 4, 6, 8], timeout=1.5)
        h_write = agent.write("sleepy", [10, 12, 14], [1, 2, 3], timeout=1.5)
        for h in (h_read, h_write):
            with pytest.raises(TransferTimeout):
                h.wait(30.0)
        _clean(agent)
        peer.cont()
        # the stale requests fail on the peer and release its slots; a new transfer reconnects
        agent.read("sleepy", [4, 6], [30, 31], timeout=30.0).wait(30.0)
        assert torch.equal(bits(kv[[30, 31]]), bits(peer.call("blocks", [4, 6])))
        assert peer.wait_for(lambda m: m["staging_in_use"] == 0, "staging")["staging_in_use"] == 0
        _clean(agent)
    finally:
        peer.close()


def test_incompatible_layouts_are_refused_on_both_sides(local) -> None:
    agent, _ = local
    other = dataclasses.replace(SPEC, block_size=8)
    peer = PeerProcess("other-model", num_blocks=16, seed=8, config=CONFIG, spec=other)
    try:
        with pytest.raises(IncompatibleLayout, match="block_size"):
            agent.add_remote(peer.meta)
        with pytest.raises(PeerError) as e:
            peer.call("add_remote", agent.metadata().to_bytes())
        assert e.value.kind == "IncompatibleLayout"
        # metadata that lies about the layout gets past our check but not the peer's own
        lie = AgentMetadata.from_bytes(peer.meta)
        assert lie.cache is not None
        lie = dataclasses.replace(lie, cache=dataclasses.replace(lie.cache, spec=SPEC))
        with pytest.raises(IncompatibleLayout, match="block_size"):
            agent.add_remote(lie)
        assert agent.remotes() == {}
        assert peer.call("metrics")["failures"].get("IncompatibleLayout", 0) >= 1
    finally:
        peer.close()


def test_bad_descriptors_are_refused(local) -> None:
    agent, _ = local
    peer = PeerProcess("strict", num_blocks=16, seed=9, config=CONFIG)
    try:
        agent.add_remote(peer.meta)
        for remote_ids, local_ids, layers in [
            ([16], [0], None),  # past the peer's 16 blocks
            ([0], [32], None),  # past our 32 blocks
            ([0, 1], [0], None),  # counts differ
            ([0, 0], [1, 2], None),  # duplicates
            ([0], [0], (3, 9)),  # layers past num_layers
        ]:
            with pytest.raises(BadDescriptor):
                agent.read("strict", remote_ids, local_ids, layers=layers)
        # metadata claiming more blocks than the peer has: the peer itself refuses the descriptor
        big = AgentMetadata.from_bytes(peer.meta)
        assert big.cache is not None
        agent.add_remote(dataclasses.replace(big, cache=dataclasses.replace(big.cache, num_blocks=64)))
        for h in (agent.read("strict", [40, 2], [0, 1]), agent.write("strict", [0, 1], [2, 50])):
            with pytest.raises(BadDescriptor, match="outside"):
                h.wait(30.0)
        _clean(agent)
        assert peer.wait_for(lambda m: m["staging_in_use"] == 0, "staging")["staging_in_use"] == 0
        assert peer.call("metrics")["failures"]["BadDescriptor"] == 2
    finally:
        peer.close()


def test_unknown_and_removed_remotes(local) -> None:
    agent, _ = local
    with pytest.raises(PeerLost, match="no remote"):
        agent.read("nobody", [0], [0])
    peer = PeerProcess("brief", num_blocks=8, seed=10, config=CONFIG)
    try:
        agent.add_remote(peer.meta)
        agent.read("brief", [1], [1]).wait(30.0)
        agent.remove_remote("brief")
        with pytest.raises(PeerLost):
            agent.write("brief", [1], [1])
        assert "brief" not in agent.remotes()
    finally:
        peer.close()


def test_unreachable_peer_fails_to_connect_within_timeout() -> None:
    a = KVAgent("lonely", AgentConfig(connect_timeout_s=3.0), address="127.0.0.1")
    try:
        gone = KVAgent("gone", address="127.0.0.1")
        gone.register_cache(random_cache(SPEC, 4, seed=11), SPEC)
        meta = gone.metadata()
        gone.close()  # closed in a process that lives on: its worker takes the connect request, nobody answers it
        with pytest.raises((PeerLost, TransferTimeout)):
            a.add_remote(meta)
        assert a.remotes() == {}
    finally:
        a.close()
