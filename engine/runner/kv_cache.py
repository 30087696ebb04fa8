"""KV cache tensor: allocation in the layout of engine.kv_layout (the model writes new K/V into it).

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

