"""Writing new tokens' K and V into one layer of the paged KV cache, by slot (the Triton twin of
engine.torch_attention.write_kv, which engine.attention.store_kv calls without kernels).

A slot is `block_id * block_size + offset`; a negative slot marks a padding token (CUDA-graph padding) whose K/V
are not stored. The layer view kv_layer[NB, 2, bs, KVH, D] is a strided slice of the block-major 6-D cache
(engine.kv_layout), so every stride is taken from the tensor, never assumed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import check

KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SLOT_DTYPES = (torch.int64, torch.int32)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kv_ptr, slots_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    BS: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Grid (T,): one program per token moves its whole [KVH, D] K row and V row (a few KiB: one tile, no loop).
    # A negative slot folds into the store mask (no branch); the block offset is computed in int64 because the
    # block stride spans all layers and block_id * stride overflows int32 on large caches.
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    block = slot // BS
    offset = slot % BS
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    # slot >= 0 tested on a block: the interpreter mistypes (scalar mask) & (block mask); the compiler folds it.
    mask = (h < KVH) & (d < D) & ((tl.zeros([BLOCK_H, 1], tl.int64) + slot) >= 0)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = kv_ptr + block * stride_cb + offset * stride_cs + h * stride_ch + d
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_ckv, v, mask=mask)


def check_kv_args(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slots: torch.Tensor) -> None:
    """Validate (k [T, KVH, D], v [T, KVH, D], kv_layer [NB, 2, bs, KVH, D], slots [T]); ValueError naming the
    argument. Shared with rope_and_store."""
    check("kv_layer", kv_layer, 5, KV_DTYPES, inner_contiguous=True)
    nb, two, bs, kvh, d = kv_layer.shape
    if two != 2:
        raise ValueError(f"kv_layer must be [NB, 2, bs, KVH, D], got shape {tuple(kv_layer.shape)}")
    check("k", k, 3, (kv_layer.dtype,), kv_layer.device, inner_contiguous=True)
    check("v", v, 3, (kv_layer.dtype,), kv_layer.device, inner_contiguous=True)
    if tuple(k.shape[1:]) != (kvh, d):
        raise ValueError(f"k must be [T, {kvh}, {d}] to match kv_layer, got shape {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    check("slots", slots, 1, SLOT_DTYPES, kv_layer.device)
    if slots.shape[0] != k.shape[0]:
        raise ValueError(f"slots must have {k.shape[0]} entries (one per token), got {slots.shape[0]}")


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slots: torch.Tensor) -> None:
    """kv_layer[slot // bs, 0, slot % bs] = k[t]; kv_layer[slot // bs, 1, slot % bs] = v[t] for every token t whose
    slot is >= 0. k, v [T, KVH, D]; kv_layer [NB, 2, bs, KVH, D] (any strides, unit inner stride); slots [T]
    int64/int32. Slots must be < NB * bs (not checked: that would need a host sync)."""
    check_kv_args(k, v, kv_layer, slots)
    t = k.shape[0]
    if t == 0:
        return
    _, _, bs, kvh, d = kv_layer.shape
    _store_kv_kernel[(t,)](
        k, v, kv_layer, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        BS=bs, KVH=kvh, D=d,
        BLOCK_H=triton.next_power_of_2(kvh), BLOCK_D=triton.next_power_of_2(d),
        num_warps=4,
    )
