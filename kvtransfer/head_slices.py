"""Head-sliced transfers: checking a read's head range against both caches, and the strided same-host copy.

A read may name a global KV head range [h0, h1) (`KVAgent.read(..., heads=...)`) that both caches hold; only
those heads move. Over UCX the serving side gathers just the slice (its cache's head slots h0 - its start ...)
into staging, one message carries exactly the slice's bytes, and the reader scatters it into its own slots:
the bytes on the wire are the bytes needed, at the price of one strided gather on the server whenever the
slice is not all of its heads (no zero-copy send from the cache then; see docs/kv_layout.md for the numbers).
Over cuda_ipc the reader copies straight from the mapped remote tensor with strided copies (`copy_heads`),
one per run of consecutive ids on both sides, with no staging and no temporary.
Writes move whole caches only (equal head ranges): the puller owns the heads it needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .descriptors import Chunk, plan
from .errors import BadDescriptor
from .metadata import CacheInfo

_ONLY_READS = "only reads move a part of a cache's heads (the receiver pulls the heads it holds)"


def resolve_heads(op: str, heads: tuple[int, int] | None, local: CacheInfo, remote: CacheInfo,
                  remote_name: str) -> tuple[int, int] | None:
    """The global head range a transfer moves, or None when it moves the whole of two caches holding the same
    heads (today's unsliced path). BadDescriptor for a range one side does not hold, or a write between
    caches holding different heads."""
    ours, theirs = local.head_range, remote.head_range
    if heads is None:
        if ours.as_tuple() == theirs.as_tuple():
            return None
        what = "name the heads to move (heads=(h0, h1))" if op == "read" else _ONLY_READS
        raise BadDescriptor(f"{op}: this cache holds KV heads [{ours.start}, {ours.stop}) and {remote_name!r} "
                            f"holds [{theirs.start}, {theirs.stop}): {what}")
    try:
        h0, h1 = (int(x) for x in heads)
    except (TypeError, ValueError) as e:
        raise BadDescriptor(f"heads must be a pair (h0, h1), got {heads!r}") from e
    for side, rng in (("this cache", ours), (repr(remote_name), theirs)):
        if not rng.holds(h0, h1):
            raise BadDescriptor(f"{op}: KV heads [{h0}, {h1}) are not all held by {side} "
                                f"([{rng.start}, {rng.stop}) of {rng.total})")
    if (h0, h1) == ours.as_tuple() == theirs.as_tuple():
        return None
    if op != "read":
        raise BadDescriptor(f"{op}: {_ONLY_READS}")
    return (h0, h1)


def plan_transfer(op: str, local_ids: Sequence[int], remote_ids: Sequence[int], layers: tuple[int, int] | None,
                  heads: tuple[int, int] | None, local: CacheInfo, remote: CacheInfo, remote_name: str,
                  max_chunk_bytes: int) -> list[Chunk]:
    """Validate a transfer (blocks, layers, heads) between `local` and `remote` and split it into chunks."""
    moved = resolve_heads(op, heads, local, remote, remote_name)
    return plan(local_ids, remote_ids, layers, local.spec, local.num_blocks, remote.num_blocks, max_chunk_bytes,
                moved)


def paired_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """[(src_first, dst_first, count)]: maximal runs where both sides' ids are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def copy_heads(src: torch.Tensor, src_ids: Sequence[int], src_slots: tuple[int, int], dst: torch.Tensor,
               dst_ids: Sequence[int], dst_slots: tuple[int, int], layers: tuple[int, int]) -> None:
    """dst[dst_ids, layers, :, :, dst_slots] <- src[src_ids, layers, :, :, src_slots] (pairwise ids), on the
    current stream: one strided copy per paired run of ids. Both tensors: [blocks, layers, 2, bs, heads, dim]."""
    (l0, l1), (s0, s1), (d0, d1) = layers, src_slots, dst_slots
    for s, d, n in paired_runs(src_ids, dst_ids):
        dst[d : d + n, l0:l1, :, :, d0:d1].copy_(src[s : s + n, l0:l1, :, :, s0:s1])
