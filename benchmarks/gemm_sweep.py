"""One decoder layer's GEMMs at each M, every way pdserve can run them (issue 42): `python benchmarks/fp8_gpu.py
gemm-sweep` (`bash benchmarks/gpu_run.sh fp8sweep`); fp8_gpu.py's docstring says what it prints. Picks
engine.kernels.fp8_gemm's launch table (FP8_MM_CONFIGS) and times fp8_mm's weight by TMA (TMA_CONFIGS) against its
per-thread loads.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bf16_swapped import BF16_MM_CONFIGS, bf16_swapped_mm, block_m, config_name, swapped_buffers  # noqa: E402
from benchmarks.engine_bench_gpu import copy_bandwidth  # noqa: E402
from engine.kernels.fp8_gemm import fp8_gemv, fp8_mm, mm_config  # noqa: E402
from engine.kernels.silu_mul import silu_and_mul  # noqa: E402
from engine.kernels.skinny_gemm import skinny_linear  # noqa: E402

SHAPES = {"llama-3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                         "lm_head": (128256, 4096)},
          "llama-3-70b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)}}
MS = (1, 2, 4, 16, 32, 64, 128, 256, 2048)
# (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K); BLOCK_M follows M (16, 32, 64)
CONFIGS = tuple(itertools.product((16, 32, 64, 128), (128, 256), (4,), (4,), (1,))) + ((64, 128, 8, 4, 1),
                                                                                      (128, 128, 8, 4, 1))
# K split for the decode sizes (an N = 4,096 GEMM has 64 tiles of 64 rows for 132 SMs)
SPLIT_CONFIGS = tuple((64, 256, 4, stages, split) for stages in (3, 4) for split in (2, 3, 4)) + ((64, 256, 4, 3, 1),)
# fp8_mm with its weight by TMA (w_tma), beside the default launch by TMA: fewer, wider and deeper tiles
TMA_CONFIGS = ((64, 256, 4, 4, 1), (64, 256, 4, 4, 2), (64, 256, 4, 3, 2), (64, 128, 4, 6, 2), (64, 128, 4, 8, 1),
               (128, 128, 8, 4, 1), (128, 256, 8, 3, 1), (32, 256, 4, 4, 2))
GEMV_CONFIGS = ((2, 4096, 8), (4, 4096, 8), (4, 2048, 4), (8, 2048, 8))
L2_BYTES = 60 << 20


def copies(n: int, k: int, dtype: torch.dtype) -> list[torch.Tensor]:
    one = n * k * torch.empty((), dtype=dtype).element_size()
    count = max(2, -(-4 * L2_BYTES // one))
    base = torch.randn(n, k, device="cuda") * 0.05
    return [(base + i * 1e-3).to(dtype) for i in range(count)]


def timed(fn, count: int) -> float:
    """Median ms of one call, fn(i) called on weight copy i % count, replayed in a CUDA graph."""
    state = {"i": 0}

    def step():
        fn(state["i"] % count)
        state["i"] += 1
    try:
        return do_bench_cudagraph(step, rep=20, return_mode="median")
    except Exception as e:  # a configuration the GPU cannot run (shared memory): reported, not fatal
        print(json.dumps({"skipped": str(e).splitlines()[0][:160]}), flush=True)
        return float("inf")


def measure_gemm(name: str, n: int, k: int, m: int, w16: list[torch.Tensor], w8: list[torch.Tensor], ws: torch.Tensor,
                 bandwidth: float) -> dict:
    """Every way of one GEMM at one M: {way: median ms}, with the floors."""
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    xq = (x.float() / 2).to(torch.float8_e4m3fn)
    xs = torch.full((m, 1), 2.0, device="cuda")
    one = torch.ones(1, device="cuda")
    row = {"gemm": name, "n": n, "k": k, "m": m, "floor_bf16_ms": round(n * k * 2 / bandwidth * 1e3, 4),
           "floor_fp8_ms": round(n * k / bandwidth * 1e3, 4),
           "bf16_cublas": timed(lambda i: torch.nn.functional.linear(x, w16[i]), len(w16))}
    if m <= 16:
        row["bf16_skinny"] = timed(lambda i: skinny_linear(x, w16[i]), len(w16))
    if 16 <= m <= 128 and name != "lm_head":
        row.update(bf16_swapped(x, w16, m))
    if name == "lm_head" and m > 16:
        return row
    row["fp8_scaled_mm_rowwise"] = timed(lambda i: torch._scaled_mm(xq, w8[i].t(), scale_a=xs, scale_b=ws,
                                                                    out_dtype=torch.bfloat16), len(w8))
    row["fp8_scaled_mm_tensor"] = timed(lambda i: torch._scaled_mm(xq, w8[i].t(), scale_a=one, scale_b=one,
                                                                   out_dtype=torch.bfloat16), len(w8))
    if name == "lm_head":  # a bfloat16 LM head (FP8 checkpoints leave it unquantized): only its bf16 ways
        return row
    if m <= 16:
        for bn, bk, warps in GEMV_CONFIGS:
            row[f"fp8_gemv_{bn}x{bk}w{warps}"] = timed(
                lambda i, c=(bn, bk, warps): fp8_gemv(xq, xs, w8[i], ws, config=c), len(w8))
    if name == "gate_up" and m <= 2:  # SiLU-and-mul in the GEMV's epilogue against the GEMV, then its own launch
        for way, gated in (("gated", True), ("then_silu", False)):
            row[f"act_bf16_skinny_{way}"] = timed(
                lambda i, gated=gated: skinny_linear(x, w16[i], gated=True) if gated else silu_and_mul(
                    skinny_linear(x, w16[i])), len(w16))
            row[f"act_fp8_gemvwo_{way}"] = timed(
                lambda i, gated=gated: fp8_gemv(x, None, w8[i], ws, gated=True) if gated else silu_and_mul(
                    fp8_gemv(x, None, w8[i], ws)), len(w8))
        print(json.dumps({"gate_up_activation": m, **{k: round(v, 4) for k, v in row.items()
                                                      if k.startswith("act_")}}), flush=True)
    if m <= 2:  # weight-only: the 16-bit rows as they are (what the model runs at M = 1)
        for bn, bk, warps in GEMV_CONFIGS:
            row[f"fp8_gemvwo_{bn}x{bk}w{warps}"] = timed(
                lambda i, c=(bn, bk, warps): fp8_gemv(x, None, w8[i], ws, config=c), len(w8))
    if m <= 256:
        sems = torch.zeros(1 << 14, dtype=torch.int32, device="cuda")
        for bn, bk, warps, stages, split in CONFIGS + (SPLIT_CONFIGS if m <= 64 else ()):
            config = (bn, block_m(m), bk, warps, stages, split)
            row[f"fp8_mm_{bn}x{block_m(m)}x{bk}w{warps}s{stages}k{split}"] = timed(
                lambda i, c=config: fp8_mm(xq, xs, w8[i], ws, config=c, semaphores=sems), len(w8))
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        row["fp8_mm_default"] = timed(lambda i: fp8_mm(xq, xs, w8[i], ws, config=mm_config(m, n, k, sms),
                                                       semaphores=sems), len(w8))
        # the weight's tiles by the tensor-memory accelerator (fp8_mm's w_tma) instead of per-thread loads
        tma_configs = (mm_config(m, n, k, sms), *((bn, block_m(m), bk, warps, stages, split)
                                                  for bn, bk, warps, stages, split in TMA_CONFIGS))
        for config in dict.fromkeys(tma_configs):
            bn, bm, bk, warps, stages, split = config
            row[f"fp8_mm_tma_{bn}x{bm}x{bk}w{warps}s{stages}k{split}"] = timed(
                lambda i, c=config: fp8_mm(xq, xs, w8[i], ws, config=c, semaphores=sems, w_tma=True), len(w8))
    return row


def bf16_swapped(x: torch.Tensor, w16: list[torch.Tensor], m: int) -> dict:
    """benchmarks/bf16_swapped.py's launches of the FP8 swapped kernel on bf16 operands. {way: median ms}"""
    n = w16[0].shape[0]
    out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    row = {}
    for config in BF16_MM_CONFIGS:
        buffers = swapped_buffers(m, n, config, x.device)
        row[config_name(config, m)] = timed(
            lambda i, c=config, b=buffers: bf16_swapped_mm(x, w16[i], out, c, b), len(w16))
    return row


def sweep_gemm(name: str, n: int, k: int, bandwidth: float, ms: tuple[int, ...]) -> list[dict]:
    w16 = copies(n, k, torch.bfloat16)
    w8 = [w.to(torch.float8_e4m3fn) for w in copies(n, k, torch.float32)]
    ws = torch.rand(1, n, device="cuda") * 1e-3 + 1e-4
    rows = []
    for m in ms:
        row = measure_gemm(name, n, k, m, w16, w8, ws, bandwidth)
        timings = {key: v for key, v in row.items() if key.startswith(("bf16_", "fp8_"))}
        if name == "lm_head":
            print(json.dumps({"gemm": name, "m": m, **{key: round(v, 4) for key, v in timings.items()},
                              "floor_bf16_ms": row["floor_bf16_ms"]}), flush=True)
            rows.append(row)
            continue
        best_fp8 = min((v, key) for key, v in timings.items() if key.startswith("fp8_") and "tensor" not in key)
        best_bf16 = min((v, key) for key, v in timings.items() if key.startswith("bf16_"))
        print(json.dumps({"gemm": name, "m": m, "best_fp8": best_fp8[1], "fp8_ms": round(best_fp8[0], 4),
                          "fp8_x_floor": round(best_fp8[0] / row["floor_fp8_ms"], 3), "best_bf16": best_bf16[1],
                          "bf16_ms": round(best_bf16[0], 4),
                          "bf16_x_floor": round(best_bf16[0] / row["floor_bf16_ms"], 3),
                          "fp8_speedup": round(best_bf16[0] / best_fp8[0], 3),
                          "scaled_mm_rowwise_ms": round(row["fp8_scaled_mm_rowwise"], 4),
                          "fp8_mm_default_ms": round(row.get("fp8_mm_default", float("nan")), 4)}), flush=True)
        rows.append(row)
    return rows


QKV_LAUNCHES = (None, (4096, 4), (2048, 4), (2048, 8), (1024, 4), (1024, 2))  # (BLOCK_K, num_warps); None: default


def sweep_qkv_rope(bandwidth: float) -> None:
    """engine.kernels.qkv_rope's fused q/k/v GEMV + RoPE + KV store at M = 1 (the 8B shape), bf16 and FP8 weights,
    each launch configuration against the weight's read floor."""
    from engine.kernels.qkv_rope import qkv_rope_store
    (n, k), heads, kv_heads, d = SHAPES["llama-3-8b"]["qkv"], 32, 8, 128
    positions = torch.tensor([1000], dtype=torch.int32, device="cuda")
    cos = torch.randn(8192, d, device="cuda")
    sin = torch.randn(8192, d, device="cuda")
    kv = torch.zeros(64, 2, 16, kv_heads, d, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([17], dtype=torch.int32, device="cuda")
    for label, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn), ("fp8_weight_only",
                                                                                 torch.float8_e4m3fn)):
        w = copies(n, k, dtype)
        fp8 = dtype == torch.float8_e4m3fn
        weight_only = label == "fp8_weight_only"
        extra = dict(x_scales=None if weight_only else torch.ones(1, 1, device="cuda"),
                     w_scales=torch.full((1, n), 0.01, device="cuda"), out_dtype=torch.bfloat16) if fp8 else {}
        x = (torch.randn(1, k, device="cuda") * 0.5).to(torch.bfloat16 if weight_only else dtype)
        floor_ms = n * k * w[0].element_size() / bandwidth * 1e3  # the same floor as the GEMMs' rows

        def call(i: int, launch: tuple[int, int] | None, w=w, x=x, extra=extra) -> None:
            qkv_rope_store(x, w[i], None, heads, kv_heads, positions, cos, sin, kv, slots, launch=launch, **extra)
        for launch in QKV_LAUNCHES:
            ms = timed(lambda i, launch=launch, call=call: call(i, launch), len(w))
            print(json.dumps({"qkv_rope": label, "launch": launch or "default",
                              "ms": round(ms, 4), "floor_ms": round(floor_ms, 4), "x_floor": round(ms / floor_ms, 2)}),
                  flush=True)
        del w
        torch.cuda.empty_cache()


def gemm_sweep(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("needs a CUDA device with FP8 tensor cores (compute capability 8.9 or higher)")
    bandwidth = copy_bandwidth()
    print(json.dumps({"case": "ceilings", "device": torch.cuda.get_device_name(),
                      "copy_gb_per_s": round(bandwidth / 1e9, 1)}), flush=True)
    if args.qkv_rope:
        sweep_qkv_rope(bandwidth)
        return
    ms = tuple(int(v) for v in args.ms.split(",")) if args.ms else MS
    gemms = SHAPES[args.shape] if args.gemms is None else {g: SHAPES[args.shape][g] for g in args.gemms.split(",")}
    rows = []
    for name, (n, k) in gemms.items():
        rows += sweep_gemm(name, n, k, bandwidth, ms)
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    # per M, the configuration whose summed time over the layer's four GEMMs is least
    layer = [g for g in gemms if g != "lm_head"]
    for m in ms:
        by_key: dict[str, float] = {}
        for row in rows:
            if row["m"] == m and row["gemm"] in layer:
                for key, v in row.items():
                    if key.startswith(("fp8_mm_", "fp8_gemv_", "fp8_gemvwo_")) or key == "fp8_scaled_mm_rowwise":
                        by_key[key] = by_key.get(key, 0.0) + v
        complete = {key: v for key, v in by_key.items()
                    if sum(1 for r in rows if r["m"] == m and r["gemm"] in layer and key in r) == len(layer)}
        if complete:
            best = min(complete, key=complete.get)
            bf16 = sum(min(v for key, v in r.items() if key.startswith("bf16_")) for r in rows
                       if r["m"] == m and r["gemm"] in layer)
            print(json.dumps({"layer_m": m, "best": best, "layer_fp8_ms": round(complete[best], 4),
                              "layer_bf16_ms": round(bf16, 4), "speedup": round(bf16 / complete[best], 3)}), flush=True)
