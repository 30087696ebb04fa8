"""KV transfer between TP groups of different sizes over real UCX on loopback: a "P group" of agents whose caches
hold the head slices of one source cache, a "D group" of agents with random caches; each D rank pulls its heads
from the P ranks that hold them (`read_from_group`, one head-sliced read per piece, all in flight at once) and ends
bit-exact equal to its slice of the source. The agents of both groups live in this process (each on its own loop
thread and UCX listener); the failure tests put the serving rank in another process to stall or kill it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from engine.kv_heads import KVHeadRange
from engine.kv_layout import KVCacheSpec
from kvtransfer import (
    AgentConfig,
    AgentMetadata,
    BadDescriptor,
    GroupMetadata,
    KVAgent,
    PeerLost,
    TransferError,
    TransferTimeout,
    read_from_group,
)
from tests.kvtransfer_helpers import PeerProcess, bits, random_cache, wait_local

pytestmark = pytest.mark.timeout(180)

SOURCE = KVCacheSpec("kvtransfer-tp", num_layers=4, num_kv_heads=8, head_dim=8, block_size=4, dtype="bfloat16")
# small chunks (2 blocks of all heads) so that pieces split into several messages
CONFIG = {"max_chunk_bytes": 2 * SOURCE.block_bytes, "ucx_chunk_bytes": 2 * SOURCE.block_bytes,
          "staging_bytes": 64 * SOURCE.block_bytes, "timeout_s": 30.0}
REMOTE_IDS = [3, 4, 5, 9, 12, 13, 20]  # runs and a single
LOCAL_IDS = [0, 1, 2, 7, 16, 17, 11]


@contextmanager
def _group(prefix: str, tp: int, total: int, source: torch.Tensor | None, seed: int,
           num_blocks: int = 24) -> Iterator[list[tuple[KVAgent, torch.Tensor, KVHeadRange]]]:
    """tp agents; rank r's cache holds KVHeadRange.for_rank(total, tp, r): the slice of `source`, or random."""
    ranks: list[tuple[KVAgent, torch.Tensor, KVHeadRange]] = []
    try:
        for r in range(tp):
            heads = KVHeadRange.for_rank(total, tp, r)
            spec = dataclasses.replace(SOURCE, num_kv_heads=heads.count)
            kv = (source[..., heads.start:heads.stop, :].contiguous() if source is not None
                  else random_cache(spec, num_blocks, seed + r))
            agent = KVAgent(f"{prefix}{r}", AgentConfig(**CONFIG), address="127.0.0.1")
            ranks.append((agent, kv, heads))
            agent.register_cache(kv, spec, heads)
        yield ranks
    finally:
        for agent, _, _ in ranks:
            agent.close()


def _no_leaks(*agents: KVAgent) -> None:
    for a in agents:
        m = wait_local(a, lambda m: m["staging_in_use"] == 0)
        assert m["staging_in_use"] == 0 and m["staging_quarantined"] == 0, m


@pytest.mark.parametrize("a, b, total", [(1, 2, 8), (2, 1, 8), (2, 2, 8), (1, 4, 8), (4, 2, 8),
                                         (4, 2, 2), (1, 4, 2)])
def test_decode_ranks_pull_their_heads_bit_exact(a: int, b: int, total: int) -> None:
    source = random_cache(dataclasses.replace(SOURCE, num_kv_heads=total), 24, seed=100 + a * 10 + b)
    with _group("p", a, total, source, 0) as prefill, _group("d", b, total, None, 50) as decode:
        group = GroupMetadata("prefill-0", tuple(agent.metadata() for agent, _, _ in prefill))
        for d_agent, _, _ in decode:
            for p_agent, _, _ in prefill:
                d_agent.add_remote(p_agent.metadata())
        before = [kv.clone() for _, kv, _ in decode]
        # every D rank pulls at once; the first layers, then the rest (as when prefill streams them)
        for layers in ((0, 1), (1, 4)):
            handles = [h for d, (agent, _, _) in enumerate(decode)
                       for h in read_from_group(agent, group, REMOTE_IDS, LOCAL_IDS, layers=layers, spread=d)]
            for h in handles:
                h.wait(60.0)
        pulled = torch.zeros(24, dtype=torch.bool)
        pulled[LOCAL_IDS] = True
        for (agent, kv, heads), old in zip(decode, before, strict=True):
            want = source[REMOTE_IDS][..., heads.start:heads.stop, :]
            assert torch.equal(bits(kv[LOCAL_IDS]), bits(want)), agent.name
            assert torch.equal(bits(kv[~pulled]), bits(old[~pulled]))  # nothing else was written
            read = agent.metrics()["ops"]["read"]
            n_pieces = len(group.pieces_for(heads))
            assert read["count"] == 2 * n_pieces and read["failures"] == 0  # one read per piece and layer range
            # the reads moved only the rank's own heads: the bytes are exactly those heads of the blocks
            assert read["bytes"] == len(REMOTE_IDS) * SOURCE.block_bytes * heads.count // SOURCE.num_kv_heads
        _no_leaks(*(agent for agent, _, _ in prefill + decode))


def test_unsliced_read_between_different_head_ranges_is_refused() -> None:
    with _group("p", 1, 8, random_cache(SOURCE, 24, 1), 0) as prefill, _group("d", 2, 8, None, 5) as decode:
        d_agent, p_agent = decode[0][0], prefill[0][0]
        d_agent.add_remote(p_agent.metadata())
        with pytest.raises(BadDescriptor, match=r"name the heads"):
            d_agent.read("p0", [1], [1])
        with pytest.raises(BadDescriptor, match="only reads"):
            d_agent.write("p0", [1], [1])
        with pytest.raises(BadDescriptor, match="not all held by this cache"):
            d_agent.read("p0", [1], [1], heads=(2, 6))
        assert d_agent.metrics()["failures"]["BadDescriptor"] == 3


def test_incompatible_group_refused_naming_both_sides() -> None:
    other = dataclasses.replace(SOURCE, head_dim=16, num_kv_heads=4)
    d_agent = KVAgent("d0", AgentConfig(**CONFIG), address="127.0.0.1")
    p_agent = KVAgent("p0", AgentConfig(**CONFIG), address="127.0.0.1")
    try:
        d_agent.register_cache(random_cache(dataclasses.replace(SOURCE, num_kv_heads=4), 8, 1),
                               dataclasses.replace(SOURCE, num_kv_heads=4), KVHeadRange(0, 4, 8))
        p_agent.register_cache(random_cache(other, 8, 2), other, KVHeadRange(4, 8, 8))
        with pytest.raises(TransferError, match=r"'d0' \(.*\) and 'p0' \(.*\) are incompatible: head_dim: 8 != 16"):
            d_agent.add_remote(p_agent.metadata())
        # metadata that hides the difference gets past our check but not the peer's own (at the hello)
        lie = p_agent.metadata()
        assert lie.cache is not None
        lie = dataclasses.replace(lie, cache=dataclasses.replace(lie.cache, spec=dataclasses.replace(other,
                                                                                                    head_dim=8)))
        with pytest.raises(TransferError, match=r"'p0' \(.*\) and 'd0' \(.*\) are incompatible: head_dim: 16 != 8"):
            d_agent.add_remote(lie)
        assert d_agent.remotes() == {}
    finally:
        d_agent.close()
        p_agent.close()


def test_failed_sliced_reads_release_staging() -> None:
    """A refused, a fault-injected, a timed-out and a peer-killed sliced read: each fails with its error and no
    staging slot stays in use on either side. The reader holds all 8 heads and pulls 4 from a rank holding
    [0, 4): the received slice must go through a staging slot."""
    half = KVHeadRange(0, 4, 8)
    half_spec = dataclasses.replace(SOURCE, num_kv_heads=4)
    with _group("d", 1, 8, None, 9, num_blocks=32) as decode:
        agent, kv, _ = decode[0]
        peer = PeerProcess("p0", num_blocks=24, seed=7, config=CONFIG, spec=half_spec, heads=half)
        try:
            agent.add_remote(peer.meta)
            # the peer refuses heads it does not hold (its metadata claimed others); our slot comes back
            meta = AgentMetadata.from_bytes(peer.meta)
            assert meta.cache is not None
            agent.add_remote(dataclasses.replace(meta, cache=dataclasses.replace(meta.cache,
                                                                                 heads=KVHeadRange(4, 8, 8))))
            with pytest.raises(BadDescriptor, match="not inside"):
                agent.read("p0", [1, 3], [2, 5], heads=(4, 8)).wait(30.0)
            _no_leaks(agent)
            agent.add_remote(peer.meta)
            agent.set_faults({"fail_fraction": 1.0})
            with pytest.raises(TransferError, match="injected"):
                agent.read("p0", [1, 3], [2, 5], heads=(0, 4)).wait(30.0)
            agent.set_faults(None)
            assert agent.metrics()["injected_faults"]["fail"] == 1
            peer.stop()
            with pytest.raises(TransferTimeout):
                agent.read("p0", [1, 3, 5], [2, 5, 8], heads=(0, 4), timeout=1.5).wait(30.0)
            _no_leaks(agent)
            peer.cont()
            assert peer.wait_for(lambda m: m["staging_in_use"] == 0, "staging")["staging_in_use"] == 0
            agent.read("p0", [1, 3, 5], [2, 5, 8], heads=(0, 4)).wait(30.0)  # reconnects, bit-exact
            assert torch.equal(bits(kv[[2, 5, 8], :, :, :, 0:4]), bits(peer.call("blocks", [1, 3, 5])))
            peer.stop()
            h = agent.read("p0", [6, 7, 9], [20, 21, 30], heads=(0, 4), timeout=60.0)
            peer.kill()
            with pytest.raises(PeerLost):
                h.wait(30.0)
            _no_leaks(agent)
            m = agent.metrics()["failures"]
            assert m["BadDescriptor"] == 1 and m["TransferTimeout"] == 1 and m["PeerLost"] >= 1
        finally:
            peer.kill()


def test_a_piece_refused_at_its_start_raises_after_the_pieces_started_before_it_ended() -> None:
    """The decode rank holds all 8 heads and pulls [0, 4) from p0 and [4, 8) from p1, but only p0 was added: the
    second piece is refused (PeerLost) while the first, held back by an injected stall, is still in flight. The error
    must come only once that first piece has ended, so that the caller may free the blocks it was writing."""
    source = random_cache(SOURCE, 24, seed=3)
    with _group("p", 2, 8, source, 0) as prefill, _group("d", 1, 8, None, 60) as decode:
        agent, kv, _ = decode[0]
        group = GroupMetadata("prefill-0", tuple(a.metadata() for a, _, _ in prefill))
        agent.add_remote(prefill[0][0].metadata())
        agent.set_faults({"stall_fraction": 1.0, "stall_s": 0.5})
        with pytest.raises(PeerLost, match="no remote 'p1'"):
            read_from_group(agent, group, REMOTE_IDS, LOCAL_IDS)
        m = agent.metrics()
        assert m["in_flight"] == 0 and m["ops"]["read"]["count"] == 1  # the first piece ended, and it succeeded
        assert torch.equal(bits(kv[LOCAL_IDS][..., 0:4, :]), bits(source[REMOTE_IDS][..., 0:4, :]))
