"""Paged attention for one layer: attending over the cache (new K/V already stored), on either path.

A step's tokens are ordered decode first: the first `num_decode` tokens each continue one sequence; the rest are
prefill chunks (new prompt tokens, possibly after a cached prefix). With kernels (the GPU path) the Triton kernels
of engine.kernels run (flash-decoding for the decode rows, a paged flash-attention for the chunks); otherwise the
plain torch reference of engine.torch_attention, which stays exact against transformers. The model says which.
"""

from __future__ import annotations

import torch

from engine.model import torch_attention
from engine.model.attention_metadata import AttentionMetadata


def attend(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float,
           use_kernels: bool, out: torch.Tensor | None = None, k_scale: float = 1.0,
           v_scale: float = 1.0) -> torch.Tensor:
    """q [T, H, D]; kv_layer [NB, 2, bs, KVH, D] already holding the new tokens' K/V -> output [T, H, D] (into
    `out` where given: the kernel path only). `k_scale`, `v_scale`: an fp8 cache's (engine.kv_quant)."""
    if not use_kernels:
        return torch_attention.paged_attention(q, kv_layer, meta, scale, k_scale, v_scale)
    from engine.kernels.decode_attention import decode_attention
    from engine.kernels.prefill_attention import prefill_attention
    out = torch.empty_like(q) if out is None else out
    nd = meta.num_decode
    if nd:
        decode_attention(q[:nd], kv_layer, meta.decode_block_tables, meta.decode_context_lens, scale,
                         meta.sliding_window, out=out[:nd], semaphores=meta.decode_semaphores, k_scale=k_scale,
                         v_scale=v_scale)
    if meta.prefill_lens:
        prefill_attention(q[nd:], kv_layer, meta.prefill_block_tables, meta.prefill_query_start,
                          meta.prefill_context_lens, meta.max_query_len, scale, meta.sliding_window, out=out[nd:],
                          k_scale=k_scale, v_scale=v_scale)
    return out
