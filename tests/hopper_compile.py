"""Compiles the decode step's Triton kernels for an H100/H200 (sm_90) on any machine, with and without
programmatic dependent launch (its trigger right after the wait, or late: engine.kernels.pdl), and prints one JSON
line per variant. Run in a process of its own without
TRITON_INTERPRET (tests/test_kernels_compile_hopper.py): the CPU interpreter accepts code the compiler refuses.

The variants are the ones the engine launches on an 8B-shaped model (bf16 and fp8 caches, FP8 weights), the fp8
cache's decode attention also at GQA groups of 8 and 16 (the 70B shape's, 128 heads on 8); each with PDL only where
the engine launches it so. Their signatures follow each kernel's parameters: pointers default to bf16, a few named
ones are given below.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.kernels import (
    decode_attention,
    decode_launch,
    fp8_gemm,
    fp8_mm_rope,
    fp8_mm_swiglu,
    fp8_quant,
    kv_store,
    qkv_rope,
    rms_norm,
    rope,
    silu_mul,
    skinny_gemm,
)
from engine.kernels.decode_launch import AttentionLaunch

HOPPER = GPUTarget("cuda", 90, 32)
FLOAT_ARGS = {"eps", "k_scale", "v_scale", "qk_scale", "scale"}
F32, F8, I32, I64 = "*fp32", "*fp8e4nv", "*i32", "*i64"
ROPE = {"pos_ptr": I64, "cos_ptr": F32, "sin_ptr": F32, "slots_ptr": I64}
QUANT = {"q_ptr": F8, "s_ptr": F32, "static_ptr": F32}


def variants():
    """(kernel, constexprs, pointer dtypes, num_warps, num_stages)"""
    for gated in (False, True):  # gated: gate_up's GEMV with SiLU-and-mul in its epilogue
        yield (skinny_gemm._skinny_gemm_kernel, dict(HAS_BIAS=False, BLOCK_M=1, BLOCK_N=2, BLOCK_K=4096, GATED=gated),
               {}, 8, 3)
        yield (fp8_gemm._fp8_gemv_kernel, dict(HAS_BIAS=False, HAS_XS=False, BLOCK_M=1, BLOCK_N=4, BLOCK_K=2048,
                                                GATED=gated), {"w_ptr": F8, "ws_ptr": F32, "xs_ptr": F32}, 4, 3)
    yield (skinny_gemm._skinny_gemm_kernel, dict(HAS_BIAS=True, BLOCK_M=2, BLOCK_N=2, BLOCK_K=4096, GATED=False), {},
           4, 3)
    for block_n, block_k, split, warps in ((64, 256, 2, 4), (*fp8_gemm.WIDE_CONFIG[:2], 1, fp8_gemm.WIDE_CONFIG[2])):
        for tma in (False, True):  # the weight by pointers, or by a tensor descriptor (fp8_mm's w_tma)
            weight = f"tensordesc<fp8e4nv[{block_n}, {block_k}]>" if tma else F8
            yield (fp8_gemm._fp8_mm_kernel, dict(HAS_BIAS=False, BLOCK_N=block_n, BLOCK_M=64, BLOCK_K=block_k,
                                                  SPLIT_K=split, DOT_F32=False, W_TMA=tma),
                   {"x_ptr": F8, "w_ptr": weight, "ws_ptr": F32, "xs_ptr": F32, "part_ptr": F32, "sem_ptr": I32},
                   warps, 4)
    mm = {"x_ptr": F8, "w_ptr": F8, "ws_ptr": F32, "xs_ptr": F32, "part_ptr": F32, "sem_ptr": I32}
    for block_m, split in ((64, 1), (16, 2)):  # the qkv GEMM with RoPE and the KV store in its epilogue
        yield (fp8_mm_rope._fp8_mm_rope_store_kernel, dict(H=32, KVH=8, D=128, BS=16, HAS_BIAS=False, BLOCK_N=64,
                                                            BLOCK_M=block_m, BLOCK_K=256, SPLIT_K=split,
                                                            DOT_F32=False), {**mm, "kv_ptr": F8, **ROPE}, 4, 4)
    for block_n, block_m, block_k, warps, split in ((*fp8_gemm.WIDE_CONFIG[:1], 64, fp8_gemm.WIDE_CONFIG[1],
                                                     fp8_gemm.WIDE_CONFIG[2], 1), (64, 16, 256, 4, 2)):
        yield (fp8_mm_swiglu._fp8_mm_swiglu_kernel, dict(HAS_BIAS=False, BLOCK_N=block_n, BLOCK_M=block_m,
                                                         BLOCK_K=block_k, SPLIT_K=split, DOT_F32=False),
               {**mm, "amax_ptr": F32}, warps, 4)
    yield (fp8_mm_swiglu._quant_by_maxima_kernel, dict(CHUNK=1024, BLOCK_P=128, STATIC=False, MIN=1e-12),
           {"amax_ptr": F32, **QUANT}, 2, 3)
    yield (qkv_rope._qkv_rope_store_kernel, dict(H=32, KVH=8, HALF=64, BS=16, HAS_BIAS=False, BLOCK_M=1,
                                                  BLOCK_K=1024, SCALED=True, HAS_XS=False),
           {"w_ptr": F8, "kv_ptr": F8, "xs_ptr": F32, "ws_ptr": F32, **ROPE}, 2, 3)
    yield (qkv_rope._qkv_rope_store_kernel, dict(H=32, KVH=8, HALF=64, BS=16, HAS_BIAS=False, BLOCK_M=1,
                                                  BLOCK_K=4096, SCALED=False, HAS_XS=False),
           {"xs_ptr": "*bf16", "ws_ptr": "*bf16", **ROPE}, 8, 3)
    # launch_config's launches (the one-warp one swapped, AttentionLaunch.swapped: 8 columns of heads, on 5 stages),
    # the one-warp tile unswapped and swapped on 4 stages too; the one-warp launch merges at most 4 splits at a time
    # (decode_attention.MERGE_TILE)
    for cache, block_n, warps, stages, splits, merge, swapped in (("*bf16", 64, 4, 3, 4, 4, False),
                                                                  (F8, 64, 4, 4, 16, 16, False),
                                                                  (F8, 32, 1, 4, 16, 4, False),
                                                                  (F8, 32, 1, 4, 16, 4, True),
                                                                  (F8, 32, 1, 5, 16, 4, True)):
        yield (decode_attention._decode_split_kernel,
               dict(NUM_HEADS=32, NUM_KV_HEADS=8, GROUP=4, BLOCK_G=8 if swapped else 16, HEAD_DIM=128, BLOCK_D=128,
                    BLOCK_SIZE=16, SWAPPED=swapped,
                    BLOCK_N=block_n, NUM_SPLITS=splits, MIN_SPLIT_BLOCKS=block_n // 16, MERGE_G=4, MERGE_S=merge,
                    WINDOW=0, DOT_F32=False, WIDEN_F16=cache == F8, V_WORDS=cache == F8, WHOLE_TILES=True,
                    LAZY=AttentionLaunch._field_defaults["lazy"]),
               {"kv_ptr": cache, "tables_ptr": I32, "lens_ptr": I32, "part_out_ptr": F32, "part_lse_ptr": F32,
                "sem_ptr": I32}, warps, stages)
    # an fp8 cache's launch for many pairs, as launch_config picks it, at wider GQA groups (the 70B shape's 8; 16:
    # 128 query heads on 8 KV heads) with the merge tile decode_attention gives them (MERGE_S 2 and 1 on one warp)
    for group in (8, 16):
        launch = decode_launch.launch_config(torch.bfloat16, 128, True, decode_launch.FEW_PAIRS)
        block_g = max(8 if launch.swapped else 16, group)
        yield (decode_attention._decode_split_kernel,
               dict(NUM_HEADS=8 * group, NUM_KV_HEADS=8, GROUP=group, BLOCK_G=block_g, HEAD_DIM=128, BLOCK_D=128,
                    BLOCK_SIZE=16, SWAPPED=launch.swapped, BLOCK_N=launch.block_n, NUM_SPLITS=16,
                    MIN_SPLIT_BLOCKS=launch.block_n // 16, MERGE_G=group,
                    MERGE_S=max(1, min(16, decode_attention.MERGE_TILE * launch.num_warps // 4 // (group * 128))),
                    WINDOW=0, DOT_F32=False, WIDEN_F16=True, V_WORDS=launch.v_words, WHOLE_TILES=launch.whole_tiles,
                    LAZY=launch.lazy),
               {"kv_ptr": F8, "tables_ptr": I32, "lens_ptr": I32, "part_out_ptr": F32, "part_lse_ptr": F32,
                "sem_ptr": I32}, launch.num_warps, launch.num_stages)
    yield rms_norm._rms_norm_kernel, dict(N=4096, BLOCK_N=4096, HAS_RESIDUAL=True), {}, 8, 3
    yield silu_mul._silu_mul_kernel, dict(INTER=14336, BLOCK=1024), {}, 4, 3
    yield (rope._rope_store_kernel, dict(BS=16, H=32, KVH=8, HALF=64, BLOCK_H=32, BLOCK_KVH=8, BLOCK_HALF=64),
           {"kv_ptr": F8, **ROPE}, 4, 3)
    yield rope._rope_kernel, dict(H=32, KVH=8, HALF=64, BLOCK_H=32, BLOCK_KVH=8, BLOCK_HALF=64), ROPE, 4, 3
    yield (kv_store._store_kv_kernel, dict(BS=16, KVH=8, D=128, BLOCK_H=8, BLOCK_D=128),
           {"kv_ptr": F8, "slots_ptr": I64}, 4, 3)
    yield fp8_quant._quant_rows_kernel, dict(N=4096, BLOCK_N=4096, STATIC=False, MIN=1e-12), QUANT, 8, 3
    yield (fp8_quant._rms_norm_quant_kernel, dict(N=4096, BLOCK_N=4096, HAS_RESIDUAL=True, STATIC=False,
                                                   MIN=1e-12), QUANT, 8, 3)
    yield fp8_quant._silu_mul_quant_kernel, dict(INTER=14336, CHUNK=2048, STATIC=False, MIN=1e-12), QUANT, 8, 3
    yield fp8_quant._silu_mul_amax_kernel, dict(INTER=14336, CHUNK=1024, CHUNKS=14), {"amax_ptr": F32}, 4, 3
    yield (fp8_quant._silu_mul_quant_split_kernel, dict(INTER=14336, CHUNK=1024, CHUNKS=14, BLOCK_C=16, STATIC=False,
                                                         MIN=1e-12), {"amax_ptr": F32, **QUANT}, 4, 3)


def compile_one(kernel, constexprs: dict, pointers: dict, warps: int, stages: int, pdl: bool,
                late: bool = False) -> dict:
    signature, values = {}, {}
    for p in kernel.params:
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            # EARLY_KV (decode attention's first tile before the wait) goes with PDL, as the launch sets it
            # PDL_LATE (the trigger after the main loop: engine.kernels.pdl) only with PDL
            values[p.name] = (pdl if p.name in ("PDL", "EARLY_KV") else late if p.name == "PDL_LATE"
                              else constexprs[p.name])
        elif p.name.endswith("_ptr"):
            signature[p.name] = pointers.get(p.name, "*bf16")
        else:
            signature[p.name] = "fp32" if p.name in FLOAT_ARGS else "i32"
    row = {"kernel": f"{kernel.fn.__module__}.{kernel.fn.__name__}", "pdl": pdl, "late": late,
           "constexprs": {k: v for k, v in constexprs.items() if k in ("BLOCK_M", "SCALED", "WIDEN_F16", "GATED",
                                                                          "GROUP", "V_WORDS", "SWAPPED")}}
    # what a launch on the 8B shape specialises on: 16-byte aligned pointers, sizes and strides divisible by 16
    # (except what a kernel marks do_not_specialize), so the code compiled here is the code that runs there
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kernel.params)
             if not p.is_constexpr and p.name not in kernel.do_not_specialize and i not in kernel.do_not_specialize
             and signature[p.name] != "fp32" and not signature[p.name].startswith("tensordesc")}
    try:
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=values, attrs=attrs),
                                  target=HOPPER,
                                  options={"num_warps": warps, "num_stages": stages, "launch_pdl": pdl})
    except Exception as e:  # noqa: BLE001 - reported per variant
        return row | {"error": f"{type(e).__name__}: {e}"[:2000]}
    ptx = compiled.asm["ptx"]
    sass = machine_code(compiled.asm["cubin"])
    return row | {"cubin_bytes": len(compiled.asm["cubin"]), "wait": "griddepcontrol.wait" in ptx,
                  "launch_dependents": "griddepcontrol.launch_dependents" in ptx,
                  "trigger_after_mma": trigger_after_mma(ptx),
                  # stores to thread-local memory: registers spilled
                  "local_stores": None if sass is None else sass.count(" STL"),
                  # one-byte shared-memory loads: an e4m3 tile transposed for tl.dot byte by byte
                  # (engine.kernels.e4m3.widen_e4m3_words)
                  "byte_shared_loads": None if sass is None else sass.count("LDS.U8")}


def trigger_after_mma(ptx: str) -> bool | None:
    """Whether the PTX's griddepcontrol.launch_dependents comes after its last MMA (a late trigger: after the main
    loop, engine.kernels.pdl); None for a kernel without both."""
    lines = ptx.splitlines()
    mma = [i for i, line in enumerate(lines) if "mma.sync" in line or "wgmma.mma_async" in line]
    trigger = [i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line]
    return trigger[0] > mma[-1] if mma and trigger else None


def machine_code(cubin: bytes) -> str | None:
    """The SASS of a cubin, by Triton's own cuobjdump (None if it is missing)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout


def pdl_modes(kernel, constexprs: dict, warps: int, stages: int) -> tuple[tuple[bool, bool], ...]:
    """(pdl, late) pairs a variant is built with: all three, but the decode attention launches the engine makes
    without PDL (decode_launch.shuns_pdl: the one-warp and 5-stage ones) only as they run."""
    if kernel is decode_attention._decode_split_kernel and decode_launch.shuns_pdl(
            AttentionLaunch(constexprs["BLOCK_N"], warps, stages)):
        return ((False, False),)
    return ((False, False), (True, False), (True, True))


if __name__ == "__main__":
    for kernel, constexprs, pointers, warps, stages in variants():
        for pdl, late in pdl_modes(kernel, constexprs, warps, stages):
            print(json.dumps(compile_one(kernel, constexprs, pointers, warps, stages, pdl, late)), flush=True)
