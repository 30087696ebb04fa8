"""Measures what chose the KV layout: `python benchmarks/kv_layout.py` (one JSON line per measurement).

Compares, for a Llama-3-8B-shaped cache (32 layers, 8 KV heads, head dim 128, 16-token blocks):
- block-major  kv[blocks, layers, 2, 16, heads, dim]   (pdserve's layout)
- layer-major  per layer kv[2, blocks, 16, heads, dim] (vLLM's usual layout)
on (1) how many contiguous regions one request's KV spans after realistic allocator churn, which is the number
of messages or copy descriptors a transfer needs, and (2) the time to pack one request's KV into a contiguous
staging buffer on this machine, against a plain memcpy of the same bytes (the ceiling).
"""

from __future__ import annotations

import json
import random
import time

import torch

from engine.core.block_manager import BlockManager
from engine.kv_layout import block_runs

LAYERS, HEADS, DIM, BS = 32, 8, 128, 16


def churn_runs(num_blocks: int = 4096, requests: int = 400, seed: int = 0) -> list[int]:
    """Runs of consecutive block ids per request, admitted while others finish in random order."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=False)
    live: list[str] = []
    runs = []
    for i in range(requests):
        while live and (rng.random() < 0.5 or not bm.allocate("probe", 1)):
            bm.free(live.pop(rng.randrange(len(live))))
        bm.free("probe")
        tokens = rng.randint(100, 4000)
        if bm.allocate(f"r{i}", tokens):
            live.append(f"r{i}")
            runs.append(len(block_runs(bm.table(f"r{i}"))))
    return runs


def pack_seconds(cache: torch.Tensor, ids: list[int], block_dim: int, reps: int = 3) -> float:
    """Copy the request's blocks run by run (one copy per contiguous region) into a staging buffer."""
    regions = [cache.narrow(block_dim, first, n) for first, n in block_runs(ids)]
    if block_dim:  # layer-major: every run is split across the layer and K/V dimensions
        regions = [r[layer, kv] for r in regions for layer in range(LAYERS) for kv in range(2)]
    staging = torch.empty(sum(r.numel() for r in regions), dtype=cache.dtype)
    best = float("inf")
    for _ in range(reps):
        start, offset = time.perf_counter(), 0
        for r in regions:
            staging[offset:offset + r.numel()].view_as(r).copy_(r)
            offset += r.numel()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    runs = sorted(churn_runs())
    median_runs = runs[len(runs) // 2]
    print(json.dumps({"measure": "regions_per_request", "requests": len(runs), "median_runs": median_runs,
                      "p90_runs": runs[int(0.9 * len(runs))], "block_major_regions": median_runs,
                      "layer_major_regions": median_runs * LAYERS * 2}))
    num_blocks, req_blocks = 1024, 64  # a 1k-token request in a 16k-token cache
    block_major = torch.randn(num_blocks, LAYERS, 2, BS, HEADS, DIM, dtype=torch.bfloat16)
    layer_major = block_major.permute(1, 2, 0, 3, 4, 5).contiguous()  # [L, 2, blocks, ...] = per-layer tensors
    nbytes = req_blocks * LAYERS * 2 * BS * HEADS * DIM * 2
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    t_copy = min(_timed(lambda: dst.copy_(src)) for _ in range(3))
    start = 100
    for case, ids in (("median_churn", list(range(start, start + req_blocks))),
                      ("scattered", sorted(random.Random(1).sample(range(num_blocks), req_blocks)))):
        for name, t in (("block_major", pack_seconds(block_major, ids, 0)),
                        ("layer_major", pack_seconds(layer_major, ids, 2))):
            print(json.dumps({"measure": "pack_request", "case": case, "layout": name, "bytes": nbytes,
                              "seconds": round(t, 5), "gb_per_s": round(nbytes / t / 1e9, 2),
                              "memcpy_gb_per_s": round(nbytes / t_copy / 1e9, 2), "ratio": round(t_copy / t, 3)}))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
