"""kvtransfer pieces without a network: descriptors, metadata, compatibility, staging pool, gather/scatter, the
framing of control messages."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time

import pytest
import torch

from engine.kv_layout import KVCacheSpec
from kvtransfer import wire
from kvtransfer.cache import RegisteredCache
from kvtransfer.descriptors import contiguous_start, plan
from kvtransfer.errors import BadDescriptor, IncompatibleLayout, TransferTimeout
from kvtransfer.metadata import PROTOCOL_VERSION, AgentMetadata, CacheInfo, check_compatible
from kvtransfer.staging import StagingPool
from tests.kvtransfer_helpers import SPEC, bits, random_cache

pytestmark = pytest.mark.timeout(60)


def _meta(spec: KVCacheSpec = SPEC, num_blocks: int = 8, version: int = PROTOCOL_VERSION) -> AgentMetadata:
    return AgentMetadata("peer", "127.0.0.1", 1234, "host/boot", 42, CacheInfo(spec, num_blocks, "cpu"),
                         protocol_version=version)


def test_plan_splits_into_chunks_and_keeps_pairs() -> None:
    per_block = SPEC.layer_bytes * 2  # layers (1, 3)
    chunks = plan([5, 1, 9, 3, 7], [0, 2, 4, 6, 8], (1, 3), SPEC, 10, 10, max_chunk_bytes=2 * per_block)
    assert [c.local_ids for c in chunks] == [(5, 1), (9, 3), (7,)]
    assert [c.remote_ids for c in chunks] == [(0, 2), (4, 6), (8,)]
    assert all(c.layers == (1, 3) for c in chunks)
    assert sum(c.nbytes(SPEC) for c in chunks) == 5 * per_block


@pytest.mark.parametrize(
    "local, remote, layers, why",
    [
        ([0, 1], [0], None, "local block ids but"),
        ([0, 10], [0, 1], None, "outside"),
        ([0, 1], [0, -1], None, "outside"),
        ([0, 0], [0, 1], None, "duplicates"),
        ([], [], None, "at least one block"),
        ([0], [0], (2, 2), "layer range"),
        ([0], [0], (0, 5), "layer range"),
        ([0], [0], "ab", "layers must be a pair"),
    ],
)
def test_plan_rejects_bad_descriptors(local: list, remote: list, layers: object, why: str) -> None:
    with pytest.raises(BadDescriptor, match=why):
        plan(local, remote, layers, SPEC, 10, 10, 1 << 20)  # type: ignore[arg-type]


def test_contiguous_start() -> None:
    full = (0, SPEC.num_layers)
    assert contiguous_start([4, 5, 6], full, SPEC) == 4
    assert contiguous_start([4, 6], full, SPEC) is None
    assert contiguous_start([4, 5], (1, 2), SPEC) is None  # a layer slice of two blocks is two regions
    assert contiguous_start([4], (1, 2), SPEC) == 4


def test_metadata_round_trip() -> None:
    m = _meta()
    m2 = AgentMetadata.from_bytes(m.to_bytes())
    assert m2 == m
    ipc = dataclasses.replace(m, cache=dataclasses.replace(m.cache, ipc_handle=b"\x00\xffhandle"))
    assert AgentMetadata.from_bytes(ipc.to_bytes()) == ipc
    with pytest.raises(IncompatibleLayout, match="unreadable"):
        AgentMetadata.from_bytes(b"{not json")


@pytest.mark.parametrize(
    "change",
    [{"model_id": "other"}, {"dtype": "float16"}, {"block_size": 8}, {"num_layers": 5},
     {"layout_version": 2}, {"head_dim": 32}],
)
def test_incompatible_layouts_are_refused(change: dict) -> None:
    local = CacheInfo(SPEC, 8, "cpu")
    with pytest.raises(IncompatibleLayout, match=next(iter(change))):
        check_compatible(local, _meta(dataclasses.replace(SPEC, **change)))
    check_compatible(local, _meta())  # the same layout passes


def test_other_protocol_version_is_refused() -> None:
    with pytest.raises(IncompatibleLayout, match="protocol"):
        check_compatible(CacheInfo(SPEC, 8, "cpu"), _meta(version=99))


def test_gather_scatter_round_trip_with_layer_ranges() -> None:
    kv = random_cache(SPEC, 12, seed=3)
    out = random_cache(SPEC, 12, seed=4)
    before = out.clone()
    src, dst = RegisteredCache(kv, SPEC), RegisteredCache(out, SPEC)
    ids_s, ids_d, layers = [7, 2, 9], [0, 11, 5], (1, 3)
    buf = torch.empty(3 * 2 * SPEC.layer_bytes, dtype=torch.uint8)
    src.gather(ids_s, layers, buf)
    dst.scatter(ids_d, layers, buf)
    assert torch.equal(bits(out[ids_d, 1:3]), bits(kv[ids_s, 1:3]))
    untouched = torch.ones(12, SPEC.num_layers, dtype=torch.bool)
    untouched[ids_d, 1:3] = False
    assert torch.equal(bits(out)[untouched], bits(before)[untouched])


def test_cache_rejects_wrong_shape_or_dtype() -> None:
    with pytest.raises(ValueError, match="dtype"):
        RegisteredCache(torch.zeros(SPEC.shape(2), dtype=torch.float32), SPEC)
    with pytest.raises(ValueError, match="shape"):
        RegisteredCache(torch.zeros(2, 3, 2, 4, 2, 16, dtype=torch.bfloat16), SPEC)


def test_staging_pool_bounds_waits_and_reuses() -> None:
    async def scenario() -> None:
        pool = StagingPool(1000, torch.device("cpu"))
        a = await pool.acquire(600, time.monotonic() + 1)
        with pytest.raises(TransferTimeout):
            await pool.acquire(600, time.monotonic() + 0.2)  # over capacity until `a` returns
        waiter = asyncio.ensure_future(pool.acquire(500, time.monotonic() + 5))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        buf_a = a.buf
        pool.release(a)
        b = await waiter
        assert b.buf is buf_a  # the cached buffer is reused
        assert pool.in_use == 1
        pool.quarantine(b)
        assert pool.in_use == 0 and pool.quarantined == 1
        with pytest.raises(BadDescriptor, match="capacity"):
            await pool.acquire(2000, time.monotonic() + 1)

    asyncio.run(scenario())


class _TaggedPipe:
    """Tagged messages as UCX delivers them: in order per tag, a shorter message lands whole in a larger buffer,
    a longer one fails (UCX: message truncated)."""

    def __init__(self) -> None:
        self.sent: dict[int, collections.deque[bytes]] = collections.defaultdict(collections.deque)

    async def send(self, buf: bytes, tag: int) -> None:
        self.sent[tag].append(bytes(buf))

    async def recv(self, buf: bytearray, tag: int) -> None:
        msg = self.sent[tag].popleft()
        if len(msg) > len(buf):
            raise RuntimeError("message truncated")
        buf[:len(msg)] = msg


@pytest.mark.parametrize("size", [0, 10, wire.FRAME_BYTES - 200, wire.FRAME_BYTES, 3 * wire.FRAME_BYTES])
def test_control_messages_are_one_frame_unless_long(size: int) -> None:
    async def scenario() -> None:
        pipe = _TaggedPipe()
        msgs = [{"op": "notify", "msg": "x" * size}, {"op": "notify", "msg": "short"}]
        for m in msgs:
            await wire.send_msg(pipe, m, wire.REQUEST_TAG)
        inline = len(wire.encode(msgs[0])) <= wire.FRAME_BYTES - 8
        assert len(pipe.sent[wire.REQUEST_TAG]) == (2 if inline else 3)
        buf = bytearray(wire.FRAME_BYTES)  # reused, as the server does: a long body leaves no trace in it
        assert [await wire.recv_msg(pipe, wire.REQUEST_TAG, buf) for _ in msgs] == msgs

    asyncio.run(scenario())


def test_control_message_limits() -> None:
    wire.check_notify(b"x" * wire.MAX_NOTIFY_BYTES)
    with pytest.raises(BadDescriptor, match=f"limit of {wire.MAX_NOTIFY_BYTES} bytes"):
        wire.check_notify(b"x" * (wire.MAX_NOTIFY_BYTES + 1))
    with pytest.raises(BadDescriptor, match=f"limit of {wire.MAX_BODY_BYTES} bytes"):
        wire.frame({"op": "notify", "msg": "x" * wire.MAX_BODY_BYTES})
    garbage = bytearray((wire.MAX_BODY_BYTES + 1).to_bytes(8, "little")) + bytearray(8)
    with pytest.raises(ValueError, match="over the limit"):  # not our protocol: the server drops the peer
        wire.body_length(garbage)
