"""Paged attention in plain torch: the CPU path and the reference the Triton kernels are tested against.

For each prefill chunk the keys are its whole context (cached prefix plus the new tokens, read back from the
paged cache), causal; where the model chose it (bfloat16 on a CPU with AMX), every chunk of a layer goes to the C
kernel of engine.cpu_kernels.prefill_attention in one call instead of a gather and SDPA each. The decode rows are
attended together in one padded batch, or, where the model chose it (the CPU's default), by the C kernel of
engine.cpu_kernels.paged_decode, which reads each key and value once. What depends only on the step (block indices,
masks) is built once per step (`plan`), not once per layer: on a small model on the CPU those few ops per layer were
a tenth of a decode step.

An fp8 cache (engine.kv_quant): write_kv quantizes; the SDPA paths dequantize the K and V they gather (only the
step's context, into the activations' dtype); the C decode kernel reads the fp8 bytes itself (a lookup table,
scales folded); the C prefill kernel (bfloat16 caches only) is not used, the chunks take the SDPA path.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from engine.cpu_kernels.paged_decode import check_tables, paged_decode_attention
from engine.cpu_kernels.prefill_attention import prefill_attention
from engine.kv_quant import dequantize, quantize
from engine.model.attention_metadata import AttentionMetadata, ChunkPlan, TorchAttentionPlan


def plan(meta: AttentionMetadata, kv: torch.Tensor, decode_kernel: bool = False,
         prefill_kernel: bool = False) -> TorchAttentionPlan:
    """Each prefill chunk's context blocks and causal mask, and the decode rows' blocks and mask (`kv`: the cache
    [NB, L, 2, bs, KVH, D] or one layer of it [NB, 2, bs, KVH, D]). `prefill_kernel`: the chunks go to the C kernel
    (not with a sliding window, which it does not apply)."""
    dev, num_blocks, block_size = meta.slots.device, kv.shape[0], kv.shape[-3]
    kernel = prefill_kernel and bool(meta.prefill_lens) and meta.sliding_window is None \
        and kv.dtype == torch.bfloat16  # the C kernel reads a bfloat16 cache only (not an fp8 one)
    chunks, rows, start = [], [], meta.num_decode  # ChunkPlans for SDPA, or the kernel's (start, n, ctx) rows
    for i, (n, ctx) in enumerate(meta.prefill_lens):
        nb = -(-ctx // block_size)
        if kernel:
            rows.append((start, n, ctx))
            blocks = meta.prefill_block_tables[i, :nb]
            if int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks:  # the kernel reads where they point
                raise ValueError(f"a prefill chunk's block table points outside the cache's {num_blocks} blocks")
        else:
            mask = None  # a whole prompt without a window: SDPA's own causal mask, cheaper and bitwise the same
            if ctx != n or meta.sliding_window is not None:
                positions = torch.arange(ctx - n, ctx, device=dev)
                keys = torch.arange(nb * block_size, device=dev)[None, :]
                mask = _mask(positions[:, None], keys, meta.sliding_window)
            chunks.append(ChunkPlan(start, n, meta.prefill_block_tables[i, :nb].long(), mask))
        start += n
    prefill_chunks = torch.tensor(rows, dtype=torch.int32) if kernel else None
    max_ctx = max(ctx for _, ctx in meta.prefill_lens) if kernel else 0
    blocks = mask = None
    if meta.num_decode and decode_kernel:
        check_tables(meta.decode_block_tables, meta.decode_context_lens, num_blocks, block_size)
    elif meta.num_decode:
        tables = meta.decode_block_tables
        blocks = tables.reshape(-1).long()
        last = (meta.decode_context_lens.long() - 1)[:, None, None, None]  # query position of each row
        keys = torch.arange(tables.shape[1] * block_size, device=dev)[None, None, None, :]
        mask = _mask(last, keys, meta.sliding_window)
    return TorchAttentionPlan(tuple(chunks), blocks, mask, decode_kernel, prefill_chunks, max_ctx)


def with_plan(meta: AttentionMetadata, kv_cache: torch.Tensor, decode_kernel: bool = False,
              prefill_kernel: bool = False) -> AttentionMetadata:
    """`meta` carrying its step's plan, so every layer's paged_attention reuses it. `decode_kernel`: the decode
    rows run engine.cpu_kernels.paged_decode, `prefill_kernel` the prefill chunks
    engine.cpu_kernels.prefill_attention (the caller checked that they load and take these tensors)."""
    return replace(meta, torch_plan=plan(meta, kv_cache, decode_kernel, prefill_kernel))


def write_kv(kv_layer: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: float = 1.0,
             v_scale: float = 1.0) -> None:
    """kv_layer [NB, 2, bs, KVH, D]; slots [T] (no padding); k, v [T, KVH, D]. An fp8 cache stores k / k_scale and
    v / v_scale (engine.kv_quant.quantize); other caches ignore the scales."""
    bs = kv_layer.shape[2]
    blocks, offsets = slots // bs, slots % bs
    if kv_layer.dtype == torch.float8_e4m3fn:
        k, v = quantize(k, k_scale), quantize(v, v_scale)
    kv_layer[blocks, 0, offsets] = k
    kv_layer[blocks, 1, offsets] = v


def paged_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """q [T, H, D]; kv_layer [NB, 2, bs, KVH, D] already holding the new tokens' K/V -> output [T, H, D]. An fp8
    cache holds K / k_scale and V / v_scale; other caches ignore the scales."""
    fp8 = kv_layer.dtype == torch.float8_e4m3fn
    step = meta.torch_plan if meta.torch_plan is not None else plan(meta, kv_layer)
    if step.prefill_chunks is not None:  # every chunk in one call, straight from the cache
        q = q.contiguous()  # (a no-op for the fused RoPE's q; a view of the projection's output otherwise)
        out = torch.empty_like(q)
        prefill_attention(q, kv_layer, step.prefill_chunks, meta.prefill_block_tables, step.prefill_max_ctx, scale,
                          out)
    else:
        out = torch.empty_like(q)
    for chunk in step.chunks:
        k, v = _gather(kv_layer, chunk.blocks, 1)  # [1, KVH, ctx rounded up to blocks, D]
        if fp8:
            k, v = dequantize(k, k_scale, q.dtype), dequantize(v, v_scale, q.dtype)
        qi = q[chunk.start:chunk.start + chunk.length].transpose(0, 1)[None]  # [1, H, n, D]
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scale,
                                           enable_gqa=True)  # causal from key 0: query j sees keys 0..j
        out[chunk.start:chunk.start + chunk.length] = o[0].transpose(0, 1)
    nd = meta.num_decode
    if nd and step.decode_kernel:  # written in place: out's first nd rows are contiguous
        paged_decode_attention(q[:nd], kv_layer, meta.decode_block_tables, meta.decode_context_lens, scale,
                               meta.sliding_window, checked=True, out=out[:nd], k_scale=k_scale, v_scale=v_scale)
    elif nd:
        k, v = _gather(kv_layer, step.decode_blocks, nd)  # [B, KVH, L, D]
        if fp8:
            k, v = dequantize(k, k_scale, q.dtype), dequantize(v, v_scale, q.dtype)
        o = F.scaled_dot_product_attention(q[:nd, :, None, :], k, v, attn_mask=step.decode_mask, scale=scale,
                                           enable_gqa=True)
        out[:nd] = o[:, :, 0, :]
    return out


def _gather(kv_layer: torch.Tensor, blocks: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [rows * nb] int64 -> K, V [rows, KVH, nb * bs, D] (views of one gathered copy each: gathering K
    and V apart yields contiguous [rows, nb, bs, KVH, D] tensors whose token axes merge for free; gathering whole
    blocks and slicing K and V out of them cost a second copy, a third of a CPU decode step on `tiny`).
    index_select, not advanced indexing: on these strided views it copied the same bytes in about half the time
    (CPU, `tiny`)."""
    _, _, bs, kvh, d = kv_layer.shape
    length = blocks.shape[0] // rows * bs
    k = kv_layer[:, 0].index_select(0, blocks).view(rows, length, kvh, d).transpose(1, 2)
    v = kv_layer[:, 1].index_select(0, blocks).view(rows, length, kvh, d).transpose(1, 2)
    return k, v


def _mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean mask, True where the query may attend: causal, and within the sliding window if any."""
    allowed = key_pos <= query_pos
    if window is not None:
        allowed = allowed & (key_pos > query_pos - window)
    return allowed
