"""Rotary position embeddings applied in place to q and k (the Triton twin of engine.rope.apply_rope), alone or
fused with storing the rotated k and v into the paged KV cache.

Rotate-half convention with the [P, D] float32 cos/sin tables of engine.rope.RotaryEmbedding (halves duplicated):
out = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[D/2:], x[:D/2]).
Numerics copy torch's: the tables are rounded to the activations' dtype, each product and the sum are rounded to
that dtype (torch computes each bf16/fp16 op in fp32 and rounds), so results equal engine.rope.apply_rope bit for
bit in bf16/fp16 (in fp32 rounding is the identity and only a fused multiply-add may differ in the last bit).
q and k may be strided views of a fused qkv projection output: only the last dimension must be unit-stride.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import check
from engine.kernels.kv_store import KV_DTYPES, check_kv_args, check_scales, to_cache
from engine.kernels.pdl import dependents_may_start, pdl_args, wait_for_inputs

POS_DTYPES = (torch.int64, torch.int32)


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    # x (fp32) rounded to the activations' dtype and back: reproduces torch's rounding after each bf16/fp16 op.
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def rotate_halves(x1, x2, c1, s1, c2, s2, DTYPE: tl.constexpr):
    # (x1 * cos - x2 * sin, x2 * cos + x1 * sin) of the two halves (fp32), each product and sum rounded like torch.
    # Shared with engine.kernels.qkv_rope.
    o1 = round_to(round_to(x1 * c1, DTYPE) - round_to(x2 * s1, DTYPE), DTYPE)
    o2 = round_to(round_to(x2 * c2, DTYPE) + round_to(x1 * s2, DTYPE), DTYPE)
    return o1, o2


@triton.jit
def _rotate_rows(x_ptr, stride_h, NH: tl.constexpr, c1, s1, c2, s2,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # Rotates the [NH, D] rows of one token in place; returns the rotated halves (for the cache store).
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < NH) & (d < HALF)
    p1 = x_ptr + h * stride_h + d
    x1 = tl.load(p1, mask=mask).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask).to(tl.float32)
    o1, o2 = rotate_halves(x1, x2, c1, s1, c2, s2, DTYPE)
    tl.store(p1, o1.to(DTYPE), mask=mask)
    tl.store(p1 + HALF, o2.to(DTYPE), mask=mask)
    return o1, o2


@triton.jit
def _load_tables(cos_ptr, sin_ptr, pos_ptr, t, stride_p, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 DTYPE: tl.constexpr):
    # cos/sin rows of token t's position, both halves, rounded to the activations' dtype: [1, BLOCK_HALF] each.
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    m = d < HALF
    row_c = cos_ptr + pos * stride_p + d
    row_s = sin_ptr + pos * stride_p + d
    c1 = round_to(tl.load(row_c, mask=m, other=0.0), DTYPE)
    c2 = round_to(tl.load(row_c + HALF, mask=m, other=0.0), DTYPE)
    s1 = round_to(tl.load(row_s, mask=m, other=0.0), DTYPE)
    s2 = round_to(tl.load(row_s + HALF, mask=m, other=0.0), DTYPE)
    return c1, s1, c2, s2


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_p,
    H: tl.constexpr, KVH: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr, BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr, PDL_LATE: tl.constexpr = False,
):
    # Grid (T,): one program per token rotates all its q heads and k heads (each a [heads, D/2] x 2 tile), so the
    # cos/sin row is loaded once per token and the whole step is one launch.
    wait_for_inputs(PDL, PDL_LATE)
    dependents_may_start(PDL, PDL_LATE)  # one short pass: no loop to wait for
    t = tl.program_id(0)
    c1, s1, c2, s2 = _load_tables(cos_ptr, sin_ptr, pos_ptr, t, stride_p, HALF, BLOCK_HALF,
                                  q_ptr.dtype.element_ty)
    _rotate_rows(q_ptr + t * stride_qt, stride_qh, H, c1, s1, c2, s2, HALF, BLOCK_H, BLOCK_HALF)
    _rotate_rows(k_ptr + t * stride_kt, stride_kh, KVH, c1, s1, c2, s2, HALF, BLOCK_KVH, BLOCK_HALF)


@triton.jit
def _rope_store_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, kv_ptr, slots_ptr, k_scale, v_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_p,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    BS: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr, BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr, PDL_LATE: tl.constexpr = False,
):
    # Grid (T,): as _rope_kernel, then the same program stores its rotated k (still in registers) and its v row
    # into the cache slot; a negative slot folds into the store mask. One launch per layer instead of two.
    wait_for_inputs(PDL, PDL_LATE)
    dependents_may_start(PDL, PDL_LATE)  # one short pass: no loop to wait for
    DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    CACHE: tl.constexpr = kv_ptr.dtype.element_ty  # DTYPE, or fp8 (stores k / k_scale, v / v_scale)
    t = tl.program_id(0)
    c1, s1, c2, s2 = _load_tables(cos_ptr, sin_ptr, pos_ptr, t, stride_p, HALF, BLOCK_HALF, DTYPE)
    _rotate_rows(q_ptr + t * stride_qt, stride_qh, H, c1, s1, c2, s2, HALF, BLOCK_H, BLOCK_HALF)
    k1, k2 = _rotate_rows(k_ptr + t * stride_kt, stride_kh, KVH, c1, s1, c2, s2, HALF, BLOCK_KVH, BLOCK_HALF)

    slot = tl.load(slots_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_KVH)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    # slot >= 0 tested on a block: the interpreter mistypes (scalar mask) & (block mask); the compiler folds it.
    mask = (h < KVH) & (d < HALF) & ((tl.zeros([BLOCK_KVH, 1], tl.int64) + slot) >= 0)
    dst = kv_ptr + (slot // BS) * stride_cb + (slot % BS) * stride_cs + h * stride_ch + d
    tl.store(dst, to_cache(k1.to(DTYPE), k_scale, CACHE), mask=mask)  # rounded to DTYPE first, as k itself is
    tl.store(dst + HALF, to_cache(k2.to(DTYPE), k_scale, CACHE), mask=mask)
    src_v = v_ptr + t * stride_vt + h * stride_vh + d
    tl.store(dst + stride_ckv, to_cache(tl.load(src_v, mask=mask), v_scale, CACHE), mask=mask)
    tl.store(dst + stride_ckv + HALF, to_cache(tl.load(src_v + HALF, mask=mask), v_scale, CACHE), mask=mask)


def check_rope_args(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> None:
    check("q", q, 3, KV_DTYPES, inner_contiguous=True)
    check("k", k, 3, (q.dtype,), q.device, inner_contiguous=True)
    t, _, d = q.shape
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"k must be [{t}, KVH, {d}] to match q {tuple(q.shape)}, got {tuple(k.shape)}")
    if d % 2:
        raise ValueError(f"q's head dim must be even for rotate-half RoPE, got {d}")
    check("positions", positions, 1, POS_DTYPES, q.device)
    if positions.shape[0] != t:
        raise ValueError(f"positions must have {t} entries (one per token), got {positions.shape[0]}")
    check("cos", cos, 2, (torch.float32,), q.device, inner_contiguous=True)
    check("sin", sin, 2, (torch.float32,), q.device, inner_contiguous=True)
    if cos.shape[1] != d:
        raise ValueError(f"cos must be [P, {d}] (q's head dim), got {tuple(cos.shape)}")
    if sin.shape != cos.shape or sin.stride() != cos.stride():
        raise ValueError(f"sin must have cos's shape {tuple(cos.shape)} and strides, got {tuple(sin.shape)} "
                         f"strides {sin.stride()}")


def apply_rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> None:
    """Rotate q [T, H, D] and k [T, KVH, D] in place by the table rows cos/sin [P, D] (float32) at positions [T]
    (int64/int32, each < P: not checked, that would need a host sync)."""
    check_rope_args(q, k, positions, cos, sin)
    t, h, d = q.shape
    if t == 0:
        return
    kvh = k.shape[1]
    _rope_kernel[(t,)](
        q, k, positions, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        H=h, KVH=kvh, HALF=d // 2,
        BLOCK_H=triton.next_power_of_2(h), BLOCK_KVH=triton.next_power_of_2(kvh),
        BLOCK_HALF=triton.next_power_of_2(d // 2),
        num_warps=4, **pdl_args(q.device, t),
    )


def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, kv_layer: torch.Tensor, slots: torch.Tensor, k_scale: float = 1.0,
                   v_scale: float = 1.0) -> None:
    """apply_rope_(q, k, positions, cos, sin) then store_kv(k, v, kv_layer, slots), in one kernel launch.
    q [T, H, D], k/v [T, KVH, D]; kv_layer [NB, 2, bs, KVH, D] (strided layer view); slots [T] int64/int32,
    negative = padding token (rotated in place like the others, but nothing stored). An fp8 cache stores
    k / k_scale and v / v_scale (engine.kernels.kv_store.to_cache)."""
    check_rope_args(q, k, positions, cos, sin)
    check_kv_args(k, v, kv_layer, slots)
    check_scales(k_scale, v_scale)
    t, h, d = q.shape
    if t == 0:
        return
    kvh, bs = k.shape[1], kv_layer.shape[2]
    _rope_store_kernel[(t,)](
        q, k, v, positions, cos, sin, kv_layer, slots, float(k_scale), float(v_scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        BS=bs, H=h, KVH=kvh, HALF=d // 2,
        BLOCK_H=triton.next_power_of_2(h), BLOCK_KVH=triton.next_power_of_2(kvh),
        BLOCK_HALF=triton.next_power_of_2(d // 2),
        num_warps=4, **pdl_args(q.device, t),
    )
