"""KV cache tensor: allocation in the layout of engine.kv_layout, and the per-layer write of new K/V.

The engine owns exactly one tensor kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]; the
block manager decides which blocks hold what, the transfer layer moves whole blocks (or layer ranges of them).
"""

from __future__ import annotations

import torch

from engine.kv_layout import KVCacheSpec

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed cache [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]."""
    return torch.zeros(spec.shape(num_blocks), dtype=TORCH_DTYPES[spec.dtype], device=device)


def write_kv(kv_layer: torch.Tensor, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Store new tokens' K/V. kv_layer [NB, 2, bs, KVH, D] (one layer's view); slot_blocks, slot_offsets [T];
    k, v [T, KVH, D]."""
    kv_layer[slot_blocks, 0, slot_offsets] = k
    kv_layer[slot_blocks, 1, slot_offsets] = v
