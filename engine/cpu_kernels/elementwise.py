"""The decoder's fused elementwise ops for bfloat16 on the CPU (elementwise.c): RMSNorm with the residual add,
SiLU-and-mul, and RoPE with the KV store. Each is one C pass over its rows where torch runs a chain of ops (eight for
RMSNorm; RoPE and the store: about twenty, a tenth of a decode step on `tiny`); on `tiny` a prefill step spent a
sixth of its time in the first two chains. Owns loading the library (`load`) and the calls; the model
switches to them with CausalLM.use_cpu_elementwise (bfloat16, TP=1, the torch path). Results equal the torch
path's but for a rare last-bit rounding (tests/test_cpu_elementwise.py).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from engine.cpu_kernels.build import build

SOURCE = Path(__file__).with_name("elementwise.c")


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library, or None where it cannot be built here."""
    lib = build(SOURCE, "CPU fused RMSNorm / SiLU-and-mul")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.rms_norm_bf16.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float]
    lib.rms_norm_bf16.restype = None
    lib.silu_mul_bf16.argtypes = [ptr, ptr, i64, i64]
    lib.silu_mul_bf16.restype = None
    lib.rope_store_bf16.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ptr]
    lib.rope_store_bf16.restype = ctypes.c_int
    return lib


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [T, dim] bfloat16 -> normed [T, dim]; with `residual` (contiguous [T, dim]), first x + residual, written
    into `residual` (as the GPU kernel does), and returns (normed, residual)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    rows, dim = x.shape
    res_ptr = None if residual is None else residual.data_ptr()
    load().rms_norm_bf16(x.data_ptr(), res_ptr, weight.data_ptr(), out.data_ptr(), rows, dim, eps)
    return out if residual is None else (out, residual)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] bfloat16 (gate, then up) -> silu(gate) * up [T, I]."""
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
    load().silu_mul_bf16(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
    return out


def rope_store(qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
               kv_layer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """qkv [T, (H + 2 KVH) D] bfloat16 (the fused projection's output); cos, sin [T, 1, D] bfloat16; kv_layer
    [NB, 2, bs, KVH, D]; slots [T] int32, as the step inputs hold them (negative: not stored) -> rotated q
    [T, H, D]; rotated k and v are stored at `slots`, as engine.model.rope.rotate then
    engine.model.torch_attention.write_kv do, bit for bit."""
    t = qkv.shape[0]
    d = kv_layer.shape[-1]
    if qkv.shape[1] != (heads + 2 * kv_heads) * d or kv_layer.shape[3] != kv_heads or kv_layer.stride(-1) != 1:
        raise ValueError(f"rope_store: qkv {tuple(qkv.shape)} and kv_layer {tuple(kv_layer.shape)} do not agree "
                         f"with {heads} heads and {kv_heads} KV heads")
    if {qkv.dtype, cos.dtype, sin.dtype, kv_layer.dtype} != {torch.bfloat16}:
        raise ValueError(f"rope_store: bfloat16 only, got qkv {qkv.dtype}, cos/sin {cos.dtype}, kv {kv_layer.dtype}")
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    slots = slots.to(torch.int32).contiguous()  # a no-op for the engine's own slots
    q = torch.empty((t, heads, d), dtype=qkv.dtype)
    nb, _, bs = kv_layer.shape[:3]
    s_block, s_kv, s_tok, s_head, _ = kv_layer.stride()
    if load().rope_store_bf16(qkv.data_ptr(), t, heads, kv_heads, d, cos.data_ptr(), sin.data_ptr(),
                              slots.data_ptr(), kv_layer.data_ptr(), nb, bs, s_block, s_kv, s_tok, s_head,
                              q.data_ptr()):
        raise IndexError(f"rope_store: a slot is past the cache's {nb} blocks of {bs}")
    return q
