"""KV transfer between TP groups without a network: head ranges, the pull planner for every pair of TP sizes,
group metadata, the per-head compatibility check, head-sliced gather/scatter and the strided same-host copy."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.kv_heads import KVHeadRange
from engine.kv_layout import KVCacheSpec
from kvtransfer.cache import RegisteredCache
from kvtransfer.errors import BadDescriptor, IncompatibleLayout
from kvtransfer.head_slices import copy_heads, paired_runs, plan_transfer, resolve_heads
from kvtransfer.metadata import PROTOCOL_VERSION, AgentMetadata, CacheInfo, check_compatible
from kvtransfer.tp_group import GroupMetadata, plan_pieces
from tests.kvtransfer_helpers import bits, random_cache

pytestmark = pytest.mark.timeout(60)

TP_SIZES = (1, 2, 4, 8)


def _spec(heads: int, model: str = "tp-test") -> KVCacheSpec:
    return KVCacheSpec(model, num_layers=3, num_kv_heads=heads, head_dim=8, block_size=4, dtype="bfloat16")


def _info(heads: KVHeadRange, blocks: int = 16, **change: object) -> CacheInfo:
    return CacheInfo(dataclasses.replace(_spec(heads.count), **change), blocks, "cpu", heads=heads)


def _meta(name: str, heads: KVHeadRange, **change: object) -> AgentMetadata:
    return AgentMetadata(name, "127.0.0.1", 1, "host/boot", 1, _info(heads, **change))


def test_head_range_for_rank_splits_or_replicates() -> None:
    assert [KVHeadRange.for_rank(8, 4, r).as_tuple() for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [KVHeadRange.for_rank(2, 8, r).as_tuple() for r in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4
    assert KVHeadRange.for_rank(8, 1, 0) == KVHeadRange.full(8)
    with pytest.raises(ValueError, match="neither split over nor replicated"):
        KVHeadRange.for_rank(6, 4, 0)
    with pytest.raises(ValueError, match="not a rank"):
        KVHeadRange.for_rank(8, 2, 2)
    with pytest.raises(ValueError, match="inside"):
        KVHeadRange(2, 2, 8)
    assert KVHeadRange(2, 6, 8).local(3, 5) == (1, 3)
    with pytest.raises(ValueError, match="not inside"):
        KVHeadRange(2, 6, 8).local(1, 3)


@pytest.mark.parametrize("total", [8, 2])
@pytest.mark.parametrize("a", TP_SIZES)
@pytest.mark.parametrize("b", TP_SIZES)
def test_planner_covers_each_decode_rank_heads_exactly_once(total: int, a: int, b: int) -> None:
    prefill = [KVHeadRange.for_rank(total, a, r).as_tuple() for r in range(a)]
    used: dict[int, int] = {}
    for d in range(b):
        want = KVHeadRange.for_rank(total, b, d)
        pieces = plan_pieces(want.as_tuple(), prefill, spread=d)
        covered = [h for p in pieces for h in range(p.start, p.stop)]
        assert covered == list(range(want.start, want.stop))  # every owned head once, in order
        for p in pieces:
            s, e = prefill[p.rank]
            assert s <= p.start < p.stop <= e  # the piece is held by the rank it is pulled from
            used[p.rank] = used.get(p.rank, 0) + 1
        # a rank appears at most once per puller: consecutive heads of one rank are one read
        assert len({p.rank for p in pieces}) == len(pieces)
        # as few reads as possible: one per prefill rank whose range meets ours (one for replicated heads)
        meets = {r for r, (s, e) in enumerate(prefill) if s < want.stop and want.start < e}
        distinct = {prefill[r] for r in meets}
        assert len(pieces) == len(distinct)
    # the reads are spread evenly over the prefill ranks (replicated heads come from different holders)
    assert max(used.values()) == -(-sum(used.values()) // a)


def test_planner_refuses_a_head_nobody_holds() -> None:
    with pytest.raises(ValueError, match="KV head 3"):
        plan_pieces((2, 4), [(0, 2), (2, 3)])


def test_metadata_round_trip_and_default_range() -> None:
    m = _meta("p0", KVHeadRange(2, 4, 8))
    assert AgentMetadata.from_bytes(m.to_bytes()) == m
    no_tp = CacheInfo(_spec(8), 4, "cpu")
    assert no_tp.head_range == KVHeadRange.full(8)
    with pytest.raises(IncompatibleLayout, match="cannot hold the head range"):
        CacheInfo(_spec(4), 4, "cpu", heads=KVHeadRange(0, 2, 8))


def test_compatibility_compares_per_head_shape_and_names_both_sides() -> None:
    ours = _info(KVHeadRange(0, 4, 8))
    check_compatible(ours, _meta("p1", KVHeadRange(0, 2, 8)), "d0")  # another head count is fine
    check_compatible(ours, _meta("p1", KVHeadRange(4, 8, 8)), "d0")
    for change, field in [({"head_dim": 16}, "head_dim"), ({"dtype": "float16"}, "dtype"),
                          ({"block_size": 8}, "block_size"), ({"model_id": "other"}, "model_id"),
                          ({"num_layers": 4}, "num_layers")]:
        with pytest.raises(IncompatibleLayout) as e:
            check_compatible(ours, _meta("p1", KVHeadRange(0, 2, 8), **change), "d0")
        msg = str(e.value)
        assert "'d0'" in msg and "'p1'" in msg and field in msg, msg
    with pytest.raises(IncompatibleLayout, match=r"'d0'.*'p1'.*total KV heads: 8 != 4"):
        check_compatible(ours, _meta("p1", KVHeadRange(0, 2, 4)), "d0")
    with pytest.raises(IncompatibleLayout, match="protocol"):
        check_compatible(ours, dataclasses.replace(_meta("p1", KVHeadRange(0, 2, 8)),
                                                   protocol_version=PROTOCOL_VERSION - 1), "d0")


def test_group_metadata_validates_and_plans() -> None:
    ranks = tuple(_meta(f"p{r}", KVHeadRange.for_rank(8, 4, r)) for r in range(4))
    group = GroupMetadata("prefill-0", ranks)
    assert GroupMetadata.from_bytes(group.to_bytes()) == group
    pieces = group.pieces_for(KVHeadRange.for_rank(8, 2, 1))
    assert [(m.name, h) for m, h in pieces] == [("p2", (4, 6)), ("p3", (6, 8))]
    with pytest.raises(IncompatibleLayout, match=r"hold no KV heads \[6, 7\]"):
        GroupMetadata("half", ranks[:3])
    with pytest.raises(IncompatibleLayout, match="head_dim"):
        GroupMetadata("mixed", (ranks[0], _meta("x", KVHeadRange(2, 8, 8), head_dim=16)))
    with pytest.raises(IncompatibleLayout, match="total KV heads"):
        group.pieces_for(KVHeadRange(0, 1, 2))
    with pytest.raises(IncompatibleLayout, match="unreadable"):
        GroupMetadata.from_bytes(b'{"name": "x"}')


def test_resolve_heads() -> None:
    d, p = _info(KVHeadRange(0, 4, 8)), _info(KVHeadRange(0, 8, 8))
    assert resolve_heads("read", (0, 4), d, p, "p") == (0, 4)
    assert resolve_heads("read", None, d, _info(KVHeadRange(0, 4, 8)), "p") is None  # same ranges: unsliced
    assert resolve_heads("read", (0, 4), d, _info(KVHeadRange(0, 4, 8)), "p") is None
    with pytest.raises(BadDescriptor, match="name the heads"):
        resolve_heads("read", None, d, p, "p")
    with pytest.raises(BadDescriptor, match=r"not all held by this cache"):
        resolve_heads("read", (2, 6), d, p, "p")
    with pytest.raises(BadDescriptor, match=r"not all held by 'p'"):
        resolve_heads("read", (0, 2), d, _info(KVHeadRange(4, 8, 8)), "p")
    with pytest.raises(BadDescriptor, match="only reads"):
        resolve_heads("write", (0, 4), d, p, "p")
    with pytest.raises(BadDescriptor, match="pair"):
        resolve_heads("read", "x", d, p, "p")  # type: ignore[arg-type]
    # chunking counts only the moved heads' bytes
    spec = d.spec
    chunks = plan_transfer("read", [0, 1, 2], [5, 6, 7], None, (1, 3), d, p, "p", 2 * spec.block_bytes // 2)
    assert [c.local_ids for c in chunks] == [(0, 1), (2,)]
    assert sum(c.nbytes(spec) for c in chunks) == 3 * spec.block_bytes // 2


def test_head_sliced_gather_scatter_round_trip() -> None:
    src_spec, dst_spec = _spec(8), _spec(2)
    src = RegisteredCache(random_cache(src_spec, 10, seed=1), src_spec)
    dst_kv = random_cache(dst_spec, 10, seed=2)
    before = dst_kv.clone()
    dst = RegisteredCache(dst_kv, dst_spec, KVHeadRange(4, 6, 8))
    assert dst.slots((4, 6)) is None and dst.slots((5, 6)) == (1, 2) and src.slots((4, 6)) == (4, 6)
    ids_s, ids_d, layers = [7, 2, 9], [0, 8, 5], (1, 3)
    nbytes = 3 * 2 * dst_spec.layer_bytes // 2  # one head of two
    buf = torch.empty(nbytes, dtype=torch.uint8)
    src.gather(ids_s, layers, buf, src.slots((5, 6)))
    dst.scatter(ids_d, layers, buf, dst.slots((5, 6)))
    assert torch.equal(bits(dst_kv[ids_d, 1:3, :, :, 1:2]), bits(src.kv[ids_s, 1:3, :, :, 5:6]))
    untouched = torch.ones_like(bits(dst_kv), dtype=torch.bool)
    untouched[ids_d, 1:3, :, :, 1:2] = False
    assert torch.equal(bits(dst_kv)[untouched], bits(before)[untouched])


def test_copy_heads_strided_by_paired_runs() -> None:
    assert paired_runs([3, 4, 5, 9], [0, 1, 7, 8]) == [(3, 0, 2), (5, 7, 1), (9, 8, 1)]
    src = random_cache(_spec(4), 12, seed=3)
    dst = random_cache(_spec(8), 12, seed=4)
    before = dst.clone()
    src_ids, dst_ids = [3, 4, 5, 9], [0, 1, 7, 8]
    copy_heads(src, src_ids, (0, 4), dst, dst_ids, (4, 8), (0, 2))
    assert torch.equal(bits(dst[dst_ids, 0:2, :, :, 4:8]), bits(src[src_ids, 0:2]))
    untouched = torch.ones_like(bits(dst), dtype=torch.bool)
    untouched[dst_ids, 0:2, :, :, 4:8] = False
    assert torch.equal(bits(dst)[untouched], bits(before)[untouched])
