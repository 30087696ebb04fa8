"""Injected faults and dropping peers, on real agents over real ucxx (a local agent and peers in processes):
fail / stall / drop-after-N injection surfaces as the real errors and is counted; `remove_remote` fails what is
in flight with PeerLost and a restarted peer under the same name transfers bit-exact; PDSERVE_KV_FAULTS parsing."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from kvtransfer import (
    FAULTS_ENV_VAR,
    AgentConfig,
    FaultConfig,
    KVAgent,
    PeerLost,
    TransferError,
    TransferHandle,
    TransferState,
    TransferTimeout,
)
from tests.kvtransfer_helpers import SPEC, PeerProcess, bits, random_cache, wait_local

pytestmark = pytest.mark.timeout(200)

CONFIG = {"ucx_chunk_bytes": 2 * SPEC.block_bytes, "staging_bytes": 64 * SPEC.block_bytes, "timeout_s": 30.0}


def _agent(name: str, seed: int, faults: FaultConfig | None = None) -> tuple[KVAgent, torch.Tensor]:
    agent = KVAgent(name, AgentConfig(**CONFIG, faults=faults), address="127.0.0.1")
    kv = random_cache(SPEC, 32, seed=seed)
    agent.register_cache(kv, SPEC)
    return agent, kv


@pytest.fixture
def peer() -> Iterator[PeerProcess]:
    p = PeerProcess("peer", num_blocks=32, seed=2, config=CONFIG)
    yield p
    p.close()


def _failure(h: TransferHandle) -> BaseException | None:
    """Wait for the transfer to end (bounded) and return its error (None if it succeeded)."""
    try:
        h.wait(60.0)
    except TransferError:
        pass
    assert h.poll() is not TransferState.PENDING
    return h.error()


def _clean(agent: KVAgent) -> dict:
    m = wait_local(agent, lambda m: m["staging_in_use"] == 0 and m["in_flight"] == 0)
    assert (m["staging_in_use"], m["staging_quarantined"], m["in_flight"]) == (0, 0, 0)
    return m


def test_fail_fraction_one_fails_every_transfer_before_any_byte_moves(peer) -> None:
    agent, kv = _agent("local", 1, FaultConfig(fail_fraction=1.0))
    try:
        agent.add_remote(peer.meta)
        before_local, before_peer = kv.clone(), peer.call("blocks", list(range(32)))
        handles = [agent.read("peer", [1, 2, 9], [4, 5, 6]), agent.write("peer", [7, 8], [10, 20]),
                   agent.read("peer", [30], [31]), agent.write("peer", [0, 3, 11, 12], [1, 2, 3, 4])]
        for h in handles:
            with pytest.raises(TransferError) as e:
                h.wait(30.0)
            assert type(e.value) is TransferError and "injected" in str(e.value)
        assert torch.equal(bits(kv), bits(before_local))
        assert torch.equal(bits(peer.call("blocks", list(range(32)))), bits(before_peer))
        m = _clean(agent)
        assert m["failures"] == {"TransferError": 4} and m["failures_total"] == 4
        assert m["ops"]["read"]["failures"] == 2 and m["ops"]["write"]["failures"] == 2
        assert m["injected_faults"] == {"fail": 4}
        assert m["injected_faults_total"] == 4 and m["injected_failures_total"] == 4
        assert "serve_read" not in peer.call("metrics")["ops"]  # nothing reached the peer
        assert agent.notify("peer", b"still talking").wait(30.0) is None  # notifications are not faulted
        assert peer.call("notifications", 10.0) == {"local": [b"still talking"]}
    finally:
        agent.close()


def _round(agent: KVAgent, kv: torch.Tensor, peer: PeerProcess, n: int) -> list[int]:
    """n single-block reads peer block i -> local block i; the indices that failed (each checked)."""
    src = peer.call("blocks", list(range(n)))
    failed = []
    for i in range(n):
        before = kv[i].clone()
        err = _failure(agent.read("peer", [i], [i]))
        if err is None:
            assert torch.equal(bits(kv[i]), bits(src[i]))
        else:
            assert type(err) is TransferError
            assert torch.equal(bits(kv[i]), bits(before))
            failed.append(i)
    return failed


def test_seeded_fail_fraction_is_reproducible_and_the_rest_bit_exact(peer, monkeypatch) -> None:
    faults = FaultConfig(fail_fraction=0.3, seed=7)
    agent, kv = _agent("local", 1, faults)
    monkeypatch.setenv(FAULTS_ENV_VAR, "fail=0.3,seed=7")
    twin, twin_kv = _agent("twin", 3)  # no faults in its config: the environment's apply
    try:
        assert twin.faults == faults
        for a in (agent, twin):
            a.add_remote(peer.meta)
        first = _round(agent, kv, peer, 24)
        assert 0 < len(first) < 24
        m = _clean(agent)
        assert m["failures"] == {"TransferError": len(first)} and m["injected_faults"] == {"fail": len(first)}
        assert m["ops"]["read"]["count"] == 24 - len(first)
        kv.copy_(random_cache(SPEC, 32, seed=9))
        assert agent.set_faults({"fail_fraction": 0.3, "seed": 7}) == faults  # a fresh RNG from the seed
        assert _round(agent, kv, peer, 24) == first
        assert _round(twin, twin_kv, peer, 24) == first
        agent.set_faults(None)
        assert _round(agent, kv, peer, 8) == []
    finally:
        agent.close()
        twin.close()


def test_stall_within_the_deadline_completes_and_beyond_it_times_out(peer) -> None:
    agent, kv = _agent("local", 1, FaultConfig(stall_fraction=1.0, stall_s=0.2))
    try:
        agent.add_remote(peer.meta)
        agent.read("peer", [3, 4], [5, 6]).wait(30.0)
        assert torch.equal(bits(kv[[5, 6]]), bits(peer.call("blocks", [3, 4])))
        assert agent.metrics()["injected_faults"] == {"stall": 1}
        agent.set_faults(FaultConfig(stall_fraction=1.0, stall_s=3600.0))
        before = kv.clone()
        handles = [agent.read("peer", [1], [2], timeout=1.0), agent.write("peer", [9], [9], timeout=1.0)]
        for h in handles:
            assert isinstance(_failure(h), TransferTimeout)
        assert torch.equal(bits(kv), bits(before))
        m = _clean(agent)
        assert m["failures"] == {"TransferTimeout": 2} and m["injected_failures_total"] == 2
        assert m["injected_faults"] == {"stall": 3}  # set_faults changes the faults, not the counters
    finally:
        agent.close()


def test_drop_peer_after_n_transfers(peer) -> None:
    agent, kv = _agent("local", 1, FaultConfig(drop_peer_after=3))
    try:
        agent.add_remote(peer.meta)
        src = peer.call("blocks", list(range(8)))
        for i in range(3):
            agent.read("peer", [i], [i]).wait(30.0)
        assert torch.equal(bits(kv[:3]), bits(src[:3]))
        for i in (3, 4):
            err = _failure(agent.read("peer", [i], [i]))
            assert isinstance(err, PeerLost) and "fault injection" in str(err)
        assert agent.remotes() == {}
        m = _clean(agent)
        assert m["lost_remotes"] == {"peer": "dropped by fault injection after 3 transfers"}
        assert m["failures"] == {"PeerLost": 2} and m["injected_faults"] == {"drop": 2}
        assert m["injected_failures_total"] == 2
        # adding the same peer again reconnects it, and its count starts over
        agent.add_remote(peer.meta)
        assert agent.remotes() == {"peer": "ucx"}
        for i in range(5, 8):
            agent.write("peer", [i + 10], [i]).wait(30.0)
        assert torch.equal(bits(peer.call("blocks", [5, 6, 7])), bits(kv[15:18]))
        assert isinstance(_failure(agent.write("peer", [1], [1])), PeerLost)
        assert peer.wait_for(lambda m: m["staging_in_use"] == 0, "staging")["staging_in_use"] == 0
    finally:
        agent.close()


def test_remove_remote_fails_in_flight_transfers_and_a_restarted_peer_is_readded(peer) -> None:
    agent, kv = _agent("local", 1)
    try:
        assert agent.remove_remote("nobody") is False
        agent.add_remote(peer.meta)
        agent.add_remote(peer.meta)  # the same metadata again: a no-op ...
        peer.stop()  # frozen: the transfers below stay in flight
        reads = [agent.read("peer", [1, 5, 9], [3, 4, 8], timeout=120.0),
                 agent.read("peer", list(range(20, 26)), list(range(20, 26)), timeout=120.0)]
        write = agent.write("peer", [12, 13], [0, 1], timeout=120.0)
        agent.add_remote(peer.meta)  # ... that leaves them alone
        assert all(h.poll() is TransferState.PENDING for h in [*reads, write])
        assert agent.remove_remote("peer") is True
        for h in [*reads, write]:  # ended by the time remove_remote returned
            assert h.done() and isinstance(h.error(), PeerLost)
        assert agent.remotes() == {}
        m = _clean(agent)
        assert m["failures"] == {"PeerLost": 3} and m["injected_failures_total"] == 0
        with pytest.raises(PeerLost, match="no remote"):
            agent.read("peer", [1], [1])
        assert agent.metrics()["failures"] == {"PeerLost": 4}  # refused at once, still counted
        peer.kill()

        # a replacement under the same name: new process, new port, new cache contents
        new = PeerProcess("peer", num_blocks=32, seed=77, config=CONFIG)
        try:
            assert new.meta != peer.meta
            agent.add_remote(new.meta)
            rng = random.Random(3)
            src, dst = rng.sample(range(32), 7), rng.sample(range(32), 7)
            agent.read("peer", src, dst).wait(30.0)
            assert torch.equal(bits(kv[dst]), bits(new.call("blocks", src)))
            new.call("add_remote", agent.metadata().to_bytes())
            new.call("write", "local", [0, 1], [30, 31], 30.0)
            assert torch.equal(bits(kv[[30, 31]]), bits(new.call("blocks", [0, 1])))
            _clean(agent)
        finally:
            new.close()
    finally:
        agent.close()


def test_add_remote_with_new_metadata_replaces_the_old_peer(peer) -> None:
    agent, kv = _agent("local", 1)
    new = PeerProcess("peer", num_blocks=32, seed=78, config=CONFIG, wait=False)
    try:
        agent.add_remote(peer.meta)
        peer.stop()
        h = agent.read("peer", [2, 3], [2, 3], timeout=120.0)
        new.ready()
        agent.add_remote(new.meta)  # no remove_remote first: the old peer is dropped all the same
        assert isinstance(h.error(), PeerLost)
        agent.read("peer", [2, 3], [2, 3]).wait(30.0)
        assert torch.equal(bits(kv[[2, 3]]), bits(new.call("blocks", [2, 3])))
        assert _clean(agent)["failures"] == {"PeerLost": 1}
    finally:
        peer.kill()
        new.close()
        agent.close()


def test_peer_lost_is_counted_in_failures(peer) -> None:
    agent, _ = _agent("local", 1)
    try:
        agent.add_remote(peer.meta)
        peer.stop()
        h = agent.read("peer", [1, 2], [1, 2], timeout=120.0)
        peer.kill()
        assert isinstance(_failure(h), PeerLost)
        m = _clean(agent)
        assert m["failures"] == {"PeerLost": 1} and m["failures_total"] == 1
        assert m["ops"]["read"]["failures"] == 1 and m["injected_failures_total"] == 0
        with pytest.raises(TransferError):
            agent.notify("peer", b"x").wait(30.0)
        assert agent.metrics()["ops"]["notify"]["failures"] == 1
    finally:
        agent.close()


def test_env_parsing() -> None:
    parse = FaultConfig.parse
    assert parse("fail=0.05,stall=0.01:2.0,seed=7") == FaultConfig(0.05, 0.01, 2.0, 0, 7)
    assert parse(" drop=100 , fail_fraction=1 ,") == FaultConfig(fail_fraction=1.0, drop_peer_after=100)
    assert parse("stall_fraction=0.5,stall_s=3") == FaultConfig(stall_fraction=0.5, stall_s=3.0)
    assert FaultConfig.from_env({}) is None and FaultConfig.from_env({FAULTS_ENV_VAR: " "}) is None
    assert FaultConfig.from_env({FAULTS_ENV_VAR: "seed=3"}) == FaultConfig(seed=3)
    for text, words in [
        ("fail=abc", ["PDSERVE_KV_FAULTS", "'fail'", "a number", "'abc'"]),
        ("fail=1.5", ["PDSERVE_KV_FAULTS", "FaultConfig.fail_fraction", "[0, 1]"]),
        ("stall=0.5", ["PDSERVE_KV_FAULTS", "'stall'", "FRACTION:SECONDS"]),
        ("stall=0.5:-1", ["PDSERVE_KV_FAULTS", "FaultConfig.stall_s"]),
        ("stall=0.5:inf", ["PDSERVE_KV_FAULTS", "FaultConfig.stall_s"]),
        ("drop=2.5", ["PDSERVE_KV_FAULTS", "'drop'", "an integer"]),
        ("drop=-1", ["PDSERVE_KV_FAULTS", "FaultConfig.drop_peer_after"]),
        ("fial=0.1", ["PDSERVE_KV_FAULTS", "unknown field 'fial'"]),
        ("fail", ["PDSERVE_KV_FAULTS", "key=value"]),
    ]:
        with pytest.raises(ValueError) as e:
            parse(text)
        assert all(w in str(e.value) for w in words), (text, str(e.value))


def test_config_validation_and_precedence(monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"FaultConfig.fail_fraction must be a number in \[0, 1\], got True"):
        FaultConfig(fail_fraction=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="FaultConfig.seed must be an integer"):
        FaultConfig(seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="FaultConfig has no field 'fail'"):
        AgentConfig(faults={"fail": 0.1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="AgentConfig.faults must be"):
        AgentConfig(faults="fail=0.1")  # type: ignore[arg-type]
    assert AgentConfig(faults={"stall_fraction": 0.2, "stall_s": 1}).faults == FaultConfig(0.0, 0.2, 1.0)
    monkeypatch.setenv(FAULTS_ENV_VAR, "fail=2")
    with pytest.raises(ValueError, match="PDSERVE_KV_FAULTS: FaultConfig.fail_fraction"):
        KVAgent("bad-env", AgentConfig(), address="127.0.0.1")
    with KVAgent("explicit", AgentConfig(faults=FaultConfig()), address="127.0.0.1") as a:
        assert a.faults == FaultConfig() and not a.faults.active  # an explicit config wins over the environment
    monkeypatch.setenv(FAULTS_ENV_VAR, "drop=4,seed=1")
    with KVAgent("from-env", address="127.0.0.1") as a:
        assert a.faults == FaultConfig(drop_peer_after=4, seed=1)
        with pytest.raises(ValueError, match="FaultConfig.stall_fraction"):
            a.set_faults({"stall_fraction": -0.1})
        assert a.faults == FaultConfig(drop_peer_after=4, seed=1)  # a refused config changes nothing
