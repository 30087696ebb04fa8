"""Paged attention in plain torch: the CPU path and the reference the Triton kernels are tested against.

For each prefill chunk the keys are its whole context (cached prefix plus the new tokens, read back from the
paged cache), causal. The decode rows are attended together in one padded batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.model.attention import AttentionMetadata


def write_kv(kv_layer: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """kv_layer [NB, 2, bs, KVH, D]; slots [T] (no padding); k, v [T, KVH, D]."""
    bs = kv_layer.shape[2]
    blocks, offsets = slots // bs, slots % bs
    kv_layer[blocks, 0, offsets] = k
    kv_layer[blocks, 1, offsets] = v


def paged_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D]; kv_layer [NB, 2, bs, KVH, D] already holding the new tokens' K/V -> output [T, H, D]."""
    out = torch.empty_like(q)
    bs, dev = kv_layer.shape[2], q.device
    start = meta.num_decode
    for i, (n, ctx) in enumerate(meta.prefill_lens):
        table = meta.prefill_block_tables[i, : -(-ctx // bs)].long()
        k, v = _gather(kv_layer, table[None])  # [1, KVH, ctx rounded up to blocks, D]
        positions = torch.arange(ctx - n, ctx, device=dev)
        mask = _mask(positions[:, None], torch.arange(k.shape[2], device=dev)[None, :], meta.sliding_window)
        qi = q[start:start + n].transpose(0, 1)[None]  # [1, H, n, D]
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:start + n] = o[0].transpose(0, 1)
        start += n
    nd = meta.num_decode
    if nd:
        k, v = _gather(kv_layer, meta.decode_block_tables.long())  # [B, KVH, L, D]
        last = (meta.decode_context_lens.long() - 1)[:, None, None, None]  # query position of each row
        keys = torch.arange(k.shape[2], device=dev)[None, None, None, :]
        mask = _mask(last, keys, meta.sliding_window)  # [B, 1, 1, L]
        o = F.scaled_dot_product_attention(q[:nd, :, None, :], k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[:nd] = o[:, :, 0, :]
    return out


def _gather(kv_layer: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tables [B, nb] -> K, V [B, KVH, nb * bs, D] (views of one gathered copy each: gathering K and V apart
    yields contiguous [B, nb, bs, KVH, D] tensors whose token axes merge for free; gathering whole blocks and
    slicing K and V out of them cost a second copy, a third of a CPU decode step on `tiny`). index_select, not
    advanced indexing: on these strided views it copied the same bytes in about half the time (CPU, `tiny`)."""
    b, nb = tables.shape
    _, _, bs, kvh, d = kv_layer.shape
    flat = tables.reshape(-1)
    k = kv_layer[:, 0].index_select(0, flat).view(b, nb * bs, kvh, d).transpose(1, 2)
    v = kv_layer[:, 1].index_select(0, flat).view(b, nb * bs, kvh, d).transpose(1, 2)
    return k, v


def _mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean mask, True where the query may attend: causal, and within the sliding window if any."""
    allowed = key_pos <= query_pos
    if window is not None:
        allowed = allowed & (key_pos > query_pos - window)
    return allowed
