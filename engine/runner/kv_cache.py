"""KV cache tensor: allocation in the layout of engine.kv_layout (the model writes new K/V into it).

The engine owns exactly one tensor kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]; the
block manager decides which blocks hold what, the transfer layer moves whole blocks (or layer ranges of them).
"""

from __future__ import annotations

import torch

from engine.engine_config import EngineConfig
from engine.kv_layout import KVCacheSpec
from engine.kv_quant import FP8_DTYPE, KVScales, cache_dtype
from engine.model.model_config import ModelConfig

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_TORCH_DTYPES = {**TORCH_DTYPES, FP8_DTYPE: torch.float8_e4m3fn}  # what a cache may store


def cache_spec(mc: ModelConfig, kv_heads: int, config: EngineConfig, scales: KVScales) -> KVCacheSpec:
    """The spec of a cache of `kv_heads` KV heads for `config` (dtype resolved): its dtype from kv_cache_dtype, and
    for fp8 the fingerprint of the K/V scales it was written with."""
    dtype = cache_dtype(config.kv_cache_dtype, config.dtype)
    return KVCacheSpec(mc.fingerprint, mc.num_layers, kv_heads, mc.head_dim, config.block_size, dtype,
                       kv_scales=scales.digest() if dtype == FP8_DTYPE else "")


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed cache [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]."""
    return torch.zeros(spec.shape(num_blocks), dtype=KV_TORCH_DTYPES[spec.dtype], device=device)

