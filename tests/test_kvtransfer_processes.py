"""Two and three agents in separate processes on loopback (real ucxx): bit-exact reads and writes of
scattered blocks, layer ranges, chunking, concurrency, notifications and layer-wise streaming."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from kvtransfer import AgentConfig, BadDescriptor, KVAgent, TransferState, wire
from kvtransfer.metadata import AgentMetadata
from kvtransfer.streaming import LayerStreamer
from tests.kvtransfer_helpers import SPEC, PeerProcess, bits, random_cache, wait_local

pytestmark = pytest.mark.timeout(120)

# small chunks (3 blocks) so that transfers split into several messages
CONFIG = {"max_chunk_bytes": 3 * SPEC.block_bytes, "ucx_chunk_bytes": 3 * SPEC.block_bytes,
          "staging_bytes": 64 * SPEC.block_bytes, "timeout_s": 30.0}


@pytest.fixture(scope="module")
def local() -> Iterator[tuple[KVAgent, torch.Tensor]]:
    agent = KVAgent("local", AgentConfig(**CONFIG), address="127.0.0.1")
    kv = random_cache(SPEC, 48, seed=1)
    agent.register_cache(kv, SPEC)
    yield agent, kv
    agent.close()


@pytest.fixture(scope="module")
def peers(local: tuple[KVAgent, torch.Tensor]) -> Iterator[tuple[PeerProcess, PeerProcess]]:
    agent, _ = local
    p1 = PeerProcess("p1", num_blocks=64, seed=2, config=CONFIG, wait=False)
    p2 = PeerProcess("p2", num_blocks=40, seed=3, config=CONFIG, wait=False)
    try:
        p1.ready(), p2.ready()
        for p in (p1, p2):
            assert agent.add_remote(p.meta) == p.name
            p.call("add_remote", agent.metadata().to_bytes())
        p1.call("add_remote", p2.meta)
        p2.call("add_remote", p1.meta)
        yield p1, p2
    finally:
        p1.close()
        p2.close()


def _no_leaks(agent: KVAgent, *peers: PeerProcess) -> None:
    assert wait_local(agent, lambda m: m["staging_in_use"] == 0)["staging_in_use"] == 0
    for p in peers:
        assert p.wait_for(lambda m: m["staging_in_use"] == 0, "staging")["staging_in_use"] == 0


def test_read_scattered_blocks_bit_exact(local, peers) -> None:
    agent, kv = local
    p1, _ = peers
    rng = random.Random(10)
    for n in (1, 7, 13):  # uneven counts, several chunks
        rids = rng.sample(range(64), n)
        lids = rng.sample(range(48), n)
        before = kv.clone()
        h = agent.read("p1", rids, lids)
        h.wait(30)
        assert h.poll() is TransferState.DONE
        assert torch.equal(bits(kv[lids]), bits(p1.call("blocks", rids)))
        others = [b for b in range(48) if b not in lids]
        assert torch.equal(bits(kv[others]), bits(before[others]))
    _no_leaks(agent, p1)


def test_write_scattered_blocks_then_notification(local, peers) -> None:
    agent, kv = local
    p1, _ = peers
    lids, rids = [40, 3, 17, 29, 8], [63, 0, 31, 12, 50]
    untouched = [b for b in range(64) if b not in rids][:10]
    before = p1.call("blocks", untouched)
    agent.write("p1", lids, rids, notify=b"req-7 ready").wait(30)
    assert torch.equal(bits(p1.call("blocks", rids)), bits(kv[lids]))
    assert torch.equal(bits(p1.call("blocks", untouched)), bits(before))
    assert p1.call("notifications", 10.0) == {"local": [b"req-7 ready"]}
    _no_leaks(agent, p1)


@pytest.mark.parametrize("layers", [(0, 1), (1, 3), (3, 4)])
def test_partial_layer_ranges(local, peers, layers: tuple[int, int]) -> None:
    agent, kv = local
    p1, _ = peers
    l0, l1 = layers
    rids, lids = [5, 6, 9, 22], [30, 2, 33, 11]
    before = kv[lids].clone()
    agent.read("p1", rids, lids, layers=layers).wait(30)
    remote = p1.call("blocks", rids)
    assert torch.equal(bits(kv[lids, l0:l1]), bits(remote[:, l0:l1]))
    keep = [i for i in range(SPEC.num_layers) if not l0 <= i < l1]
    assert torch.equal(bits(kv[lids][:, keep]), bits(before[:, keep]))
    # and the other direction: only those layers land in the peer's blocks
    w_rids = [40, 41, 42]
    prev = p1.call("blocks", w_rids)
    agent.write("p1", [1, 2, 3], w_rids, layers=layers).wait(30)
    now = p1.call("blocks", w_rids)
    assert torch.equal(bits(now[:, l0:l1]), bits(kv[[1, 2, 3], l0:l1]))
    assert torch.equal(bits(now[:, keep]), bits(prev[:, keep]))


def test_contiguous_runs_move_without_staging(local, peers) -> None:
    agent, kv = local
    p1, _ = peers
    agent.read("p1", list(range(10, 13)), list(range(20, 23))).wait(30)  # one chunk, both sides one run
    assert torch.equal(bits(kv[20:23]), bits(p1.call("blocks", [10, 11, 12])))
    agent.write("p1", list(range(0, 9)), list(range(50, 59))).wait(30)  # three chunks of runs
    assert torch.equal(bits(p1.call("blocks", list(range(50, 59)))), bits(kv[0:9]))


def test_many_concurrent_transfers_same_pair(local, peers) -> None:
    agent, kv = local
    p1, _ = peers
    rng = random.Random(11)
    targets = rng.sample(range(48), 40)
    jobs = []
    for i in range(20):  # 20 reads of 2 blocks each, all in flight at once, into disjoint targets
        lids = targets[2 * i : 2 * i + 2]
        rids = rng.sample(range(64), 2)
        jobs.append((agent.read("p1", rids, lids), lids, rids))
    for h, _, _ in jobs:
        h.wait(60)
    remote = dict(enumerate(p1.call("blocks", list(range(64)))))
    for _, lids, rids in jobs:
        for lb, rb in zip(lids, rids, strict=True):
            assert torch.equal(bits(kv[lb]), bits(remote[rb]))
    _no_leaks(agent, p1)


def test_three_agents_concurrently(local, peers) -> None:
    agent, kv = local
    p1, p2 = peers
    h1 = agent.read("p1", [1, 3, 5, 7, 9], [0, 1, 2, 3, 4])
    h2 = agent.read("p2", [2, 4, 6, 8], [10, 11, 12, 13])
    h3 = agent.write("p2", [20, 21, 22], [30, 31, 32])
    p1.call("write", "p2", [60, 61, 62, 63], [33, 34, 35, 36], None, None, None, 30.0)  # p1 -> p2 meanwhile
    for h in (h1, h2, h3):
        h.wait(60)
    assert torch.equal(bits(kv[0:5]), bits(p1.call("blocks", [1, 3, 5, 7, 9])))
    assert torch.equal(bits(kv[10:14]), bits(p2.call("blocks", [2, 4, 6, 8])))
    assert torch.equal(bits(p2.call("blocks", [30, 31, 32])), bits(kv[20:23]))
    assert torch.equal(bits(p2.call("blocks", [33, 34, 35, 36])), bits(p1.call("blocks", [60, 61, 62, 63])))
    _no_leaks(agent, p1, p2)


def test_peer_reads_from_us_and_metrics_count_it(local, peers) -> None:
    agent, kv = local
    p1, _ = peers
    served_before = agent.metrics()["ops"].get("serve_read", {}).get("bytes", 0)
    p1.call("read", "local", [45, 46, 0], [20, 21, 22], None, b"released", None, 30.0)
    assert torch.equal(bits(p1.call("blocks", [20, 21, 22])), bits(kv[[45, 46, 0]]))
    assert agent.wait_notifications(10.0)["p1"] == [b"released"]
    m = wait_local(agent, lambda m: m["ops"].get("serve_read", {}).get("bytes", 0) > served_before)
    assert m["ops"]["serve_read"]["bytes"] - served_before == 3 * SPEC.block_bytes


def test_layerwise_streaming(local, peers) -> None:
    agent, kv = local
    p1, _ = peers
    lids, rids = [7, 8, 30, 31, 12], [44, 45, 46, 2, 19]
    s = LayerStreamer(agent, "p1", lids, rids, SPEC.num_layers, notify=b"req-9 kv done")
    s.layers_done(1)  # as prefill finishes layers
    s.layers_done(3)
    s.finish()
    s.wait(60)
    assert torch.equal(bits(p1.call("blocks", rids)), bits(kv[lids]))
    assert p1.call("notifications", 10.0) == {"local": [b"req-9 kv done"]}
    with pytest.raises(ValueError):
        s.layers_done(2)


def _notify_all(agent: KVAgent, peer: PeerProcess, msgs: list[bytes]) -> list[bytes]:
    """Send every message to `peer` (none waited for before the next is sent); what it received from `agent`."""
    for h in [agent.notify(peer.name, m) for m in msgs]:
        h.wait(30.0)
    got: list[bytes] = []
    end = time.monotonic() + 30.0
    while len(got) < len(msgs) and time.monotonic() < end:
        got += peer.call("notifications", 5.0).get(agent.name, [])
    return got


def test_notifications_arrive_in_order_short_and_long(local, peers) -> None:
    agent, _ = local
    p1, _ = peers
    sizes = [8, 2 * wire.FRAME_BYTES, 1, 300_000, 0, wire.FRAME_BYTES, 64] * 3  # one frame, or frame + body
    msgs = [bytes([i]) * n + f"#{i}".encode() for i, n in enumerate(sizes)]
    assert _notify_all(agent, p1, msgs) == msgs
    with pytest.raises(BadDescriptor, match="MAX_NOTIFY_BYTES"):  # refused at once, counted as a notify failure
        agent.notify("p1", b"x" * (wire.MAX_NOTIFY_BYTES + 1))


def test_a_peer_without_a_notification_listener_is_notified_over_ucx(peers) -> None:
    p1, _ = peers
    meta = replace(AgentMetadata.from_bytes(p1.meta), notify_port=None)  # as if it did not listen for them
    other = KVAgent("other", AgentConfig(**CONFIG), address="127.0.0.1")
    try:
        other.add_remote(meta)
        p1.call("add_remote", other.metadata().to_bytes())
        msgs = [b"first", b"x" * (2 * wire.FRAME_BYTES), b"last"]
        assert _notify_all(other, p1, msgs) == msgs
        assert AgentMetadata.from_bytes(other.metadata().to_bytes()).notify_port == other.metadata().notify_port > 0
    finally:
        other.close()
