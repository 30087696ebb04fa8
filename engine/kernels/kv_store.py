"""Writing new tokens' K and V into one layer of the paged KV cache, by slot (the Triton twin of
engine.torch_attention.write_kv, which engine.attention.store_kv calls without kernels).

A slot is `block_id * block_size + offset`; a negative slot marks a padding token (CUDA-graph padding) whose K/V
are not stored. The layer view kv_layer[NB, 2, bs, KVH, D] is a strided slice of the block-major 6-D cache
(engine.kv_layout), so every stride is taken from the tensor, never assumed.

An fp8 cache (float8_e4m3fn, engine.kv_quant) stores k / k_scale and v / v_scale, clamped to +-448 and rounded to
nearest even, as engine.kv_quant.quantize does (`to_cache`, shared with the fused RoPE stores; engine.kernels.e4m3).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import check
from engine.kernels.e4m3 import to_e4m3
from engine.kernels.pdl import dependents_may_start, pdl_args, wait_for_inputs

KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the activations' (k and v)
CACHE_DTYPES = (*KV_DTYPES, torch.float8_e4m3fn)  # a cache's: the activations' or fp8
SLOT_DTYPES = (torch.int64, torch.int32)


@triton.jit
def to_cache(x, scale, CACHE_DTYPE: tl.constexpr):
    # x (any float) as the cache stores it: converted, or for an fp8 cache x / scale clamped to e4m3's range and
    # rounded to nearest even (torch's cast of the same float32 value: engine.kv_quant.quantize; engine.kernels.e4m3)
    if CACHE_DTYPE == tl.float8e4nv:
        return to_e4m3(x.to(tl.float32) / scale)
    else:
        return x.to(CACHE_DTYPE)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kv_ptr, slots_ptr, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    BS: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr, PDL_LATE: tl.constexpr = False,
):
    # Grid (T,): one program per token moves its whole [KVH, D] K row and V row (a few KiB: one tile, no loop).
    # A negative slot folds into the store mask (no branch); the block offset is computed in int64 because the
    # block stride spans all layers and block_id * stride overflows int32 on large caches.
    wait_for_inputs(PDL, PDL_LATE)
    dependents_may_start(PDL, PDL_LATE)  # one short pass: no loop to wait for
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
    tl.store(dst, to_cache(k, k_scale, kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, to_cache(v, v_scale, kv_ptr.dtype.element_ty), mask=mask)


def check_kv_args(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slots: torch.Tensor) -> None:
    """Validate (k [T, KVH, D], v [T, KVH, D], kv_layer [NB, 2, bs, KVH, D] in k's dtype or fp8, slots [T]);
    ValueError naming the argument. Shared with rope_and_store."""
    check("kv_layer", kv_layer, 5, CACHE_DTYPES, inner_contiguous=True)
    nb, two, bs, kvh, d = kv_layer.shape
    if two != 2:
        raise ValueError(f"kv_layer must be [NB, 2, bs, KVH, D], got shape {tuple(kv_layer.shape)}")
    act = KV_DTYPES if kv_layer.dtype == torch.float8_e4m3fn else (kv_layer.dtype,)
    check("k", k, 3, act, kv_layer.device, inner_contiguous=True)
    check("v", v, 3, (k.dtype,), kv_layer.device, inner_contiguous=True)
    if tuple(k.shape[1:]) != (kvh, d):
        raise ValueError(f"k must be [T, {kvh}, {d}] to match kv_layer, got shape {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    check("slots", slots, 1, SLOT_DTYPES, kv_layer.device)
    if slots.shape[0] != k.shape[0]:
        raise ValueError(f"slots must have {k.shape[0]} entries (one per token), got {slots.shape[0]}")


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slots: torch.Tensor, k_scale: float = 1.0,
             v_scale: float = 1.0) -> None:
    """kv_layer[slot // bs, 0, slot % bs] = k[t]; kv_layer[slot // bs, 1, slot % bs] = v[t] for every token t whose
    slot is >= 0 (an fp8 cache: k[t] / k_scale and v[t] / v_scale, quantized). k, v [T, KVH, D]; kv_layer
    [NB, 2, bs, KVH, D] (any strides, unit inner stride); slots [T] int64/int32. Slots must be < NB * bs (not
    checked: that would need a host sync)."""
    check_kv_args(k, v, kv_layer, slots)
    check_scales(k_scale, v_scale)
    t = k.shape[0]
    if t == 0:
        return
    _, _, bs, kvh, d = kv_layer.shape
    _store_kv_kernel[(t,)](
        k, v, kv_layer, slots, float(k_scale), float(v_scale),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        BS=bs, KVH=kvh, D=d,
        BLOCK_H=triton.next_power_of_2(kvh), BLOCK_D=triton.next_power_of_2(d),
        num_warps=4, **pdl_args(k.device, t),
    )


def check_scales(k_scale: float, v_scale: float) -> None:
    """ValueError unless both scales are positive finite numbers (an fp8 cache's, engine.kv_quant)."""
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
