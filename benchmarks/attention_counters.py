"""The decode attention kernel's launches, each called twice, for Nsight Compute to read its hardware counters:
`bash benchmarks/gpu_run.sh attnncu` (ATTNNCU_ARGS="--cases 64x2048 --launches fp8:32x1x4,32x1x5"). It times
nothing itself: ncu profiles every launch of `_decode_split_kernel` (the first call of each compiles it, so each
variant's second launch is the one to read) and gpu_run.sh prints each launch's duration, DRAM throughput,
occupancy, issue rate and its warps' stall reasons. Llama-3-8B heads (32 query, 8 KV, 128 wide), 16-token blocks,
random K/V in a shuffled block table, every context the same (benchmarks/attention_bench.attention_inputs); the default
launch of a bf16 and an fp8 cache first, then each launch asked for (--launches, as benchmarks/fp8_gpu.py attention
takes it) at the split count given.
Its steps ran on an H100 as an uncommitted script (2026-12-05, docs/benchmark-log.md); this program itself has not
yet run on a GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.attention_bench import ATTENTION_HEAD_DIM, attention_inputs, parse_launches  # noqa: E402
from engine.kernels.decode_attention import decode_attention  # noqa: E402


def run_case(batch: int, context: int, launches: dict, splits: int | None) -> None:
    q, tables, lens, kv = attention_inputs(batch, context)
    caches = {"bf16": kv, "fp8": kv.to(torch.float8_e4m3fn)}
    variants = [(cache, None, None) for cache in ("bf16", "fp8")]
    variants += [(cache, launch, splits) for cache, chosen in launches.items() for launch in chosen]
    for cache, launch, num_splits in variants:
        for _ in range(2):  # the first compiles; ncu reads both, the second is the one to compare
            decode_attention(q, caches[cache], tables, lens, ATTENTION_HEAD_DIM ** -0.5, launch=launch,
                             num_splits=num_splits)
        torch.cuda.synchronize()
        print(f"variant {batch}x{context} {cache} {tuple(launch) if launch else 'default'} splits "
              f"{num_splits or 'default'}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="64x2048", help="comma-separated BATCHxCONTEXT")
    parser.add_argument("--launches", default=None, help="CACHE:NxWxS,... (benchmarks/fp8_gpu.py attention's form)")
    parser.add_argument("--splits", type=int, default=None, help="split count for the --launches variants")
    args = parser.parse_args()
    launches = parse_launches(args.launches) if args.launches else {}
    if args.splits is not None and args.splits < 1:
        raise SystemExit(f"--splits must be >= 1, got {args.splits}")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this runs the decode attention kernel for Nsight Compute")
    for case in args.cases.split(","):
        batch, context = (int(v) for v in case.split("x"))
        run_case(batch, context, launches, args.splits)


if __name__ == "__main__":
    main()
