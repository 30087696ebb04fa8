"""Paged attention in plain torch (CPU, and a correct but unfused path on CUDA).

The batch is a flat list of new tokens from several requests. For each request the keys are its whole context
(cached prefix plus the new tokens, all read back from the paged cache), the queries its new tokens, causal.
Requests with one new token (decode) are attended together in one padded batch; longer chunks one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionMetadata:
    """Where the step's tokens go in the cache and what each request attends to. Built by the model runner."""

    slot_blocks: torch.Tensor   # [T] block id of each new token
    slot_offsets: torch.Tensor  # [T] offset inside that block
    # chunks with more than one new token: (first token index in the batch, number of new tokens, context
    # length, block table [num_blocks_of_request])
    prefills: list[tuple[int, int, int, torch.Tensor]]
    decode_token_index: torch.Tensor   # [B] batch index of each single-token request
    decode_block_tables: torch.Tensor  # [B, max_blocks] padded with 0
    decode_context_lens: torch.Tensor  # [B]
    sliding_window: int | None


def paged_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D]; kv_layer [NB, 2, bs, KVH, D] already holding the new tokens' K/V -> output [T, H, D]."""
    out = torch.empty_like(q)
    for start, n, ctx, table in meta.prefills:
        k, v = _gather(kv_layer, table[None])  # [1, KVH, L, D]
        positions = torch.arange(ctx - n, ctx, device=q.device)
        mask = _mask(positions[:, None], torch.arange(k.shape[2], device=q.device)[None, :], meta.sliding_window)
        qi = q[start:start + n].transpose(0, 1)[None]  # [1, H, n, D]
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:start + n] = o[0].transpose(0, 1)
    if meta.decode_token_index.numel():
        k, v = _gather(kv_layer, meta.decode_block_tables)  # [B, KVH, L, D]
        last = (meta.decode_context_lens - 1)[:, None, None, None]  # query position of each request
        keys = torch.arange(k.shape[2], device=q.device)[None, None, None, :]
        mask = _mask(last, keys, meta.sliding_window)  # [B, 1, 1, L]
        qd = q[meta.decode_token_index][:, :, None, :]  # [B, H, 1, D]
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[meta.decode_token_index] = o[:, :, 0, :]
    return out


def _gather(kv_layer: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tables [B, nb] -> K, V [B, KVH, nb * bs, D]."""
    blocks = kv_layer[tables]  # [B, nb, 2, bs, KVH, D]
    b, nb, _, bs, kvh, d = blocks.shape
    k = blocks[:, :, 0].reshape(b, nb * bs, kvh, d).transpose(1, 2)
    v = blocks[:, :, 1].reshape(b, nb * bs, kvh, d).transpose(1, 2)
    return k, v


def _mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean mask, True where the query may attend: causal, and within the sliding window if any."""
    allowed = key_pos <= query_pos
    if window is not None:
        allowed = allowed & (key_pos > query_pos - window)
    return allowed
