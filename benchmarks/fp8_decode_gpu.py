"""GPU benchmark of FP8 on one GPU: FP8 weights against bfloat16, and the fp8 KV cache against the bfloat16 one.

`python benchmarks/fp8_decode_gpu.py --bf16 /tmp/l8bd --fp8 /tmp/l8bd-fp8 --load-format dummy`
(`bash benchmarks/gpu_run.sh fp8` writes both 8B-shaped folders with make_random_checkpoint.py, the FP8 one with
`--fp8 channel`, and runs this). Prints one JSON line per case, in one process on one GPU, each figure next to its
reference measured in the same run:
- the ceilings (engine_bench_gpu.ceilings: copy bandwidth, bf16 matmul);
- per checkpoint: decode at batch 1 (1k context) and batch 64 (2k context), the median engine.step() time against
  its floor (weights read per step, each parameter in its own bytes, + KV read and written, over the copy
  bandwidth: the FP8 line's floor is the FP8 weight-read floor), the bare graph replay, and the host time per step
  by phase (engine_bench_gpu.HostPhases); prefill of one 2,048-token prompt against the matmul rate;
- FP8 against bfloat16: the speedup of each decode case and of the prefill;
- the fp8 KV cache (bfloat16 weights): its capacity in tokens against the bfloat16 cache's for the same bytes, and
  decode at batch 16 with an 8k context (where reading the KV is most of the step) against the bfloat16 cache;
- FP8 weights with the fp8 KV cache (how FP8 is served on Hopper) against bfloat16, at batch 1 and 64: at batch 64
  with a 2k context the KV read is more than the weights' (17 GB against 8), so FP8 weights alone can speed the
  step up by at most its floor ratio (1.27x), both together by 1.9x;
- the decode attention kernel alone on both caches, per launch configuration (--skip-attention: not).
It refuses to print a figure that would describe something else: a GPU without FP8 tensor cores (compute
capability below 8.9), two folders of different shapes, an "FP8" engine that built no FP8 linear, or a bf16 one
that did.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.engine_bench_gpu import Bench, ceilings  # noqa: E402
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
    bench.engine.close()
    gc.collect()
    torch.cuda.empty_cache()


def measure(folder: str, fp8: bool, bandwidth: float, flops: float, kv_bytes: int, load_format: str,
            cases: list[str], kv_cache_dtype: str = "auto", profile: bool = False,
            trace_dir: str | None = None, events: bool = False) -> dict[str, dict]:
    """One engine's rows by case name: "decode1", "decode64" (CASES), "prefill" (1 x 2,048) and "long"
    (LONG_CONTEXT), each tagged with the weights, the KV cache dtype and the KV capacity in tokens."""
    bench = Bench(folder, bandwidth, flops, kv_bytes, load_format=load_format, kv_cache_dtype=kv_cache_dtype,
                  profile=profile, trace_dir=trace_dir, events=events,
                  trace_tag=f"{'fp8' if fp8 else 'bf16'}-kv{kv_cache_dtype}")
    try:
        e = bench.engine
        layers = [m for m in e.model.modules() if isinstance(m, Fp8Linear)]
        if bool(layers) != fp8:
            raise SystemExit(f"{folder}: the engine built {len(layers)} FP8 linears; expected "
                             f"{'some' if fp8 else 'none'}")
        if fp8 and not all(m.weight.is_cuda and m.weight.dtype == torch.float8_e4m3fn for m in layers):
            raise SystemExit(f"{folder}: an FP8 linear's weight is not float8_e4m3fn on the GPU")
        tag = {"weights": "fp8" if fp8 else "bf16", "kv_cache_dtype": kv_cache_dtype, "weight_bytes":
               bench.weight_bytes, "fp8_linears": len(layers), "kv_tokens": e.num_kv_blocks * e.kv_spec.block_size}
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


def attention_variants(bandwidth: float, batch: int = 16, context: int = 8000) -> None:
    """The decode attention kernel alone on a bf16 and an fp8 cache (Llama-3-8B heads, 16-token blocks, random
    K/V): each launch configuration's KV read rate against the copy bandwidth."""
    from triton.testing import do_bench

    from engine.kernels.decode_attention import decode_attention
    heads, kv_heads, d, bs = 32, 8, 128, 16
    per_seq = -(-context // bs)
    blocks = batch * per_seq + 8
    q = torch.randn(batch, heads, d, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(blocks - 8, device="cuda")[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    base = torch.randn(blocks, 2, bs, kv_heads, d, device="cuda", dtype=torch.bfloat16)
    for name, layer in (("bf16", base), ("fp8", base.to(torch.float8_e4m3fn))):
        nbytes = batch * context * 2 * kv_heads * d * layer.element_size()
        for launch in (None, (64, 4, 3), (128, 8, 3), (128, 4, 3), (64, 8, 3), (128, 8, 4)):
            try:
                ms = do_bench(lambda launch=launch, layer=layer: decode_attention(
                    q, layer, tables, lens, d ** -0.5, launch=launch), warmup=5, rep=40, return_mode="median")
            except Exception as e:  # noqa: BLE001 (a configuration the GPU cannot run: reported)
                print(json.dumps({"attention": name, "launch": launch, "error": str(e).splitlines()[0][:120]}))
                continue
            print(json.dumps({"attention": name, "launch": launch or "default", "batch": batch, "context": context,
                              "ms": round(ms, 4), "gb_per_s": round(nbytes / ms / 1e6, 1),
                              "x_copy": round(nbytes / ms / 1e6 / (bandwidth / 1e9), 3)}), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bf16", required=True, help="a bfloat16 checkpoint folder (e.g. the Llama-3-8B shape)")
    parser.add_argument("--fp8", required=True, help="the same shape as FP8 (make_random_checkpoint.py --fp8)")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument("--kv-gib", type=float, default=40)
    parser.add_argument("--skip-attention", action="store_true", help="no decode-attention kernel variants")
    parser.add_argument("--profile", action="store_true", help="the bf16 engine's top GPU kernels, live vs replay")
    parser.add_argument("--trace-dir", help="write chrome traces of live decode steps here (with a summary)")
    parser.add_argument("--events", action="store_true", help="time live decode steps with CUDA events too")
    parser.add_argument("--only", choices=("bf16", "fp8"), help="measure one engine's decode and prefill only")
    args = parser.parse_args(argv)
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
    bf16 = measure(args.bf16, False, bandwidth, flops, kv_bytes, args.load_format,
                   ["decode1", "decode64", "prefill", "long"], profile=args.profile, trace_dir=args.trace_dir)
    fp8 = measure(args.fp8, True, bandwidth, flops, kv_bytes, args.load_format, ["decode1", "decode64", "prefill"],
                  trace_dir=args.trace_dir)
    kv8 = measure(args.bf16, False, bandwidth, flops, kv_bytes, args.load_format, ["long"], kv_cache_dtype="fp8")
    both = measure(args.fp8, True, bandwidth, flops, kv_bytes, args.load_format, ["decode1", "decode64"],
                   kv_cache_dtype="fp8")
    for name in ("decode1", "decode64"):
        compare(f"fp8 weights vs bf16, {bf16[name]['case']}", bf16[name], fp8[name])
        compare(f"fp8 weights + fp8 KV vs bf16, {bf16[name]['case']}", bf16[name], both[name])
    compare("fp8 weights vs bf16, prefill 1 x 2048", bf16["prefill"], fp8["prefill"], key="ms")
    compare(f"fp8 KV vs bf16 KV (bf16 weights), {bf16['long']['case']}", bf16["long"], kv8["long"])
    print(json.dumps({"case": "KV capacity, same bytes", "kv_bytes": kv_bytes,
                      "bf16_kv_tokens": bf16["long"]["kv_tokens"], "fp8_kv_tokens": kv8["long"]["kv_tokens"],
                      "ratio": round(kv8["long"]["kv_tokens"] / bf16["long"]["kv_tokens"], 3)}), flush=True)

if __name__ == "__main__":
    main()
