"""The CPU prefill-attention kernel (prefill_attention.c, AMX tiles): every prefill chunk of a step attends to its
context straight from the paged cache in one call per layer, where the torch path gathers each chunk's K and V and
runs torch's flash attention (at head_dim 32, ~350 us per 256-token prompt and layer on `tiny`: a third of a
prefill step; the kernel takes ~150).

Owns loading the kernel (`load`: None without a C compiler, without AMX, or where the kernel may not use it) and
the call's argument checks. Results equal torch's SDPA within bfloat16 rounding (float32 softmax and accumulation,
probabilities rounded to bfloat16 for the second product, as torch's CPU kernel does):
tests/test_cpu_prefill_attention.py.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from engine.cpu_kernels.build import build

SOURCE = Path(__file__).with_name("prefill_attention.c")
MAX_DIM = 256


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot run here (no compiler: logged by build; no AMX: silently)."""
    lib = build(SOURCE, "CPU prefill attention")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.prefill_attention.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, ptr, i64, ptr, i64, i64, i64, i64, i64,
                                      ctypes.c_float, ptr]
    lib.prefill_attention.restype = ctypes.c_int
    lib.prefill_attention_scratch.argtypes = [i64, i64]
    lib.prefill_attention_scratch.restype = i64
    lib.prefill_attention_ready.restype = ctypes.c_int
    return lib if lib.prefill_attention_ready() == 0 else None  # the tile state granted to this process


def takes(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel runs here for this model: bfloat16, head_dim a multiple of 32 up to MAX_DIM."""
    return dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= MAX_DIM and load() is not None


def prefill_attention(q: torch.Tensor, kv_layer: torch.Tensor, chunks: torch.Tensor, tables: torch.Tensor,
                      max_ctx: int, scale: float, out: torch.Tensor) -> None:
    """q, out [T, H, D] bfloat16 contiguous; kv_layer [NB, 2, bs, KVH, D] holding the chunks' K/V already; chunks
    [C, 3] int32 (first row in q, length n, context ctx: the chunk's queries are positions ctx - n .. ctx - 1);
    tables [C, W] int32, each chunk's block ids (checked by the caller: the kernel reads where they point);
    max_ctx the largest ctx. Writes the chunks' rows of `out`."""
    t, heads, dim = q.shape
    _, _, bs, kv_heads, _ = kv_layer.shape
    if q.dtype != torch.bfloat16 or kv_layer.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
        raise ValueError(f"prefill_attention: bfloat16 only, got q {q.dtype}, kv {kv_layer.dtype}, out {out.dtype}")
    if not (q.is_contiguous() and out.is_contiguous() and out.shape == q.shape) or kv_layer.stride(-1) != 1 \
            or kv_layer.shape[-1] != dim or heads % kv_heads:
        raise ValueError(f"prefill_attention: q {tuple(q.shape)}, out {tuple(out.shape)} and kv {tuple(kv_layer.shape)}"
                         " do not agree (contiguous q and out, D contiguous in the cache, H a multiple of KVH)")
    if chunks.dtype != torch.int32 or tables.dtype != torch.int32 or chunks.shape[0] != tables.shape[0]:
        raise ValueError("prefill_attention: chunks [C, 3] and tables [C, W] must be int32, one row per chunk")
    lib = load()
    scratch = torch.empty(lib.prefill_attention_scratch(max_ctx, dim), dtype=torch.uint8)
    s_block, s_kv, s_tok, s_head, _ = kv_layer.stride()
    chunks, tables = chunks.contiguous(), tables.contiguous()
    if lib.prefill_attention(q.data_ptr(), out.data_ptr(), kv_layer.data_ptr(), s_block, s_kv, s_tok, s_head,
                             chunks.data_ptr(), chunks.shape[0], tables.data_ptr(), tables.shape[1], heads, kv_heads,
                             dim, bs, scale, scratch.data_ptr()):
        raise ValueError(f"prefill_attention: head_dim {dim} is not a multiple of 32 up to {MAX_DIM}")
