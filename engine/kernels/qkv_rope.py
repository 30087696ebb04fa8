"""The qkv projection of a small decode step with RoPE and the KV-cache store fused into it, as one Triton kernel.

Owns `qkv_rope_store`: for M <= skinny_gemm.MAX_M tokens, qkv = x @ W_qkv^T (+ bias), then the q and k heads
rotated in place exactly as engine.kernels.rope.rope_and_store does, and every token's k and v stored into its
cache slot. At batch 1 that is one launch instead of two, and the rotation costs nothing on the way out of the GEMV.
An FP8 projection (engine.model.fp8_linear) passes its e4m3 weight with its scales (w_scales [1, N] float32) and
either e4m3 activations with theirs (x_scales [M, 1]) or 16-bit ones (weight-only, as fp8_gemm.fp8_gemv): the GEMV
then sums the products in float32 and scales them, as engine.kernels.fp8_gemm does, before the rounding and the
rotation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import check, interpreting
from engine.kernels.kv_store import check_kv_args, check_scales, to_cache
from engine.kernels.pdl import pdl_args
from engine.kernels.rope import check_rope_args, rotate_halves, round_to
from engine.kernels.skinny_gemm import MAX_M, gemv_tile, launch_config


# Grid ((H + 2 KVH) * HALF,): program p owns output columns j and j + HALF of head p // HALF (j = p % HALF) of the
# [q heads | k heads | v heads] output, the two elements that rotate together, for all M rows. It computes them
# as skinny_gemm does (two weight rows, whole rows of K a tile), rounds them to the activation dtype like the
# projection's output, rotates them if they belong to q or k (the tables rounded to the dtype, each product and the
# sum rounded: rope.py's numerics), writes them to the qkv output, and stores k and v into the token's cache slot
# (a negative slot stores nothing). The position, table and slot loads do not depend on the GEMV: issued first,
# they wait behind the weight stream rather than after it. They are step inputs, which no kernel of the step
# writes, so under PDL they may be read before gemv_tile waits for the previous kernel (engine.kernels.pdl).
@triton.jit
def _qkv_rope_store_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, pos_ptr, cos_ptr, sin_ptr, kv_ptr, slots_ptr, k_scale, v_scale, xs_ptr, ws_ptr,
    M, K, stride_xm, stride_wn, stride_ym, stride_p, stride_cb, stride_ckv, stride_cs, stride_ch,
    H: tl.constexpr, KVH: tl.constexpr, HALF: tl.constexpr, BS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr, HAS_XS: tl.constexpr, PDL: tl.constexpr,
    PDL_LATE: tl.constexpr = False,
):
    DTYPE: tl.constexpr = y_ptr.dtype.element_ty
    head = tl.program_id(0) // HALF
    j = tl.program_id(0) % HALF
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    pos = tl.load(pos_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)  # [BLOCK_M]
    c1 = round_to(tl.load(cos_ptr + pos * stride_p + j), DTYPE)
    c2 = round_to(tl.load(cos_ptr + pos * stride_p + j + HALF), DTYPE)
    s1 = round_to(tl.load(sin_ptr + pos * stride_p + j), DTYPE)
    s2 = round_to(tl.load(sin_ptr + pos * stride_p + j + HALF), DTYPE)
    slot = tl.load(slots_ptr + offs_m, mask=m_mask, other=-1).to(tl.int64)

    pair = tl.arange(0, 2)
    cols = head * 2 * HALF + j + pair * HALF  # [2]: columns j and j + HALF of this head
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    acc = gemv_tile(x_ptr, w_rows, pair < 2, M, K, stride_xm, BLOCK_M, 2, BLOCK_K, PDL, PDL_LATE)  # [BLOCK_M, 2]
    if SCALED:  # an FP8 weight: W ~= w_q * w_scale (per output column); e4m3 x ~= x_q * x_scale (per row)
        acc = acc * tl.load(ws_ptr + cols)[None, :]
    if HAS_XS:
        acc = acc * tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    y = round_to(acc, DTYPE)
    x1 = tl.sum(tl.where(pair[None, :] == 0, y, 0.0), 1)  # [BLOCK_M]
    x2 = tl.sum(tl.where(pair[None, :] == 1, y, 0.0), 1)
    rotates = head < H + KVH  # q or k; v passes through
    r1, r2 = rotate_halves(x1, x2, c1, s1, c2, s2, DTYPE)
    o1 = tl.where(rotates, r1, x1)
    o2 = tl.where(rotates, r2, x2)
    out = y_ptr + offs_m * stride_ym + head * 2 * HALF + j
    tl.store(out, o1.to(DTYPE), mask=m_mask)
    tl.store(out + HALF, o2.to(DTYPE), mask=m_mask)

    kv_head = (head - H) % KVH
    dst = kv_ptr + (slot // BS) * stride_cb + ((head - H) // KVH) * stride_ckv + (slot % BS) * stride_cs \
        + kv_head * stride_ch + j
    # head >= H tested on a block: the interpreter mistypes (scalar mask) & (block mask)
    store = m_mask & (slot >= 0) & ((tl.zeros([BLOCK_M], tl.int32) + head) >= H)
    cache_scale = tl.where(head < H + KVH, k_scale, v_scale)  # an fp8 cache's (ignored by others)
    tl.store(dst, to_cache(o1.to(DTYPE), cache_scale, kv_ptr.dtype.element_ty), mask=store)
    tl.store(dst + HALF, to_cache(o2.to(DTYPE), cache_scale, kv_ptr.dtype.element_ty), mask=store)


def _launch(m: int, n: int, k: int, fp8: bool) -> tuple[int, int]:
    """(BLOCK_K, num_warps): skinny_gemm's, but for FP8 weights at one row 1,024-byte tiles of the pair's rows on 2
    warps (H200, `fp8_gemm_sweep.py --qkv-rope` at 851e631, now `fp8_gpu.py gemm-sweep --qkv-rope`: 0.0092 ms =
    1.57x the weight's floor, against 0.0110 ms = 1.87x with bf16's 4,096-wide tiles on 8 warps)."""
    if fp8 and m == 1 and not interpreting():
        return 1024, 2
    return launch_config(m, n, k)[1:]


def qkv_rope_store(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
                   num_kv_heads: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv_layer: torch.Tensor, slots: torch.Tensor, k_scale: float = 1.0,
                   v_scale: float = 1.0, x_scales: torch.Tensor | None = None,
                   w_scales: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                   launch: tuple[int, int] | None = None) -> torch.Tensor:
    """x [M, hidden] (M <= MAX_M) @ weight [(H + 2 KVH) D, hidden]^T (+ bias) -> qkv [M, (H + 2 KVH) D] with q and k
    rotated by cos/sin [P, D] (float32) at positions [M], and k, v stored into kv_layer [NB, 2, bs, KVH, D] at
    slots [M] (negative: not stored; an fp8 cache stores k / k_scale, v / v_scale). The same as skinny_linear then
    rope.rope_and_store on its q, k, v views. FP8: a float8_e4m3fn weight with w_scales [1, N], and x either
    float8_e4m3fn with x_scales [M, 1] or 16-bit without (weight-only) (scales float32, contiguous), the output in
    `out_dtype` (the model's dtype; 16-bit x's own by default). `launch` (BLOCK_K, num_warps) overrides
    skinny_gemm.launch_config's (benchmarks time several)."""
    check_scales(k_scale, v_scale)
    act_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    fp8 = torch.float8_e4m3fn
    scaled = weight.dtype == fp8
    check("x", x, 2, (*act_dtypes, fp8), inner_contiguous=True)
    check("weight", weight, 2, (fp8,) if scaled else (x.dtype,), x.device, inner_contiguous=True)
    m, hidden = x.shape
    if x.dtype != fp8 and out_dtype is None:
        out_dtype = x.dtype
    if scaled:
        if out_dtype not in act_dtypes or w_scales is None or (x.dtype == fp8) != (x_scales is not None):
            raise ValueError("an FP8 weight needs w_scales and an out_dtype among float32/bfloat16/float16, and "
                             "x_scales exactly when x is FP8")
        check("w_scales", w_scales, 2, (torch.float32,), x.device)
        if tuple(w_scales.shape) != (1, weight.shape[0]) or not w_scales.is_contiguous():
            raise ValueError(f"w_scales must be a contiguous [1, {weight.shape[0]}], got {tuple(w_scales.shape)}")
        if x_scales is not None:
            check("x_scales", x_scales, 2, (torch.float32,), x.device)
            if tuple(x_scales.shape) != (m, 1) or not x_scales.is_contiguous():
                raise ValueError(f"x_scales must be a contiguous [{m}, 1], got {tuple(x_scales.shape)}")
    elif x_scales is not None or w_scales is not None:
        raise ValueError("x_scales and w_scales go with an FP8 (float8_e4m3fn) weight only")
    elif out_dtype != x.dtype:
        raise ValueError(f"a 16-bit projection writes x's dtype ({x.dtype}), got out_dtype {out_dtype}")
    heads = num_heads + 2 * num_kv_heads
    if weight.shape[1] != hidden or weight.shape[0] % heads:
        raise ValueError(f"weight must be [(H + 2 KVH) x D, {hidden}] with H = {num_heads}, KVH = {num_kv_heads}, "
                         f"got {tuple(weight.shape)}")
    if not 0 <= m <= MAX_M:
        raise ValueError(f"x must have at most {MAX_M} rows, got {m}")
    if bias is not None:
        check("bias", bias, 1, (out_dtype,), x.device, inner_contiguous=True)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias must have {weight.shape[0]} entries, got {bias.shape[0]}")
    d = weight.shape[0] // heads
    out = torch.empty((m, heads * d), dtype=out_dtype, device=x.device)
    q, k, v = out.view(m, heads, d).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    check_rope_args(q, k, positions, cos, sin)
    check_kv_args(k, v, kv_layer, slots)
    if m == 0:
        return out
    block_k, num_warps = launch or _launch(m, heads * d, hidden, scaled)
    _qkv_rope_store_kernel[(heads * d // 2,)](
        x, weight, bias if bias is not None else weight, out, positions, cos, sin, kv_layer, slots,
        float(k_scale), float(v_scale), x_scales if x_scales is not None else out, w_scales if scaled else out,
        m, hidden, x.stride(0), weight.stride(0), out.stride(0), cos.stride(0),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        H=num_heads, KVH=num_kv_heads, HALF=d // 2, BS=kv_layer.shape[2], HAS_BIAS=bias is not None,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_K=block_k, SCALED=scaled, HAS_XS=x_scales is not None,
        num_warps=num_warps, **pdl_args(x.device, m),
    )
    return out
