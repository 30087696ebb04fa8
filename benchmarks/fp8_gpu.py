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
  that did. `--only fp8 --cases 1x1024,4x1024 [--only-kv fp8] [--trace-dir DIR]`: one engine's cases alone (`bash
  benchmarks/gpu_run.sh fp8_70b_layers` times the 70B shape's layers this way, traced kernel by kernel).
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

- `attention [--cases 64x2048,...] [--graphs] [--launches CACHE:NxWxS,...]` (`bash benchmarks/gpu_run.sh fp8attn`): the
  decode attention kernel alone, each launch and split count.

`gemm-sweep` and `attention` are run from here; their code is benchmarks/gemm_sweep.py and
benchmarks/attention_bench.py. (Until f1a5769 these were two programs: fp8_decode_gpu.py and fp8_gemm_sweep.py.)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.attention_bench import attention, attention_variants  # noqa: E402
from benchmarks.engine_bench_gpu import Bench, ceilings  # noqa: E402
from benchmarks.gemm_sweep import MS, SHAPES, gemm_sweep  # noqa: E402
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


def decode_case(name: str) -> tuple[int, int]:
    """A decode case's (batch, context): "decode1", "decode64" (CASES), "long" (LONG_CONTEXT) or "BATCHxCONTEXT"
    (e.g. "128x1024"); anything else a ValueError naming it."""
    named = {"decode1": CASES[0], "decode64": CASES[1], "long": LONG_CONTEXT}
    if name in named:
        return named[name]
    batch, sep, context = name.partition("x")
    if sep and batch.isdigit() and context.isdigit() and int(batch) > 0 and int(context) > 0:
        return int(batch), int(context)
    raise ValueError(f"decode case {name!r}: expected decode1, decode64, long or BATCHxCONTEXT (e.g. 128x1024)")


def case_names(text: str, prefill: bool = True) -> tuple[str, ...]:
    """"decode1,4x1024,prefill" -> its names, each one decode_case takes (or "prefill" where `prefill`); an
    argparse error names the one it refuses."""
    names = tuple(part.strip() for part in text.split(","))
    for name in names:
        if prefill and name == "prefill":
            continue
        try:
            decode_case(name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return names


def measure(folder: str, fp8: bool, bandwidth: float, flops: float, kv_bytes: int, load_format: str,
            cases: list[str], kv_cache_dtype: str = "auto", profile: bool = False,
            trace_dir: str | None = None, events: bool = False) -> dict[str, dict]:
    """One engine's rows by case name: "prefill" (1 x 2,048) or a decode case (decode_case), each tagged with the
    weights, the KV cache dtype and the KV capacity in tokens. The engine takes the largest decode batch asked for
    (64 at least)."""
    batches = [decode_case(name)[0] for name in cases if name != "prefill"]
    bench = Bench(folder, bandwidth, flops, kv_bytes, load_format=load_format, kv_cache_dtype=kv_cache_dtype,
                  profile=profile, trace_dir=trace_dir, events=events,
                  trace_tag=f"{'fp8' if fp8 else 'bf16'}-kv{kv_cache_dtype}", max_num_seqs=max([64, *batches]))
    try:
        tag = engine_tag(bench, folder, fp8, kv_cache_dtype)
        rows = {}
        for name in cases:
            if name == "prefill":
                rows[name] = bench.prefill([2048]) | tag
            else:
                rows[name] = bench.decode(*decode_case(name)) | tag
            print(json.dumps(rows[name]), flush=True)
        return rows
    finally:
        close(bench)


def compare(label: str, base: dict, new: dict, key: str = "step_ms") -> None:
    print(json.dumps({"case": label, "reference_ms": base[key], "ms": new[key],
                      "speedup": round(base[key] / new[key], 3), "x_floor": new.get("x_floor"),
                      "reference_x_floor": base.get("x_floor")}), flush=True)


def decode(args: argparse.Namespace) -> None:
    if not args.only and (args.cases or args.only_kv != "auto"):
        raise SystemExit("--cases and --only-kv choose what one engine runs: give --only bf16|fp8 with them")
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
                list(args.cases or ("decode1", "decode64", "prefill")), kv_cache_dtype=args.only_kv,
                profile=args.profile, trace_dir=args.trace_dir, events=args.events)
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
    p.add_argument("--cases", type=case_names, default=None,
                   help="with --only: these cases (decode1, decode64, long, BATCHxCONTEXT, prefill; comma-separated) "
                        "instead of decode1,decode64,prefill")
    p.add_argument("--only-kv", default="auto", choices=("auto", "fp8"),
                   help="with --only: the engine's kv_cache_dtype (default auto: the weights' dtype)")
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
