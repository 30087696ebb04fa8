"""Turning "these block ids, these layers" into validated, message-sized pieces.

Torch-free. A transfer names blocks on both sides (same count, pairwise: local_ids[i] <-> remote_ids[i]), a layer
range [l0, l1) and optionally a global KV head range [h0, h1) (a head-sliced read between caches holding different
heads, see kvtransfer.head_slices). `plan()` validates that against both caches and splits it into chunks of at most
`max_chunk_bytes` each; every chunk moves as one message (or one copy), never one per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.kv_layout import KVCacheSpec, block_runs

from .errors import BadDescriptor


@dataclass(frozen=True)
class Chunk:
    """One message's worth of a transfer: pairwise block ids, the layer range and the global head range (None:
    all heads, both caches holding the same ones)."""

    local_ids: tuple[int, ...]
    remote_ids: tuple[int, ...]
    layers: tuple[int, int]
    heads: tuple[int, int] | None = None

    def nbytes(self, spec: KVCacheSpec) -> int:
        return region_bytes(len(self.local_ids), self.layers, spec, self.heads)


def region_bytes(n_blocks: int, layers: tuple[int, int], spec: KVCacheSpec,
                 heads: tuple[int, int] | None = None) -> int:
    """Bytes of `n_blocks` x `layers`, of the heads [h0, h1) only if `heads` is given (else of all the cache's)."""
    per_layer = spec.layer_bytes if heads is None else spec.layer_bytes // spec.num_kv_heads * (heads[1] - heads[0])
    return n_blocks * (layers[1] - layers[0]) * per_layer


def normalize_layers(layers: tuple[int, int] | None, num_layers: int) -> tuple[int, int]:
    """None -> all layers; else check 0 <= l0 < l1 <= num_layers."""
    if layers is None:
        return (0, num_layers)
    try:
        l0, l1 = (int(x) for x in layers)
    except (TypeError, ValueError) as e:
        raise BadDescriptor(f"layers must be a pair (l0, l1), got {layers!r}") from e
    if not 0 <= l0 < l1 <= num_layers:
        raise BadDescriptor(f"layer range [{l0}, {l1}) is not inside [0, {num_layers})")
    return (l0, l1)


def validate_ids(ids: Sequence[int], num_blocks: int, side: str) -> tuple[int, ...]:
    """Block ids must be ints in [0, num_blocks) without duplicates (a duplicate target is a race)."""
    try:
        out = tuple(int(b) for b in ids)
    except (TypeError, ValueError) as e:
        raise BadDescriptor(f"{side} block ids must be integers: {e}") from e
    bad = [b for b in out if not 0 <= b < num_blocks]
    if bad:
        raise BadDescriptor(f"{side} block ids {bad[:8]} are outside the cache's {num_blocks} blocks")
    if len(set(out)) != len(out):
        raise BadDescriptor(f"{side} block ids contain duplicates")
    return out


def plan(
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
    layers: tuple[int, int] | None,
    spec: KVCacheSpec,
    local_blocks: int,
    remote_blocks: int,
    max_chunk_bytes: int,
    heads: tuple[int, int] | None = None,
) -> list[Chunk]:
    """Validate a transfer and split it into chunks of at most `max_chunk_bytes` (at least one block); `heads`
    (already checked against both caches) goes into every chunk."""
    lids = validate_ids(local_ids, local_blocks, "local")
    rids = validate_ids(remote_ids, remote_blocks, "remote")
    if len(lids) != len(rids):
        raise BadDescriptor(f"{len(lids)} local block ids but {len(rids)} remote block ids")
    if not lids:
        raise BadDescriptor("a transfer needs at least one block")
    lr = normalize_layers(layers, spec.num_layers)
    per_block = region_bytes(1, lr, spec, heads)
    step = max(1, max_chunk_bytes // per_block)
    return [Chunk(lids[i : i + step], rids[i : i + step], lr, heads) for i in range(0, len(lids), step)]


def contiguous_start(ids: Sequence[int], layers: tuple[int, int], spec: KVCacheSpec) -> int | None:
    """The first block id if blocks `ids` x `layers` form one contiguous byte region of the cache, else None.

    True when the ids are one run of consecutive ids and either all layers move or only one block does.
    """
    runs = block_runs(list(ids))
    if len(runs) != 1:
        return None
    if layers == (0, spec.num_layers) or runs[0][1] == 1:
        return runs[0][0]
    return None
