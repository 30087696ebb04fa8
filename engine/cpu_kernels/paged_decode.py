"""The CPU decode-attention kernel (paged_decode.c): built with the system's C compiler on first use
(engine.cpu_kernels.build), loaded with ctypes, and called on the decode rows of a step in place of the torch
path's gather + SDPA.

Owns loading the kernel (`load`) and the call's argument checks. Without a C compiler, or if the build fails,
`load()` is None and the engine keeps the torch path (logged once). An fp8 cache (engine.kv_quant) is read by the
kernel itself: its bytes widened through a float32 table of the 256 e4m3 values, the scales folded into the call.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from engine.cpu_kernels.build import build

SOURCE = Path(__file__).with_name("paged_decode.c")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # q's (and a cache in q's dtype)
FP8 = 2  # the kernel's code for a float8_e4m3fn cache
MAX_THREADS = 2  # the kernel is single-threaded: engines with more torch threads keep torch's parallel path


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built here."""
    lib = build(SOURCE, "CPU decode attention")
    if lib is None:
        return None
    fn = lib.paged_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                   ctypes.c_int, ctypes.c_int, ptr, ctypes.c_float, ptr, ptr]
    fn.restype = None
    return lib


@functools.cache
def fp8_table() -> torch.Tensor:
    """[256] float32: the value of each float8_e4m3fn bit pattern (NaN for the two NaN codes)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def check_tables(tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Raise ValueError unless every context fits its row of the table and every block id is in the cache: the
    kernel reads where they point, unchecked."""
    if context_lens.numel() and int(context_lens.max()) > tables.shape[1] * block_size:
        raise ValueError(f"a context of {int(context_lens.max())} tokens exceeds its block table "
                         f"({tables.shape[1]} blocks of {block_size})")
    if tables.numel() and not 0 <= int(tables.min()) <= int(tables.max()) < num_blocks:
        raise ValueError(f"block table ids must be in [0, {num_blocks}), got {int(tables.min())}..{int(tables.max())}")


def scratch_floats(heads: int, kv_heads: int, head_dim: int, longest: int) -> int:
    """The float32 scratch the kernel needs for contexts of at most `longest` tokens (see the C source)."""
    return heads * head_dim + heads * longest + (heads + kv_heads) * head_dim + 2 * longest


def paged_decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, window: int | None, checked: bool = False,
                           out: torch.Tensor | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> torch.Tensor:
    """q [B, H, D]; kv_layer [NB, 2, bs, KVH, D] (the new tokens' K/V stored); tables [B, W] int32; context_lens
    [B] int32 (0: a padding row, zeros) -> [B, H, D] in q's dtype, into `out` where given (contiguous). `checked`:
    the caller ran check_tables on these tables (once a step, for every layer). The cache is in q's dtype, or
    float8_e4m3fn holding K / k_scale and V / v_scale (the scales are ignored for other caches)."""
    b, h, d = q.shape
    nb, _, bs, kvh, kd = kv_layer.shape
    fp8 = kv_layer.dtype == torch.float8_e4m3fn
    if kd != d or h % kvh or tables.shape[0] != b or context_lens.shape != (b,) or q.dtype not in DTYPES \
            or not (fp8 or kv_layer.dtype == q.dtype):
        raise ValueError(f"paged_decode_attention: q {tuple(q.shape)} {q.dtype}, kv_layer {tuple(kv_layer.shape)} "
                         f"{kv_layer.dtype}, tables {tuple(tables.shape)}, context_lens {tuple(context_lens.shape)} "
                         "do not agree")
    if not checked:
        check_tables(tables, context_lens, nb, bs)
    q = q.contiguous()
    tables = tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"paged_decode_attention: out must be a contiguous {tuple(q.shape)} {q.dtype} tensor")
    scratch = torch.empty(scratch_floats(h, kvh, d, tables.shape[1] * bs), dtype=torch.float32)
    s_block, s_kv, s_tok, s_head, _ = kv_layer.stride()
    load().paged_decode_attention(
        q.data_ptr(), kv_layer.data_ptr(), s_block, s_kv, s_tok, s_head, tables.data_ptr(), tables.shape[1],
        context_lens.data_ptr(), b, h, kvh, d, bs, window or 0, scale * k_scale if fp8 else scale, DTYPES[q.dtype],
        FP8 if fp8 else DTYPES[q.dtype], fp8_table().data_ptr(), v_scale if fp8 else 1.0, out.data_ptr(),
        scratch.data_ptr())
    return out
