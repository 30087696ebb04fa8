"""Argument checks shared by the two paged-attention wrappers (decode and prefill): one place states what q,
the cache layer view, the block tables, the sliding window and `out` must look like."""

from __future__ import annotations

import torch

from engine.kernels import check, interpreting

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8 = torch.float8_e4m3fn  # a cache may hold it whatever q's dtype (engine.kv_quant)


def check_paged_attention(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor, num_seqs: int,
                          sliding_window: int | None, out: torch.Tensor | None) -> torch.Tensor:
    """Raise ValueError naming the argument unless q [T, H, D], kv_layer [NB, 2, bs, KVH, D] (q's dtype or fp8),
    block_tables
    [num_seqs, max_blocks >= 1] int32 and out (like q) fit together; returns out, allocated if None."""
    check("q", q, 3, DTYPES, inner_contiguous=True)
    dev = q.device
    if dev.type != "cuda" and not interpreting():
        raise ValueError(f"q must be on a CUDA device (or run under TRITON_INTERPRET=1), got {dev}")
    check("kv_layer", kv_layer, 5, (q.dtype, FP8), dev, inner_contiguous=True)
    check("block_tables", block_tables, 2, (torch.int32,), dev, inner_contiguous=True)
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, two, _, num_kv_heads, kv_dim = kv_layer.shape
    if two != 2 or kv_dim != head_dim:
        raise ValueError(f"kv_layer must be [NB, 2, bs, KVH, {head_dim}], got shape {tuple(kv_layer.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"q has {num_heads} heads, not a multiple of kv_layer's {num_kv_heads} KV heads")
    if block_tables.shape[0] != num_seqs or block_tables.shape[1] < 1:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks >= 1], got shape {tuple(block_tables.shape)}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")
    if out is None:
        return torch.empty_like(q)
    check("out", out, 3, (q.dtype,), dev, inner_contiguous=True)
    if out.shape != q.shape:
        raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
    return out


def check_kv_scales(kv_layer: torch.Tensor, k_scale: float, v_scale: float) -> tuple[float, float]:
    """(k_scale, v_scale) to fold into the kernels: an fp8 cache's (ValueError unless positive and finite), (1, 1)
    for any other cache."""
    if kv_layer.dtype != FP8:
        return 1.0, 1.0
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(k_scale), float(v_scale)
