"""GPU benchmark: one decoder layer's GEMMs (and the LM head) at each decode/prefill size M, every way pdserve can run
them, against the weight-read floor measured in the same run; picks engine.kernels.fp8_gemm's launch table.

`python benchmarks/fp8_gemm_sweep.py [--shape llama-3-8b] [--out sweep.json]` (`bash benchmarks/gpu_run.sh fp8sweep`).
Per (GEMM, M): bfloat16 (cuBLAS; the skinny GEMV for M <= 16), FP8 with torch._scaled_mm (row-wise scales, as the
dynamic per-token scheme needs, and per-tensor for reference), the FP8 GEMV (M <= 16) and the FP8 tensor-core kernel
(each launch configuration in CONFIGS). Timed as CUDA-graph replays (triton.testing.do_bench_cudagraph, median) over
enough copies of the weight that L2 (60 MB on an H200) never holds it, the way the engine replays a decode step;
the floor is the weight's bytes over the copy bandwidth measured first. Prints one JSON line per (GEMM, M) and the
best configuration per M bucket; --out keeps every figure.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.kernels.fp8_gemm import fp8_gemv, fp8_mm  # noqa: E402
from engine.kernels.skinny_gemm import skinny_linear  # noqa: E402

SHAPES = {"llama-3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                         "lm_head": (128256, 4096)},
          "llama-3-70b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)}}
MS = (1, 2, 4, 16, 32, 64, 128, 256, 2048)
# (BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_M follows M (16, 32, 64)
CONFIGS = tuple(itertools.product((16, 32, 64, 128), (128, 256), (4,), (4,))) + ((64, 128, 8, 4), (128, 128, 8, 4))
GEMV_CONFIGS = ((2, 4096, 8), (4, 4096, 8), (4, 2048, 4), (8, 2048, 8))
L2_BYTES = 60 << 20


def copy_bandwidth() -> float:
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=50, return_mode="median")
    return 2 * src.numel() * 2 / (ms / 1e3)


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


def block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def measure(name: str, n: int, k: int, m: int, w16: list[torch.Tensor], w8: list[torch.Tensor], ws: torch.Tensor,
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
    if m <= 256:
        for bn, bk, warps, stages in CONFIGS:
            config = (bn, block_m(m), bk, warps, stages)
            row[f"fp8_mm_{bn}x{block_m(m)}x{bk}w{warps}s{stages}"] = timed(
                lambda i, c=config: fp8_mm(xq, xs, w8[i], ws, config=c), len(w8))
    return row


def sweep_gemm(name: str, n: int, k: int, bandwidth: float, ms: tuple[int, ...]) -> list[dict]:
    w16 = copies(n, k, torch.bfloat16)
    w8 = [w.to(torch.float8_e4m3fn) for w in copies(n, k, torch.float32)]
    ws = torch.rand(1, n, device="cuda") * 1e-3 + 1e-4
    rows = []
    for m in ms:
        row = measure(name, n, k, m, w16, w8, ws, bandwidth)
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
                          "scaled_mm_rowwise_ms": round(row["fp8_scaled_mm_rowwise"], 4)}), flush=True)
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
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        w = copies(n, k, dtype)
        fp8 = dtype == torch.float8_e4m3fn
        extra = dict(x_scales=torch.ones(1, 1, device="cuda"), w_scales=torch.full((1, n), 0.01, device="cuda"),
                     out_dtype=torch.bfloat16) if fp8 else {}
        x = (torch.randn(1, k, device="cuda") * 0.5).to(dtype)
        floor_ms = n * k * w[0].element_size() / bandwidth * 1e3  # the same floor as the GEMMs' rows

        def call(i: int, launch: tuple[int, int] | None, w=w, x=x, extra=extra) -> None:
            qkv_rope_store(x, w[i], None, heads, kv_heads, positions, cos, sin, kv, slots, launch=launch, **extra)
        for launch in QKV_LAUNCHES:
            ms = timed(lambda i, launch=launch, call=call: call(i, launch), len(w))
            print(json.dumps({"qkv_rope": "fp8" if fp8 else "bf16", "launch": launch or "default",
                              "ms": round(ms, 4), "floor_ms": round(floor_ms, 4), "x_floor": round(ms / floor_ms, 2)}),
                  flush=True)
        del w
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    parser.add_argument("--gemms", default=None, help="comma-separated subset of the shape's GEMMs")
    parser.add_argument("--ms", default=None, help=f"comma-separated M values (default: {MS})")
    parser.add_argument("--out", default=None)
    parser.add_argument("--qkv-rope", action="store_true", help="only the fused qkv + RoPE + store launches")
    args = parser.parse_args(argv)
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
                    if key.startswith("fp8_mm_") or key.startswith("fp8_gemv_") or key == "fp8_scaled_mm_rowwise":
                        by_key[key] = by_key.get(key, 0.0) + v
        complete = {key: v for key, v in by_key.items()
                    if sum(1 for r in rows if r["m"] == m and r["gemm"] in layer and key in r) == len(layer)}
        if complete:
            best = min(complete, key=complete.get)
            bf16 = sum(min(v for key, v in r.items() if key.startswith("bf16_")) for r in rows
                       if r["m"] == m and r["gemm"] in layer)
            print(json.dumps({"layer_m": m, "best": best, "layer_fp8_ms": round(complete[best], 4),
                              "layer_bf16_ms": round(bf16, 4), "speedup": round(bf16 / complete[best], 3)}), flush=True)


if __name__ == "__main__":
    main()
