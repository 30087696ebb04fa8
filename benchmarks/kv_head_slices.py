"""What a head-sliced transfer costs on the serving and the reading side: gathering a slice of the KV heads of
scattered blocks into staging (and scattering it back) against gathering all heads, Llama-3-8B KV shape.

    python benchmarks/kv_head_slices.py [--device cuda] [--blocks 64] [--repeat 20]

Prints one JSON line per case: heads moved of 8, bytes, GB/s of the bytes moved, for gather and scatter.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine.kv_heads import KVHeadRange
from engine.kv_layout import KVCacheSpec
from kvtransfer.cache import RegisteredCache


def _timed(fn, repeat: int, device: torch.device) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / repeat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    device = torch.device(args.device)
    spec = KVCacheSpec("bench", num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
    kv = torch.zeros(spec.shape(4 * args.blocks), dtype=torch.bfloat16, device=device)
    cache = RegisteredCache(kv, spec, KVHeadRange.full(8))
    ids = list(range(0, 4 * args.blocks, 4))  # scattered: never one region
    layers = (0, spec.num_layers)
    for count in (8, 4, 2, 1):
        slots = None if count == 8 else (0, count)
        nbytes = args.blocks * spec.block_bytes * count // 8
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        g = _timed(lambda: cache.gather(ids, layers, buf, slots), args.repeat, device)  # noqa: B023
        s = _timed(lambda: cache.scatter(ids, layers, buf, slots), args.repeat, device)  # noqa: B023
        print(json.dumps({"device": str(device), "heads": f"{count}/8", "bytes": nbytes,
                          "gather_GBps": round(nbytes / g / 1e9, 2), "scatter_GBps": round(nbytes / s / 1e9, 2)}))


if __name__ == "__main__":
    main()
