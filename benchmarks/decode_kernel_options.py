"""Small-batch decode kernels on a GPU, each next to the device copy bandwidth of the same run (one JSON line each).

`python benchmarks/decode_kernel_options.py [--sweep]`:
- the Llama-3-8B projections at M = 1, 2 and 8 rows: cuBLAS (F.linear) against engine.kernels.skinny_gemm with
  its own launch configuration, and with --sweep every configuration of a grid (to choose
  skinny_gemm.launch_config);
- decode attention at batch 1, 1k context, with the splits a graph of the engine gets (max model length 8192).
Each figure times 32 calls on 32 different weights / KV layers (as one decode step meets them, so nothing is
served from L2) captured in one CUDA graph: microseconds per call, and bytes moved per call / time as a fraction
of copy bandwidth (a 2 GiB copy_ timed outside a graph: captured, it becomes a slower copy-engine memcpy node).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from engine.kernels import skinny_gemm
from engine.kernels.decode_attention import decode_attention

LAYERS = 32
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SWEEP = {1: [(1, 2048, 4), (2, 2048, 4), (4, 2048, 4), (1, 4096, 4), (2, 4096, 4), (2, 4096, 8), (4, 4096, 8),
             (1, 8192, 8), (2, 8192, 8), (1, 16384, 8), (8, 1024, 4), (4, 1024, 4)],
         2: [(2, 4096, 4), (4, 2048, 4), (4, 4096, 8)],
         8: [(2, 4096, 4), (4, 2048, 4), (4, 4096, 8)]}


def graph_us(calls) -> float:
    """Median microseconds per call of a CUDA graph holding every call of `calls` (a list of thunks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def copy_bandwidth() -> float:
    src = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def projections(bandwidth: float, sweep: bool) -> None:
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(LAYERS)]
        for m in (1, 2, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
            nbytes = n * k * 2
            cublas = [lambda w=w, x=x: F.linear(x, w) for w in weights]
            rows = [("cublas", None, graph_us(cublas))]
            default = skinny_gemm.launch_config(m, n, k)
            configs = SWEEP[m] if sweep else []
            for cfg in [default] + [c for c in configs if c != default]:
                skinny_gemm.launch_config = lambda m_, n_, k_, cfg=cfg: cfg
                calls = [lambda w=w, o=o, x=x: skinny_gemm.skinny_linear(x, w, out=o)
                         for w, o in zip(weights, outs, strict=True)]
                rows.append(("skinny", cfg, graph_us(calls)))
            skinny_gemm.launch_config = _default_config
            ref = F.linear(x, weights[0]).float()
            err = ((outs[0].float() - ref).norm() / ref.norm()).item()
            for kind, cfg, us in rows:
                print(json.dumps({"proj": name, "m": m, "kind": kind, "config": cfg, "us": round(us, 2),
                                  "gb_per_s": round(nbytes / us / 1e3, 1),
                                  "ratio": round(nbytes / us / 1e3 / (bandwidth / 1e9), 3)}), flush=True)
            print(json.dumps({"proj": name, "m": m, "skinny_rel_err_vs_cublas": round(err, 5)}), flush=True)
        del weights
        torch.cuda.empty_cache()


def attention(bandwidth: float, context: int = 1024, max_len: int = 8192) -> None:
    heads, kvh, d, bs = 32, 8, 128, 16
    nb = context // bs
    cache = torch.randn(nb + 1, LAYERS, 2, bs, kvh, d, device="cuda", dtype=torch.bfloat16)
    tables = torch.zeros(1, max_len // bs, dtype=torch.int32, device="cuda")
    tables[0, :nb] = torch.randperm(nb, device="cuda").to(torch.int32)
    lens = torch.tensor([context], dtype=torch.int32, device="cuda")
    q = torch.randn(1, heads, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    sem = torch.zeros(1, kvh, dtype=torch.int32, device="cuda")
    us = graph_us([lambda i=i: decode_attention(q, cache[:, i], tables, lens, d ** -0.5, out=out, semaphores=sem)
                   for i in range(LAYERS)])
    nbytes = context * kvh * d * 2 * 2
    print(json.dumps({"attention": f"batch 1, {context} context, table width {max_len // bs}", "us": round(us, 2),
                      "gb_per_s": round(nbytes / us / 1e3, 1),
                      "ratio": round(nbytes / us / 1e3 / (bandwidth / 1e9), 3)}), flush=True)


_default_config = skinny_gemm.launch_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time every skinny_gemm configuration of the grid")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(json.dumps({"device": torch.cuda.get_device_name(), "copy_gb_per_s": round(bandwidth / 1e9, 1)}), flush=True)
    attention(bandwidth)
    projections(bandwidth, args.sweep)


if __name__ == "__main__":
    main()
