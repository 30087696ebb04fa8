"""y = (x_q @ w_q^T) * s_x * s_w (+ bias): an FP8 linear's matmul on e4m3 activations and weights, in Triton.

x_q [M, K] and w_q [N, K] are float8_e4m3fn (K contiguous), s_x [M, 1] the activations' per-row scales, s_w [1, N]
the weight's per-output-channel scales (a per-tensor one repeated), both float32; y [M, N] in the model's dtype.
Products are summed in float32 and scaled once at the end: the numbers torch._scaled_mm with row-wise scales gives.

Two kernels for the sizes a decode step has (engine.model.fp8_linear picks per M; torch._scaled_mm takes prefill):
- `fp8_gemv` (M of 1-2): engine.kernels.skinny_gemm's GEMV over the e4m3 weight, each weight row read once, at
  half a bfloat16 GEMV's bytes (e4m3 is one byte a value). Whole rows of K per tile, many small programs
  so every SM has its loads in flight; the products on the CUDA cores (a decode GEMV is bound by bytes, not FLOPs).
  It also takes 16-bit x with no scales ("weight-only": e4m3 weights upcast in registers, the activations as they
  are), which spares the step the launches that would quantize them (engine.model.fp8_linear uses it at M = 1).
- `fp8_mm` (M up to a few hundred): FP8 tensor cores with the operands swapped, y^T [N, M] = w_q [N, K] @ x_q^T
  [K, M], so the weight's rows fill the MMA's wide side and the few tokens its narrow one (>= 16 wide: a step of
  M < 16 pads its tokens with masked zeros). Each program owns BLOCK_N output channels for BLOCK_M tokens and
  walks K; the weight is read once per BLOCK_M tokens. Each BLOCK_K tile's MMA result is added to a float32
  accumulator outside the MMA ("promotion"): Hopper's FP8 MMAs keep about 14 bits while they accumulate (DeepSeek-V3's
  report), which over K = 4096 left 3.5e-3 of the largest output as error on an H200; torch._scaled_mm promotes too.
fp8_mm's main loop (`mm_accumulate`) and its split-K meeting (`meet_splits`, `split_k_args`) are shared with the
kernels that put more into its epilogue: engine.kernels.fp8_mm_rope (RoPE and the KV store) and fp8_mm_swiglu.
Launch parameters come from shapes alone (CUDA-graph safe), from the table `FP8_MM_CONFIGS` measured on an H200
(benchmarks/fp8_gpu.py gemm-sweep). Under TRITON_INTERPRET=1 (CPU CI) the dot upcasts its operands to float32: the
interpreter's tl.dot on narrow floats is not exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import check, interpreting
from engine.kernels.pdl import dependents_may_start, pdl_args, wait_for_inputs
from engine.kernels.skinny_gemm import gated_outputs, gemv_rows, gemv_store, gemv_tile

FP8 = torch.float8_e4m3fn
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GEMV_MAX_M = 16
MAX_SPLIT_K = 4


@triton.jit
def _fp8_gemv_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                     HAS_BIAS: tl.constexpr, HAS_XS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PDL: tl.constexpr, GATED: tl.constexpr = False,
                     PDL_LATE: tl.constexpr = False):
    # Grid (cdiv(N, BLOCK_N),), or (cdiv(2N, BLOCK_N),) GATED: engine.kernels.skinny_gemm's program over an e4m3
    # weight (upcast in registers) and e4m3 x with per-row scales, or 16-bit x (HAS_XS false: weight-only)
    offs_m = tl.arange(0, BLOCK_M)
    rows, n_mask, out_n, out_mask = gemv_rows(N, BLOCK_N, GATED)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    acc = gemv_tile(x_ptr, w_rows, n_mask, M, K, stride_xm, BLOCK_M, BLOCK_N, BLOCK_K, PDL,
                    PDL_LATE)  # [BLOCK_M, BLOCK_N]
    acc = acc * tl.load(ws_ptr + rows, mask=n_mask, other=0.0)[None, :]
    if HAS_XS:
        acc = acc * tl.load(xs_ptr + offs_m, mask=offs_m < M, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    gemv_store(acc, y_ptr, out_n, out_mask, M, stride_ym, BLOCK_M, BLOCK_N, GATED)


@triton.jit
def _fp8_mm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, y_ptr, part_ptr, sem_ptr, M, N, K, K_SPLIT, stride_xm,
                   stride_wn, stride_ym, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr,
                   W_TMA: tl.constexpr = False, PDL_LATE: tl.constexpr = False):
    # Grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), SPLIT_K): acc [BLOCK_N, BLOCK_M] = w tile [BLOCK_N, BLOCK_K] @ x^T
    # tile [BLOCK_K, BLOCK_M] over this split's K_SPLIT columns of K (a multiple of BLOCK_K). x^T's tile is
    # K-contiguous per token: the K-major B operand FP8 MMAs take. With SPLIT_K > 1 (an N too narrow to give every
    # SM a tile) each split writes its float32 sum to `part` and counts itself in on its tile's semaphore; the one
    # that arrives last adds the splits' sums, writes the tile and sets the semaphore back to 0 for the next call
    # (engine.kernels.decode_attention merges its splits the same way: no second launch).
    # W_TMA: w_ptr is a host tensor descriptor of the weight ([BLOCK_N, BLOCK_K] boxes) and its tiles come by the
    # Hopper tensor-memory accelerator (one bulk copy a tile, zero-filled past N and K) instead of per-thread loads.
    wait_for_inputs(PDL, PDL_LATE)
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    acc = mm_accumulate(x_ptr, w_ptr, offs_n, n_mask, offs_m, m_mask, K, K_SPLIT, stride_xm, stride_wn,
                        pid_n * BLOCK_N, BLOCK_N, BLOCK_M, BLOCK_K, DOT_F32, W_TMA)
    dependents_may_start(PDL, PDL_LATE)
    if SPLIT_K == 1:
        _mm_epilogue(acc, xs_ptr, ws_ptr, bias_ptr, y_ptr, offs_n, offs_m, n_mask, m_mask, stride_ym, HAS_BIAS)
    else:
        total, last = meet_splits(acc, part_ptr, sem_ptr, SPLIT_K, BLOCK_N, BLOCK_M)
        if last:
            _mm_epilogue(total, xs_ptr, ws_ptr, bias_ptr, y_ptr, offs_n, offs_m, n_mask, m_mask, stride_ym,
                         HAS_BIAS)


@triton.jit
def mm_accumulate(x_ptr, w_ptr, offs_n, n_mask, offs_m, m_mask, K, K_SPLIT, stride_xm, stride_wn, tma_row,
                  BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                  W_TMA: tl.constexpr):
    # acc [BLOCK_N, BLOCK_M] = the weight rows offs_n [BLOCK_N] times the tokens offs_m [BLOCK_M] over this split's
    # K_SPLIT columns of K (program_id(2)); W_TMA: tiles of the descriptor w_ptr from row tma_row (rows contiguous)
    offs_k = tl.arange(0, BLOCK_K)
    k_start = tl.program_id(2) * K_SPLIT
    k_end = tl.minimum(K, k_start + K_SPLIT)
    if not W_TMA:
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + (k_start + offs_k)[:, None]  # [BLOCK_K, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_mask = (k0 + offs_k) < k_end
        if W_TMA:  # a split's tiles end at its k_end (K_SPLIT is whole tiles), the last split's at K (zero-filled)
            w = w_ptr.load([tma_row, k0])
        else:
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_first")
            w_ptrs += BLOCK_K
        xt = tl.load(x_ptrs, mask=k_mask[:, None] & m_mask[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(w.to(tl.float32), xt.to(tl.float32))
        else:  # each tile's MMA sum added in float32: Hopper's FP8 MMAs accumulate with fewer bits (module doc)
            acc += tl.dot(w, xt)
        x_ptrs += BLOCK_K
    return acc


@triton.jit
def meet_splits(acc, part_ptr, sem_ptr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    # A split's sum acc [BLOCK_N, BLOCK_M] written to `part`, counted in on its tile's semaphore -> (the tile's sum
    # over every split, in split order so that it does not depend on who arrived last; whether this program is the
    # last to arrive, the one that holds it). The last sets the semaphore back to 0 for the next call.
    tiles = tl.num_programs(0) * tl.num_programs(1)
    tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    in_tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]  # [BLOCK_N, BLOCK_M]
    tl.store(part_ptr + (tl.program_id(2) * tiles + tile).to(tl.int64) * (BLOCK_N * BLOCK_M) + in_tile, acc)
    tl.debug_barrier()  # every thread's partial stores precede the release below
    last = tl.atomic_add(sem_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
    total = acc
    if last:
        total = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for split in range(SPLIT_K):
            total += tl.load(part_ptr + (split * tiles + tile).to(tl.int64) * (BLOCK_N * BLOCK_M) + in_tile,
                             cache_modifier=".cg")
        tl.atomic_xchg(sem_ptr + tile, 0, sem="relaxed", scope="gpu")
    return total, last


@triton.jit
def _mm_epilogue(acc, xs_ptr, ws_ptr, bias_ptr, y_ptr, offs_n, offs_m, n_mask, m_mask, stride_ym,
                 HAS_BIAS: tl.constexpr):
    # y^T tile [BLOCK_N, BLOCK_M] = acc scaled per output channel and per token (+ bias), stored transposed
    ws = tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)
    xs = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)
    acc = acc * ws[:, None] * xs[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=n_mask[:, None] & m_mask[None, :])


# (largest M, BLOCK_N, BLOCK_M, BLOCK_K, num_warps, num_stages) by the step's M, first row whose M bound holds.
# From benchmarks/fp8_gpu.py gemm-sweep on an H200 (docs/benchmark-log.md, 2026-12-02): 64 weight rows x 256 of K a
# tile on 4 warps was the best at every M from 2 to 64 for the 8B layer's narrower GEMMs; the token tile follows M
# so a small batch pads to 16, not 64. A weight wide enough for two tiles per SM (gate_up, N = 28,672) runs
# WIDE_CONFIG's 128 x 128 tiles on 8 warps instead once the token tile is WIDE_MIN_BLOCK_M or more: gate_up at M = 64
# 0.0345 ms against 0.0413, but at M = 16 0.0431 against 64 x 256's 0.0312 (H200, 2026-12-06).
FP8_MM_CONFIGS: tuple[tuple[int, int, int, int, int, int], ...] = (
    (16, 64, 16, 256, 4, 4),
    (32, 64, 32, 256, 4, 4),
    (1 << 30, 64, 64, 256, 4, 4),
)
WIDE_CONFIG = (128, 128, 8, 4)  # BLOCK_N, BLOCK_K, num_warps, num_stages; BLOCK_M as FP8_MM_CONFIGS'
WIDE_MIN_BLOCK_M = 32


def gemv_config(m: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of fp8_gemv: 4 weight rows of 2048 bytes a tile on 4 warps, the H200 sweep's
    best at M = 1 for every GEMM of an 8B layer (0.060 ms a layer against bfloat16's 0.106: 1.77x)."""
    if interpreting():
        return 16, 64, 4
    return 4, min(triton.next_power_of_2(k), 2048), 4


def mm_config(m: int, n: int, k: int, sms: int, wide: bool = True) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_N, BLOCK_M, BLOCK_K, num_warps, num_stages, SPLIT_K) of fp8_mm for M tokens of an [N, K] weight on a
    device of `sms` SMs. K is split when the tiles would leave SMs idle: an N = 4,096 projection has 64 tiles of 64
    rows for an H200's 132 SMs, and 2 splits took o_proj from 0.0094 to 0.0089 ms and down_proj from 0.0252 to 0.0203
    at M = 64 (0.0219 -> 0.0183 at 16), into at most MAX_SPLIT_K slices of at least 2 K tiles each. `wide` False:
    never WIDE_CONFIG (engine.kernels.fp8_mm_rope keeps its tiles within a head)."""
    if interpreting():
        return 16, 16, 32, 4, 1, 1
    for bound, block_n, block_m, block_k, warps, stages in FP8_MM_CONFIGS:
        if m <= bound:
            m_tiles = triton.cdiv(m, block_m)
            if wide and block_m >= WIDE_MIN_BLOCK_M and triton.cdiv(n, block_n) * m_tiles >= 2 * sms:
                wide_n, wide_k, wide_warps, wide_stages = WIDE_CONFIG
                return wide_n, block_m, wide_k, wide_warps, wide_stages, 1
            tiles = triton.cdiv(n, block_n) * m_tiles
            split = max(1, min(MAX_SPLIT_K, sms // tiles, k // (2 * block_k)))
            return block_n, block_m, block_k, warps, stages, split
    raise AssertionError("FP8_MM_CONFIGS' last row covers every M")


def check_mm_args(x: torch.Tensor, x_scales: torch.Tensor | None, weight: torch.Tensor, w_scales: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype) -> tuple[int, int, int]:
    check("x", x, 2, (FP8,) if x_scales is not None else (FP8, *OUT_DTYPES), inner_contiguous=True)
    if x.dtype == FP8 and x_scales is None:
        raise ValueError("e4m3 x needs its x_scales (only 16-bit x goes without: weight-only)")
    dev = x.device
    if dev.type != "cuda" and not interpreting():
        raise ValueError(f"x must be on a CUDA device (or run under TRITON_INTERPRET=1), got {dev}")
    check("weight", weight, 2, (FP8,), dev, inner_contiguous=True)
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x must have {weight.shape[1]} columns (weight's in-features), got {k}")
    if x_scales is not None:
        check("x_scales", x_scales, 2, (torch.float32,), dev)
        if tuple(x_scales.shape) != (m, 1) or not x_scales.is_contiguous():
            raise ValueError(f"x_scales must be a contiguous [{m}, 1], got {tuple(x_scales.shape)}")
    check("w_scales", w_scales, 2, (torch.float32,), dev)
    if tuple(w_scales.shape) != (1, n) or not w_scales.is_contiguous():
        raise ValueError(f"w_scales must be a contiguous [1, {n}], got {tuple(w_scales.shape)}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if bias is not None:
        check("bias", bias, 1, (out_dtype,), dev, inner_contiguous=True)
        if bias.shape[0] != n:
            raise ValueError(f"bias must have {n} entries (weight's out-features), got {bias.shape[0]}")
    return m, n, k


def split_k_args(k: int, grid: tuple[int, int, int], block_n: int, block_m: int, block_k: int,
                 semaphores: torch.Tensor | None, unused: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(K_SPLIT, partials, semaphores) of a launch over `grid` (N tiles, M tiles, SPLIT_K) of the kernels that sum
    with mm_accumulate: each split's whole K tiles, float32 partials [SPLIT_K x tiles x BLOCK_N x BLOCK_M], and the
    caller's `semaphores` (int32, zero, one a tile) when they suffice, else zeroed ones. With one split the two
    tensors are `unused` (pointers the kernel never reads)."""
    split_k = grid[2]
    k_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    if split_k == 1:
        return k_split, unused, unused
    tiles = grid[0] * grid[1]
    part = torch.empty((split_k * tiles * block_n * block_m,), dtype=torch.float32, device=unused.device)
    sems = semaphores
    if sems is None or sems.numel() < tiles or sems.dtype != torch.int32 or sems.device != unused.device:
        sems = torch.zeros((tiles,), dtype=torch.int32, device=unused.device)
    return k_split, part, sems


def fp8_gemv(x: torch.Tensor, x_scales: torch.Tensor | None, weight: torch.Tensor, w_scales: torch.Tensor,
             bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
             config: tuple[int, int, int] | None = None, gated: bool = False) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_M) @ weight [N, K] e4m3 ^T, scaled (module docstring) -> [M, N] out_dtype: x e4m3
    with x_scales [M, 1], or 16-bit with x_scales None (weight-only). `config` (BLOCK_N, BLOCK_K, num_warps)
    overrides gemv_config (the sweep times several). `gated`: weight is a fused [gate; up] and the result
    silu(gate) * up, [M, N / 2] (engine.kernels.skinny_gemm's gated GEMV)."""
    m, n, k = check_mm_args(x, x_scales, weight, w_scales, bias, out_dtype)
    if m > GEMV_MAX_M:
        raise ValueError(f"fp8_gemv takes at most {GEMV_MAX_M} rows, got {m}")
    n_out = gated_outputs(n) if gated else n
    out = torch.empty((m, n_out), dtype=out_dtype, device=x.device)
    if m and n:
        block_n, block_k, warps = config or gemv_config(m, k)
        if gated and block_n % 2:
            raise ValueError(f"a gated GEMV reads gate and up rows in pairs: BLOCK_N must be even, got {block_n}")
        _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
            x, x_scales if x_scales is not None else w_scales, weight, w_scales, bias if bias is not None else w_scales,
            out, m, n_out, k, x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
            HAS_XS=x_scales is not None, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
            GATED=gated, num_warps=warps, **pdl_args(x.device, m))
    return out


def fp8_mm(x: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor, w_scales: torch.Tensor,
           bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
           config: tuple[int, ...] | None = None, semaphores: torch.Tensor | None = None,
           w_tma: bool = False) -> torch.Tensor:
    """x [M, K] e4m3 @ weight [N, K] e4m3 ^T, scaled (module docstring) -> [M, N] out_dtype on FP8 tensor cores.
    `config` (BLOCK_N, BLOCK_M, BLOCK_K, num_warps, num_stages[, SPLIT_K]) overrides mm_config (the sweep times
    several). A split K meets on `semaphores` (int32, zero, at least one per output tile; left zero again, so a
    caller may keep one: engine.model.fp8_linear does); without enough of them a zeroed one is made per call.
    `w_tma`: the weight's tiles by the tensor-memory accelerator (a host tensor descriptor). Off by default: on an
    H200 it gave the loads' bits in 0.99-1.06x their time at the same launch (benchmarks/fp8_gpu.py gemm-sweep,
    2026-12-06), so nothing uses it."""
    if x_scales is None:
        raise ValueError("fp8_mm takes e4m3 x with its x_scales")
    m, n, k = check_mm_args(x, x_scales, weight, w_scales, bias, out_dtype)
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m and n:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
        block_n, block_m, block_k, warps, stages, *split = config or mm_config(m, n, k, sms)
        split_k = split[0] if split else 1
        if not isinstance(split_k, int) or split_k < 1:
            raise ValueError(f"SPLIT_K must be a positive int, got {split_k!r}")
        grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split_k)
        k_split, part, sems = split_k_args(k, grid, block_n, block_m, block_k, semaphores, out)
        w_arg = weight
        if w_tma:  # a tensor descriptor needs a 16-byte aligned base and row stride
            if weight.data_ptr() % 16 or weight.stride(0) % 16:
                raise ValueError(f"w_tma needs weight rows 16-byte aligned (row stride {weight.stride(0)} bytes, "
                                 f"base address % 16 = {weight.data_ptr() % 16})")
            from triton.tools.tensor_descriptor import TensorDescriptor
            w_arg = TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [block_n, block_k])
        _fp8_mm_kernel[grid](
            x, x_scales, w_arg, w_scales, bias if bias is not None else w_scales, out, part, sems, m, n, k, k_split,
            x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n,
            BLOCK_M=block_m, BLOCK_K=block_k, SPLIT_K=split_k, DOT_F32=interpreting(), num_warps=warps,
            num_stages=stages, W_TMA=w_tma, **pdl_args(x.device, m, late=True))
    return out
