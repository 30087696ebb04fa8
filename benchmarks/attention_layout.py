"""The decode attention kernel alone, two questions at once (issue 42): does the fp8 cache's low read rate (~0.67x
copy at batch 64 / 2k on an H200, bf16's ~0.92x) come from the cache's layout, and does the lazy softmax (acc
rescaled only when the running max moves by 2^8) speed the loop up? `python benchmarks/attention_layout.py
[--cases 64x2048,16x8000,1x1024]` (`bash benchmarks/gpu_run.sh attnlayout`).

Layouts: the engine's token-major block [bs, KVH, D] (a token's heads side by side: a program reads D elements of a
token, then skips the other heads: 128-byte runs on an fp8 cache, 256 on bf16) and a head-major block [KVH, bs, D]
(one head's bs tokens contiguous: bs x D elements in one run), the same data handed to the same kernel as a strided
view. Each variant replayed in a CUDA graph (as a decode step runs it), `--repeats` times interleaved, its median and
its KV read rate against the copy bandwidth measured in the same run, then each change's ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.attention_bench import ATTENTION_KV_HEADS, attention_inputs  # noqa: E402
from benchmarks.engine_bench_gpu import copy_bandwidth  # noqa: E402


def head_major(layer: torch.Tensor) -> torch.Tensor:
    """The same values as `layer` [NB, 2, bs, KVH, D], stored [NB, 2, KVH, bs, D], viewed back in the kernel's
    [NB, 2, bs, KVH, D] order (strides: tokens D apart, heads bs * D apart)."""
    return layer.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)


def variants(layer: torch.Tensor) -> dict[tuple[str, bool], torch.Tensor]:
    """(layout, lazy) -> the cache view to read."""
    other = head_major(layer)
    return {(name, lazy): view for name, view in (("token-major", layer), ("head-major", other))
            for lazy in (False, True)}


def case(batch: int, context: int, bandwidth: float, repeats: int) -> None:
    q, tables, lens, base = attention_inputs(batch, context)
    for cache, layer in (("bf16", base), ("fp8", base.to(torch.float8_e4m3fn))):
        time_cache(cache, layer, q, tables, lens, bandwidth, repeats)


def time_cache(cache: str, layer: torch.Tensor, q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
               bandwidth: float, repeats: int) -> None:
    """Every (layout, lazy) variant of one cache: a row each, then the ratios against the engine's layout, exact."""
    from triton.testing import do_bench_cudagraph

    from engine.kernels.decode_attention import decode_attention
    from engine.kernels.decode_launch import launch_config

    batch, d = q.shape[0], q.shape[2]
    context = int(lens[0])
    sems = torch.zeros((batch, ATTENTION_KV_HEADS), dtype=torch.int32, device="cuda")
    launch = launch_config(q.dtype, d, cache == "fp8", batch * ATTENTION_KV_HEADS)
    views = variants(layer)
    outs = {key: torch.empty_like(q) for key in views}

    def run(key: tuple[str, bool]) -> None:
        decode_attention(q, views[key], tables, lens, d ** -0.5, out=outs[key], semaphores=sems,
                         launch=launch._replace(lazy=key[1]))

    begin = time.perf_counter()
    while time.perf_counter() - begin < 1.0:  # clocks up before the first timing
        run(("token-major", False))
        torch.cuda.synchronize()
    times: dict = {key: [] for key in views}
    for _ in range(repeats):
        for key in views:
            times[key].append(do_bench_cudagraph(lambda key=key: run(key), rep=20, return_mode="median"))
    ref = outs[("token-major", False)].float()
    nbytes = batch * context * 2 * ATTENTION_KV_HEADS * d * layer.element_size()
    ms = {key: statistics.median(v) for key, v in times.items()}
    for key, value in ms.items():
        print(json.dumps({"attention": cache, "batch": batch, "context": context, "layout": key[0],
                          "lazy": key[1], "launch": launch[:3], "ms": round(value, 4),
                          "x_copy": round(nbytes / value / 1e6 / (bandwidth / 1e9), 3),
                          "max_abs_diff": float((outs[key].float() - ref).abs().max())}), flush=True)
    base_ms = ms[("token-major", False)]
    print(json.dumps({"attention_summary": cache, "batch": batch, "context": context, "exact_ms": round(base_ms, 4),
                      "head_major_x": round(base_ms / ms[("head-major", False)], 3),
                      "lazy_x": round(base_ms / ms[("token-major", True)], 3),
                      "both_x": round(base_ms / ms[("head-major", True)], 3)}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="64x2048,16x8000,1x1024", help="comma-separated BATCHxCONTEXT")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timings of each variant (median reported)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this times the decode attention kernel")
    bandwidth = copy_bandwidth()
    print(json.dumps({"case": "ceilings", "device": torch.cuda.get_device_name(),
                      "copy_gb_per_s": round(bandwidth / 1e9, 1)}), flush=True)
    for text in args.cases.split(","):
        batch, context = (int(v) for v in text.split("x"))
        case(batch, context, bandwidth, args.repeats)


if __name__ == "__main__":
    main()
