"""Which global KV heads one cache holds: the tensor-parallel part of the KV layout contract.

A TP group of `tp` ranks splits a model's `total` KV heads: rank r's cache holds the global heads
[start, stop) in its `num_kv_heads = stop - start` head slots (in order), with the rest of the layout as in
`engine.kv_layout`. With at least as many heads as ranks (`total % tp == 0`) each rank holds `total / tp`
consecutive heads. With fewer heads than ranks (`tp % total == 0`) every head is replicated on `tp / total`
consecutive ranks and each rank holds one head (as vLLM does). An engine without TP holds [0, total).

Two caches can exchange heads when everything but the head count agrees (`transfer_incompatibility`):
the per-head shape (head_dim, dtype, block size, layers), the model fingerprint, the layout version and the
model's total KV heads. Torch-free, like `engine.kv_layout`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .kv_layout import KVCacheSpec


@dataclass(frozen=True)
class KVHeadRange:
    """The global KV heads [start, stop) of a model with `total` KV heads that one cache holds."""

    start: int
    stop: int
    total: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop <= self.total:
            raise ValueError(f"KV head range [{self.start}, {self.stop}) is not a non-empty range inside "
                             f"the model's {self.total} KV heads")

    @classmethod
    def full(cls, num_kv_heads: int) -> KVHeadRange:
        """All heads: the cache of an engine without tensor parallelism."""
        return cls(0, num_kv_heads, num_kv_heads)

    @classmethod
    def for_rank(cls, total: int, tp_size: int, rank: int) -> KVHeadRange:
        """The heads rank `rank` of a TP group of `tp_size` ranks holds (see the module docstring)."""
        if tp_size <= 0 or not 0 <= rank < tp_size:
            raise ValueError(f"rank {rank} is not a rank of a TP group of size {tp_size}")
        if total % tp_size == 0:
            per = total // tp_size
            return cls(rank * per, (rank + 1) * per, total)
        if tp_size % total == 0:
            head = rank // (tp_size // total)
            return cls(head, head + 1, total)
        raise ValueError(f"{total} KV heads can be neither split over nor replicated on {tp_size} ranks "
                         f"(one must divide the other)")

    @property
    def count(self) -> int:
        return self.stop - self.start

    def as_tuple(self) -> tuple[int, int]:
        return (self.start, self.stop)

    def holds(self, start: int, stop: int) -> bool:
        return self.start <= start < stop <= self.stop

    def local(self, start: int, stop: int) -> tuple[int, int]:
        """The head slots of global heads [start, stop) in this cache (which must hold them)."""
        if not self.holds(start, stop):
            raise ValueError(f"heads [{start}, {stop}) are not inside this cache's [{self.start}, {self.stop})")
        return (start - self.start, stop - self.start)

    def to_list(self) -> list[int]:
        return [self.start, self.stop, self.total]

    @classmethod
    def from_list(cls, data: list[int]) -> KVHeadRange:
        start, stop, total = (int(x) for x in data)
        return cls(start, stop, total)

    def check_spec(self, spec: KVCacheSpec) -> None:
        """A cache of `spec` holds exactly this range's heads, one per slot."""
        if spec.num_kv_heads != self.count:
            raise ValueError(f"a cache of {spec.num_kv_heads} KV heads cannot hold the head range "
                             f"[{self.start}, {self.stop}) ({self.count} heads)")


# the fields of KVCacheSpec that must agree for heads to move; num_kv_heads is the one that may differ
PER_HEAD_FIELDS = ("model_id", "num_layers", "head_dim", "block_size", "dtype", "layout_version", "kv_scales")
# what a differing field means in the serving config (the message names the setting to fix)
SETTING_HINTS = {"dtype": " (the KV cache dtype: the pools' kv_cache_dtype settings must agree)",
                 "kv_scales": " (the fp8 KV scales: both sides must load the same checkpoint's k_scale/v_scale)"}


def transfer_incompatibility(a: KVCacheSpec, a_heads: KVHeadRange, b: KVCacheSpec, b_heads: KVHeadRange) -> str | None:
    """None if heads can move between a cache (`a`, `a_heads`) and one (`b`, `b_heads`), else the differing
    fields, each as "field: a's value != b's value"."""
    da, db = asdict(a), asdict(b)
    diffs = [f"{k}: {da[k]!r} != {db[k]!r}{SETTING_HINTS.get(k, '')}" for k in PER_HEAD_FIELDS if da[k] != db[k]]
    if a_heads.total != b_heads.total:
        diffs.append(f"total KV heads: {a_heads.total} != {b_heads.total}")
    return "; ".join(diffs) if diffs else None
