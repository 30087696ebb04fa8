"""FP8 on one GPU (issue 42): whole decode and prefill steps with FP8 weights and the fp8 KV cache against bfloat16,
and each GEMM way per M. Produces docs/benchmarks.md's "FP8 on one GPU (issue 42)" rows (P and E: `decode`, `bash
benchmarks/gpu_run.sh fp8`; S: `gemm-sweep`, `bash benchmarks/gpu_run.sh fp8sweep`).

`python benchmarks/fp8_gpu.py COMMAND [options]`:

- `decode --bf16 /tmp/l8bd --fp8 /tmp/l8bd-fp8 --load-format dummy` (`bash benchmarks/gpu_run.sh fp8` writes both
  8B-shaped folders with make_random_checkpoint.py, the FP8 one with `--fp8 channel`, and runs this). Prints one
  JSON line per case, in one process on one GPU, each figure next to its reference measured in the same run:
  the ceilings (engine_bench_gpu.ceilings: copy bandwidth, bf16 matmul);
  per checkpoint: decode at batch 1 (1k context) and batch 64 (2k context), the median engine.step() time against
  its floor (weights read per step, each parameter in its own bytes, + KV read and written, over the copy
  bandwidth: the FP8 line's floor is the FP8 weight-read floor), the bare graph replay, and the host time per step
  by phase (engine_bench_gpu.HostPhases); prefill of one 2,048-token prompt against the matmul rate;
  FP8 against bfloat16: the speedup of each decode case and of the prefill;
  the fp8 KV cache (bfloat16 weights): its capacity in tokens against the bfloat16 cache's for the same bytes, and
  decode at batch 16 with an 8k context (where reading the KV is most of the step) against the bfloat16 cache;
  FP8 weights with the fp8 KV cache (how FP8 is served on Hopper) against bfloat16, at batch 1 and 64: at batch 64
  with a 2k context the KV read is more than the weights' (17 GB against 8), so FP8 weights alone can speed the
  step up by at most its floor ratio (1.27x), both together by 1.9x;
  the decode attention kernel alone on both caches, per launch configuration (--skip-attention: not).
  It refuses to print a figure that would describe something else: a GPU without FP8 tensor cores (compute
  capability below 8.9), two folders of different shapes, an "FP8" engine that built no FP8 linear, or a bf16 one
  that did.
- `gemm-sweep [--shape llama-3-8b] [--out sweep.json]`: one decoder layer's GEMMs (and the LM head) at each
  decode/prefill size M, every way pdserve can run them, against the weight-read floor measured in the same run;
  picks engine.kernels.fp8_gemm's launch table. Per (GEMM, M): bfloat16 (cuBLAS; the skinny GEMV for M <= 16), FP8
  with torch._scaled_mm (row-wise scales, as the dynamic per-token scheme needs, and per-tensor for reference), the
  FP8 GEMV (M <= 16) and the FP8 tensor-core kernel (each launch configuration in CONFIGS). Timed as CUDA-graph
  replays (triton.testing.do_bench_cudagraph, median) over enough copies of the weight that L2 (60 MB on an H200)
  never holds it, the way the engine replays a decode step; the floor is the weight's bytes over the copy bandwidth
  measured first. Prints one JSON line per (GEMM, M) and the best configuration per M bucket; --out keeps every
  figure. `--qkv-rope`: only the fused q/k/v GEMV + RoPE + KV store's launches.

- `pdl --bf16 ... --fp8 ...` (`bash benchmarks/gpu_run.sh pdl`): the decode cases with programmatic dependent
  launch (engine.kernels.pdl, on by default on Hopper) against `PDSERVE_PDL=0`, bf16 and FP8 + fp8 KV.

(Until f1a5769 these were two programs: fp8_decode_gpu.py and fp8_gemm_sweep.py.)
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.engine_bench_gpu import Bench, ceilings  # noqa: E402
from engine.kernels.decode_launch import AttentionLaunch  # noqa: E402
from engine.kernels.fp8_gemm import fp8_gemv, fp8_mm, mm_config  # noqa: E402
from engine.kernels.silu_mul import silu_and_mul  # noqa: E402
from engine.kernels.skinny_gemm import skinny_linear  # noqa: E402
from engine.model.fp8_linear import Fp8Linear  # noqa: E402
from engine.model.model_config import ModelConfig  # noqa: E402

CASES = ((1, 1024), (64, 2048))
LONG_CONTEXT = (16, 8000)  # the fp8 KV cache's case: batch, context (+ the steps within max_model_len 8192)


def check_inputs(bf16: str, fp8: str) -> None:
    """SystemExit unless the GPU runs FP8 matmuls and the folders are one shape, bfloat16 and FP8."""
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark times FP8 tensor-core matmuls")
    if torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit(f"{torch.cuda.get_device_name()} (compute capability {torch.cuda.get_device_capability()}) "
                         "has no FP8 tensor cores (Ada 8.9 or Hopper 9.0 needed)")
    a, b = ModelConfig.from_folder(bf16), ModelConfig.from_folder(fp8)
    if a.fingerprint != b.fingerprint:
        raise SystemExit(f"{bf16} and {fp8} are different model shapes")
    if a.fp8 is not None or b.fp8 is None:
        raise SystemExit(f"--bf16 must be a 16-bit checkpoint ({bf16}: fp8 {a.fp8}) and --fp8 an FP8 one "
                         f"({fp8}: {b.fp8})")


def close(bench: Bench) -> None:
    """Close the engine and hand its memory back to the device. The engine goes first: while it is referenced its
    KV cache stays allocated, and the next engine's weights would be carved out of that freed-but-cached segment,
    leaving no room for the next cache on an 80 GB card (H100: an OOM at the third engine of `decode`)."""
    bench.engine.close()
    bench.engine = None
    gc.collect()
    torch.cuda.empty_cache()


def engine_tag(bench: Bench, folder: str, fp8: bool, kv_cache_dtype: str) -> dict:
    """What a row's engine was: weights, KV dtype, weight bytes, FP8 linears, KV capacity; refuses an engine whose
    linears are not what the checkpoint promised. (A function of its own: its locals must not outlive the engine.)"""
    e = bench.engine
    layers = [m for m in e.model.modules() if isinstance(m, Fp8Linear)]
    if bool(layers) != fp8:
        raise SystemExit(f"{folder}: the engine built {len(layers)} FP8 linears; expected {'some' if fp8 else 'none'}")
    if fp8 and not all(m.weight.is_cuda and m.weight.dtype == torch.float8_e4m3fn for m in layers):
        raise SystemExit(f"{folder}: an FP8 linear's weight is not float8_e4m3fn on the GPU")
    return {"weights": "fp8" if fp8 else "bf16", "kv_cache_dtype": kv_cache_dtype, "weight_bytes": bench.weight_bytes,
            "fp8_linears": len(layers), "kv_tokens": e.num_kv_blocks * e.kv_spec.block_size}


def measure(folder: str, fp8: bool, bandwidth: float, flops: float, kv_bytes: int, load_format: str,
            cases: list[str], kv_cache_dtype: str = "auto", profile: bool = False,
            trace_dir: str | None = None, events: bool = False) -> dict[str, dict]:
    """One engine's rows by case name: "decode1", "decode64" (CASES), "prefill" (1 x 2,048) and "long"
    (LONG_CONTEXT), each tagged with the weights, the KV cache dtype and the KV capacity in tokens."""
    bench = Bench(folder, bandwidth, flops, kv_bytes, load_format=load_format, kv_cache_dtype=kv_cache_dtype,
                  profile=profile, trace_dir=trace_dir, events=events,
                  trace_tag=f"{'fp8' if fp8 else 'bf16'}-kv{kv_cache_dtype}")
    try:
        tag = engine_tag(bench, folder, fp8, kv_cache_dtype)
        rows = {}
        for name in cases:
            if name == "prefill":
                rows[name] = bench.prefill([2048]) | tag
            else:
                batch, context = {"decode1": CASES[0], "decode64": CASES[1], "long": LONG_CONTEXT}[name]
                rows[name] = bench.decode(batch, context) | tag
            print(json.dumps(rows[name]), flush=True)
        return rows
    finally:
        close(bench)


def compare(label: str, base: dict, new: dict, key: str = "step_ms") -> None:
    print(json.dumps({"case": label, "reference_ms": base[key], "ms": new[key],
                      "speedup": round(base[key] / new[key], 3), "x_floor": new.get("x_floor"),
                      "reference_x_floor": base.get("x_floor")}), flush=True)


# Per cache: launches timed at the default split count, and launches timed at every split count. `BEFORE` is the
# kernel as it was before whole tiles and V words (AttentionLaunch's two flags off, the launch it had by default):
# the reference each run prints its new default against.
BEFORE = {"bf16": AttentionLaunch(64, 4, 3, whole_tiles=False, v_words=False),
          "fp8": AttentionLaunch(128, 4, 5, whole_tiles=False, v_words=False)}
ATTENTION_LAUNCHES = {"bf16": (None, AttentionLaunch(64, 4, 4), AttentionLaunch(128, 4, 3),
                               AttentionLaunch(32, 1, 4)),
                      "fp8": (None, AttentionLaunch(64, 4, 3), AttentionLaunch(128, 4, 3), AttentionLaunch(128, 8, 5))}
ATTENTION_SPLITS = (None, 1, 2, 4, 8, 16, 32)
# crossed with every split count (fewer programs fit a SM than the default splits assume, or more)
ATTENTION_BY_SPLITS = {"bf16": (BEFORE["bf16"], AttentionLaunch(64, 4, 3)),
                       "fp8": (BEFORE["fp8"], AttentionLaunch(128, 4, 5), AttentionLaunch(64, 4, 4),
                               AttentionLaunch(32, 1, 4), AttentionLaunch(64, 2, 4))}


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
    """--launches "fp8:32x1x4,16x2x4;bf16:64x4x5" (tokens a tile x warps x stages, caches apart by ";") ->
    {"fp8": launches, "bf16": launches}; anything else refused, a cache named twice too."""
    parsed: dict[str, tuple[AttentionLaunch, ...]] = {}
    for group in text.split(";"):
        cache, _, launches = group.partition(":")
        found = []
        for launch in launches.split(","):
            values = launch.split("x")
            if len(values) != 3 or not all(v.isdigit() and int(v) > 0 for v in values):
                found = []
                break
            found.append(AttentionLaunch(*(int(v) for v in values)))
        if cache not in ("bf16", "fp8") or not found or cache in parsed:
            raise SystemExit(f"--launches: {group!r} of {text!r} is not CACHE:NxWxS,... with CACHE bf16 or fp8 "
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


def decode(args: argparse.Namespace) -> None:
    check_inputs(args.bf16, args.fp8)
    bandwidth, flops = ceilings()
    print(json.dumps({"case": "ceilings", "device": torch.cuda.get_device_name(), "copy_gb_per_s":
                      round(bandwidth / 1e9, 1), "matmul_tflops": round(flops / 1e12, 1)}), flush=True)
    kv_bytes = int(args.kv_gib * (1 << 30))
    if not args.skip_attention:
        attention_variants(bandwidth)
    if args.only:
        fp8 = args.only == "fp8"
        measure(args.fp8 if fp8 else args.bf16, fp8, bandwidth, flops, kv_bytes, args.load_format,
                ["decode1", "decode64", "prefill"], profile=args.profile, trace_dir=args.trace_dir,
                events=args.events)
        return
    if args.kv_rows:  # what the fp8 cache's attention changes: bf16, FP8 + fp8 KV, fp8 KV at 16 / 8k
        bf16 = measure(args.bf16, False, bandwidth, flops, kv_bytes, args.load_format, ["decode1", "decode64", "long"])
        both = measure(args.fp8, True, bandwidth, flops, kv_bytes, args.load_format, ["decode1", "decode64"],
                       kv_cache_dtype="fp8")
        for name in ("decode1", "decode64"):
            compare(f"fp8 weights + fp8 KV vs bf16, {bf16[name]['case']}", bf16[name], both[name])
        kv8 = measure(args.bf16, False, bandwidth, flops, kv_bytes, args.load_format, ["long"], kv_cache_dtype="fp8")
        compare(f"fp8 KV vs bf16 KV (bf16 weights), {bf16['long']['case']}", bf16["long"], kv8["long"])
        return
    bf16 = measure(args.bf16, False, bandwidth, flops, kv_bytes, args.load_format,
                   ["decode1", "decode64", "prefill", "long"], profile=args.profile, trace_dir=args.trace_dir)
    fp8 = measure(args.fp8, True, bandwidth, flops, kv_bytes, args.load_format, ["decode1", "decode64", "prefill"],
                  trace_dir=args.trace_dir)
    kv8 = measure(args.bf16, False, bandwidth, flops, kv_bytes, args.load_format, ["long"], kv_cache_dtype="fp8")
    both = measure(args.fp8, True, bandwidth, flops, kv_bytes, args.load_format, ["decode1", "decode64"],
                   kv_cache_dtype="fp8", trace_dir=args.trace_dir)
    for name in ("decode1", "decode64"):
        compare(f"fp8 weights vs bf16, {bf16[name]['case']}", bf16[name], fp8[name])
        compare(f"fp8 weights + fp8 KV vs bf16, {bf16[name]['case']}", bf16[name], both[name])
    compare("fp8 weights vs bf16, prefill 1 x 2048", bf16["prefill"], fp8["prefill"], key="ms")
    compare(f"fp8 KV vs bf16 KV (bf16 weights), {bf16['long']['case']}", bf16["long"], kv8["long"])
    print(json.dumps({"case": "KV capacity, same bytes", "kv_bytes": kv_bytes,
                      "bf16_kv_tokens": bf16["long"]["kv_tokens"], "fp8_kv_tokens": kv8["long"]["kv_tokens"],
                      "ratio": round(kv8["long"]["kv_tokens"] / bf16["long"]["kv_tokens"], 3)}), flush=True)


def pdl(args: argparse.Namespace) -> None:
    """Each decode case with programmatic dependent launch (engine.kernels.pdl) against ordinary launches, one
    engine each, bfloat16 (bf16 KV) and FP8 weights (fp8 KV), in one process."""
    check_inputs(args.bf16, args.fp8)
    bandwidth, flops = ceilings()
    print(json.dumps({"case": "ceilings", "device": torch.cuda.get_device_name(), "copy_gb_per_s":
                      round(bandwidth / 1e9, 1), "matmul_tflops": round(flops / 1e12, 1)}), flush=True)
    kv_bytes = int(args.kv_gib * (1 << 30))
    cases = [tuple(int(v) for v in case.split("x")) for case in args.cases.split(",")]
    for folder, fp8, kv in ((args.bf16, False, "auto"), (args.fp8, True, "fp8")):
        if args.only and args.only != ("fp8" if fp8 else "bf16"):
            continue
        rows = {}
        for flag in ("0", "1"):
            os.environ["PDSERVE_PDL"] = flag  # read at every launch; the engine captures its graphs under it
            bench = Bench(folder, bandwidth, flops, kv_bytes, load_format=args.load_format, kv_cache_dtype=kv)
            try:
                rows[flag] = [bench.decode(batch, context) for batch, context in cases]
            finally:
                close(bench)
            for row in rows[flag]:
                print(json.dumps(row | {"pdl": flag == "1"}), flush=True)
        for off, on in zip(rows["0"], rows["1"], strict=True):
            compare(f"PDL vs ordinary launches, {'fp8 weights + fp8 KV' if fp8 else 'bf16'}, {off['case']}", off, on)


SHAPES = {"llama-3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                         "lm_head": (128256, 4096)},
          "llama-3-70b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)}}
MS = (1, 2, 4, 16, 32, 64, 128, 256, 2048)
# (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K); BLOCK_M follows M (16, 32, 64)
CONFIGS = tuple(itertools.product((16, 32, 64, 128), (128, 256), (4,), (4,), (1,))) + ((64, 128, 8, 4, 1),
                                                                                      (128, 128, 8, 4, 1))
# K split for the decode sizes (an N = 4,096 GEMM has 64 tiles of 64 rows for 132 SMs)
SPLIT_CONFIGS = tuple((64, 256, 4, stages, split) for stages in (3, 4) for split in (2, 3, 4)) + ((64, 256, 4, 3, 1),)
GEMV_CONFIGS = ((2, 4096, 8), (4, 4096, 8), (4, 2048, 4), (8, 2048, 8))
# (BLOCK_N, BLOCK_K, num_warps, num_stages): the swapped-operand kernel on 16-bit operands (bf16_mm rows), the same
# bytes a K tile as FP8's 256
BF16_MM_CONFIGS = ((64, 128, 4, 4), (64, 128, 4, 5), (128, 64, 4, 4), (128, 128, 8, 4), (32, 128, 4, 4))
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
    return row


def bf16_swapped(x: torch.Tensor, w16: list[torch.Tensor], m: int) -> dict:
    """The FP8 swapped-operand tensor-core kernel (engine.kernels.fp8_gemm) run on bf16 operands with unit scales:
    whether a Triton bf16 GEMM beats cuBLAS at decode sizes. {way: median ms}"""
    from engine.kernels.fp8_gemm import _fp8_mm_kernel
    n, k = w16[0].shape
    xs = torch.ones(m, device="cuda")
    ws = torch.ones(n, device="cuda")
    out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    row = {}
    for bn, bk, warps, stages in BF16_MM_CONFIGS:
        bm = block_m(m)

        def call(i: int, bn=bn, bk=bk, warps=warps, stages=stages, bm=bm) -> None:
            _fp8_mm_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm), 1)](
                x, xs, w16[i], ws, ws, out, out, out, m, n, k, k, x.stride(0), w16[i].stride(0), out.stride(0),
                HAS_BIAS=False, BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk, SPLIT_K=1, DOT_F32=False, PDL=False,
                num_warps=warps, num_stages=stages)
        row[f"bf16_mm_{bn}x{bm}x{bk}w{warps}s{stages}"] = timed(call, len(w16))
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


def checkpoint_args(p: argparse.ArgumentParser) -> None:
    """The two folders `decode` and `pdl` compare, how their weights load and the KV cache's size."""
    p.add_argument("--bf16", required=True, help="a bfloat16 checkpoint folder (e.g. the Llama-3-8B shape)")
    p.add_argument("--fp8", required=True, help="the same shape as FP8 (make_random_checkpoint.py --fp8)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--kv-gib", type=float, default=40)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = commands.add_parser("decode", help="decode and prefill steps, FP8 weights and fp8 KV against bfloat16")
    checkpoint_args(p)
    p.add_argument("--skip-attention", action="store_true", help="no decode-attention kernel variants")
    p.add_argument("--profile", action="store_true", help="the bf16 engine's top GPU kernels, live vs replay")
    p.add_argument("--trace-dir", help="write chrome traces of live decode steps here (with a summary)")
    p.add_argument("--events", action="store_true", help="time live decode steps with CUDA events too")
    p.add_argument("--only", choices=("bf16", "fp8"), help="measure one engine's decode and prefill only")
    p.add_argument("--kv-rows", action="store_true", help="only bf16, FP8 + fp8 KV and fp8 KV at 16 / 8k (decode)")
    p.set_defaults(run=decode)
    p = commands.add_parser("pdl", help="decode steps with programmatic dependent launch against without")
    checkpoint_args(p)
    p.add_argument("--cases", default="1x1024,64x2048", help="comma-separated BATCHxCONTEXT decode cases")
    p.add_argument("--only", choices=("bf16", "fp8"), help="one of the two engines")
    p.set_defaults(run=pdl)
    p = commands.add_parser("gemm-sweep", help="one layer's GEMMs at each M, every way, against the read floor")
    p.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    p.add_argument("--gemms", default=None, help="comma-separated subset of the shape's GEMMs")
    p.add_argument("--ms", default=None, help=f"comma-separated M values (default: {MS})")
    p.add_argument("--out", default=None)
    p.add_argument("--qkv-rope", action="store_true", help="only the fused qkv + RoPE + store launches")
    p.set_defaults(run=gemm_sweep)
    p = commands.add_parser("attention", help="the decode attention kernel alone: launches and split counts")
    p.add_argument("--cases", default="1x1024,64x2048,16x8000", help="comma-separated BATCHxCONTEXT")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timings of each variant (median reported)")
    p.add_argument("--graphs", action="store_true", help="time CUDA-graph replays (as a decode step runs it)")
    p.add_argument("--launches", default=None,
                   help="CACHE:NxWxS,...[;CACHE:...] only these caches (bf16, fp8), these launches (tokens a tile x "
                        "warps x stages) at every split count, beside the default and the reference launch")
    p.set_defaults(run=attention)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
