"""The paged KV-cache memory layout: the one contract between the engine and the transfer layer.

One engine owns one KV tensor, block-major:

    kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]     (index 0 = K, 1 = V)

so one block holds every layer's K and V for `block_size` tokens in one contiguous span of `block_bytes`.
Within a block, layer `l` starts at `l * layer_bytes` and spans `layer_bytes` (its K then its V).
Consequences the transfer layer relies on:
- a run of consecutive block ids is one contiguous region (the block manager hands out low ids first,
  so a fresh request's blocks are mostly one or a few runs);
- a layer range [l0, l1) of one block is one contiguous region of (l1 - l0) * layer_bytes;
- the byte offset of (block, layer) is block * block_bytes + layer * layer_bytes.
`docs/kv_layout.md` has the measurement that chose this over vLLM's per-layer tensors.

This module is torch-free so that metadata describing a cache can cross process boundaries cheaply.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

KV_LAYOUT_VERSION = 1

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}  # float8: kv_cache_dtype fp8


@dataclass(frozen=True)
class KVCacheSpec:
    """Everything two parties must agree on before moving KV blocks between their caches."""

    model_id: str  # fingerprint of the architecture and weights' shapes (engine.config.ModelConfig.fingerprint)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # "float32" | "bfloat16" | "float16" | "float8_e4m3fn" (engine.kv_quant)
    layout_version: int = KV_LAYOUT_VERSION
    kv_scales: str = ""  # float8: the fingerprint of the per-layer K/V scales (engine.kv_quant.KVScales.digest)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KVCacheSpec.dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if bool(self.kv_scales) != (self.dtype == "float8_e4m3fn"):
            raise ValueError(f"KVCacheSpec.kv_scales is set exactly for a float8 cache, got {self.kv_scales!r} "
                             f"with dtype {self.dtype!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be positive, got {getattr(self, name)}")

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's K and V in one block."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (all layers)."""
        return self.num_layers * self.layer_bytes

    def shape(self, num_blocks: int) -> tuple[int, int, int, int, int, int]:
        return (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> KVCacheSpec:
        return cls(**data)

    def incompatibility(self, other: KVCacheSpec) -> str | None:
        """None if blocks can move between caches of `self` and `other`, else the reason they cannot."""
        diffs = [
            f"{k}: {a!r} != {b!r}" for k, a, b in
            ((k, v, getattr(other, k)) for k, v in asdict(self).items()) if a != b
        ]
        return "; ".join(diffs) if diffs else None


def block_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """Split block ids (in transfer order) into maximal runs of consecutive ids: [(first_id, count), ...]."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs
