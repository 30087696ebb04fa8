"""The decode attention kernel alone (issue 42): `python benchmarks/fp8_gpu.py attention` (`bash
benchmarks/gpu_run.sh fp8attn`, ATTN_ARGS="--cases 64x2048 --graphs --launches fp8:32x1x5;bf16:64x4x4"), and
fp8_gpu.py decode's attention rows (without --skip-attention). Llama-3-8B heads, 16-token blocks, random K/V in a
shuffled block table, on a bf16 and an fp8 cache: each launch configuration and split count, its KV read rate
against the copy bandwidth measured in the same run, the best pair and the speedup over the launch before whole
tiles and V words (BEFORE). benchmarks/attention_counters.py runs the same inputs under Nsight Compute.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.engine_bench_gpu import copy_bandwidth  # noqa: E402
from engine.kernels.decode_launch import AttentionLaunch  # noqa: E402

# Per cache: launches timed at the default split count, and launches timed at every split count. `BEFORE` is the
# kernel as it was before whole tiles and V words (AttentionLaunch's two flags off, the launch it had by default):
# the reference each run prints its new default against.
BEFORE = {"bf16": AttentionLaunch(64, 4, 3, whole_tiles=False, v_words=False, lazy=False),
          "fp8": AttentionLaunch(128, 4, 5, whole_tiles=False, v_words=False, lazy=False)}
ATTENTION_LAUNCHES = {"bf16": (None, AttentionLaunch(64, 4, 4), AttentionLaunch(128, 4, 3),
                               AttentionLaunch(32, 1, 4)),
                      "fp8": (None, AttentionLaunch(64, 4, 3), AttentionLaunch(128, 4, 3), AttentionLaunch(128, 8, 5))}
ATTENTION_SPLITS = (None, 1, 2, 4, 8, 16, 32)
# crossed with every split count (fewer programs fit a SM than the default splits assume, or more)
ATTENTION_BY_SPLITS = {"bf16": (BEFORE["bf16"], AttentionLaunch(64, 4, 3)),
                       "fp8": (BEFORE["fp8"], AttentionLaunch(128, 4, 5), AttentionLaunch(64, 4, 4),
                               AttentionLaunch(32, 1, 4), AttentionLaunch(64, 2, 4))}  # (32, 1, 4): before 5 stages


ATTENTION_HEADS, ATTENTION_KV_HEADS, ATTENTION_HEAD_DIM, ATTENTION_BLOCK = 32, 8, 128, 16  # Llama-3-8B, 16-token blocks


def attention_inputs(batch: int, context: int, device: str = "cuda") -> tuple[torch.Tensor, ...]:
    """The decode attention's inputs at `batch` x `context` (every row the same length): q [B, 32, 128] bf16, a
    block table [B, blocks a row] int32 of shuffled distinct blocks, context_lens [B] int32 and a bf16 cache
    [blocks + 8, 2, 16, 8, 128] of random K/V (benchmarks/attention_counters.py runs the same inputs)."""
    per_seq = -(-context // ATTENTION_BLOCK)
    blocks = batch * per_seq + 8
    q = torch.randn(batch, ATTENTION_HEADS, ATTENTION_HEAD_DIM, device=device, dtype=torch.bfloat16)
    tables = torch.randperm(blocks - 8, device=device)[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    cache = torch.randn(blocks, 2, ATTENTION_BLOCK, ATTENTION_KV_HEADS, ATTENTION_HEAD_DIM, device=device,
                        dtype=torch.bfloat16)
    return q, tables, lens, cache


def attention_variants(bandwidth: float, batch: int = 16, context: int = 8000, repeats: int = 3,
                       graphs: bool = False, by_splits: dict | None = None) -> None:
    """The decode attention kernel alone on a bf16 and an fp8 cache (Llama-3-8B heads, 16-token blocks, random
    K/V): its KV read rate against the copy bandwidth for each launch configuration (at the default split count)
    and each split count (at the default launch), then the best pair of the two. The GPU is kept busy for a second
    first (its clocks ramp up: the first variant timed from idle read up to 1.5x slow), then every variant is timed
    `repeats` times, interleaved, and reported by its median. `graphs`: each call replayed in a CUDA graph with the
    splits' semaphores kept, as a decode step runs it (at batch 1 a plain launch's own cost and the scratch
    tensors' allocation are most of what do_bench times). `by_splits` {cache: launches} replaces
    ATTENTION_BY_SPLITS for the caches it names and leaves out the others (their reference launches stay)."""
    import statistics
    import time

    from triton.testing import do_bench

    def bench(fn) -> float:
        return do_bench_cudagraph(fn, rep=20, return_mode="median") if graphs else do_bench(
            fn, warmup=5, rep=40, return_mode="median")

    from engine.kernels.decode_attention import decode_attention
    kv_heads, d = ATTENTION_KV_HEADS, ATTENTION_HEAD_DIM
    q, tables, lens, base = attention_inputs(batch, context)
    out = torch.empty_like(q)
    sems = torch.zeros((batch, kv_heads), dtype=torch.int32, device="cuda")  # left zero by every call
    for name, layer in (("bf16", base), ("fp8", base.to(torch.float8_e4m3fn))):
        if by_splits is not None and name not in by_splits:
            continue
        nbytes = batch * context * 2 * kv_heads * d * layer.element_size()
        variants = [(launch, None) for launch in ATTENTION_LAUNCHES[name]]
        launches = (BEFORE[name], *by_splits[name]) if by_splits else ATTENTION_BY_SPLITS[name]
        variants += [(launch, s) for launch in launches for s in ATTENTION_SPLITS]
        begin = time.perf_counter()
        while time.perf_counter() - begin < 1.0:
            decode_attention(q, layer, tables, lens, d ** -0.5)
            torch.cuda.synchronize()
        times: dict = {}
        for _ in range(repeats):
            for launch, splits in variants:
                if times.get((launch, splits), []) is None:
                    continue  # failed before
                try:
                    ms = bench(lambda launch=launch, splits=splits, layer=layer: decode_attention(
                        q, layer, tables, lens, d ** -0.5, launch=launch, num_splits=splits, out=out,
                        semaphores=sems))
                except Exception as e:  # noqa: BLE001 (a configuration the GPU cannot run: reported)
                    print(json.dumps({"attention": name, "launch": launch, "splits": splits,
                                      "error": str(e).splitlines()[0][:120]}))
                    times[(launch, splits)] = None
                    continue
                times.setdefault((launch, splits), []).append(ms)
        medians = {key: statistics.median(v) for key, v in times.items() if v}
        for (launch, splits), ms in medians.items():
            runs = times[(launch, splits)]
            print(json.dumps({"attention": name, "launch": launch or "default", "splits": splits or "default",
                              "batch": batch, "context": context, "ms": round(ms, 4),
                              "min_ms": round(min(runs), 4), "max_ms": round(max(runs), 4),
                              "gb_per_s": round(nbytes / ms / 1e6, 1),
                              "x_copy": round(nbytes / ms / 1e6 / (bandwidth / 1e9), 3)}), flush=True)
        if medians:
            (launch, splits), ms = min(medians.items(), key=lambda item: item[1])
            default = medians.get((None, None))
            print(json.dumps({"attention_best": name, "batch": batch, "context": context, "launch": launch or "default",
                              "splits": splits or "default", "ms": round(ms, 4),
                              "default_ms": None if default is None else round(default, 4),
                              "x_copy": round(nbytes / ms / 1e6 / (bandwidth / 1e9), 3)}), flush=True)
            before = {splits: ms for (launch, splits), ms in medians.items() if launch == BEFORE[name]}
            if before and default is not None:
                splits, ms = min(before.items(), key=lambda item: item[1])
                print(json.dumps({"attention_vs_before": name, "batch": batch, "context": context,
                                  "before_ms": round(ms, 4), "before_splits": splits or "default",
                                  "default_ms": round(default, 4), "speedup": round(ms / default, 3),
                                  "x_copy": round(nbytes / default / 1e6 / (bandwidth / 1e9), 3)}), flush=True)


def parse_launches(text: str) -> dict[str, tuple[AttentionLaunch, ...]]:
    """--launches "fp8:32x1x4,32x1x4s;bf16:64x4x5" (tokens a tile x warps x stages, an `s` after the stages for
    the swapped form (AttentionLaunch.swapped), caches apart by ";") -> {"fp8": launches, "bf16": launches};
    anything else refused, a cache named twice too."""
    parsed: dict[str, tuple[AttentionLaunch, ...]] = {}
    for group in text.split(";"):
        cache, _, launches = group.partition(":")
        found = []
        for launch in launches.split(","):
            swapped = launch.endswith("s")
            values = launch.removesuffix("s").split("x")
            if len(values) != 3 or not all(v.isdigit() and int(v) > 0 for v in values):
                found = []
                break
            found.append(AttentionLaunch(*(int(v) for v in values), swapped=swapped))
        if cache not in ("bf16", "fp8") or not found or cache in parsed:
            raise SystemExit(f"--launches: {group!r} of {text!r} is not CACHE:NxWxS[s],... with CACHE bf16 or fp8 "
                             "(each once) and positive numbers")
        parsed[cache] = tuple(found)
    return parsed


def attention(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this times the decode attention kernel")
    bandwidth = copy_bandwidth()
    print(json.dumps({"case": "ceilings", "device": torch.cuda.get_device_name(),
                      "copy_gb_per_s": round(bandwidth / 1e9, 1)}), flush=True)
    by_splits = None if args.launches is None else parse_launches(args.launches)
    for case in args.cases.split(","):
        batch, context = (int(v) for v in case.split("x"))
        attention_variants(bandwidth, batch, context, args.repeats, args.graphs, by_splits)
