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
  decode at batch 16 with an 8k context (where reading the KV is most of the step) against the bfloat16 cache.
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


def measure_weights(folder: str, fp8: bool, bandwidth: float, flops: float, kv_bytes: int, load_format: str,
                    cases: str) -> tuple[list[dict], dict | None]:
    """(decode rows per CASES, the prefill row) of one checkpoint."""
    bench = Bench(folder, bandwidth, flops, kv_bytes, load_format=load_format)
    try:
        layers = [m for m in bench.engine.model.modules() if isinstance(m, Fp8Linear)]
        if bool(layers) != fp8:
            raise SystemExit(f"{folder}: the engine built {len(layers)} FP8 linears; expected "
                             f"{'some' if fp8 else 'none'}")
        if fp8 and not all(m.weight.is_cuda and m.weight.dtype == torch.float8_e4m3fn for m in layers):
            raise SystemExit(f"{folder}: an FP8 linear's weight is not float8_e4m3fn on the GPU")
        tag = {"weights": "fp8" if fp8 else "bf16", "weight_bytes": bench.weight_bytes, "fp8_linears": len(layers)}
        rows = []
        for batch, context in CASES:
            if f"decode{batch}" in cases:
                rows.append(bench.decode(batch, context) | tag)
                print(json.dumps(rows[-1]), flush=True)
        prefill = None
        if "prefill" in cases:
            prefill = bench.prefill([2048]) | tag
            print(json.dumps(prefill), flush=True)
        return rows, prefill
    finally:
        close(bench)


def measure_kv(folder: str, bandwidth: float, flops: float, kv_bytes: int, load_format: str) -> dict[str, dict]:
    """Per KV dtype (bfloat16 weights): tokens the same bytes hold, and decode at LONG_CONTEXT."""
    out = {}
    for kv_dtype in ("auto", "fp8"):
        bench = Bench(folder, bandwidth, flops, kv_bytes, load_format=load_format, kv_cache_dtype=kv_dtype)
        try:
            e = bench.engine
            row = bench.decode(*LONG_CONTEXT) | {"kv_cache_dtype": kv_dtype,
                                                 "kv_tokens": e.num_kv_blocks * e.kv_spec.block_size,
                                                 "kv_bytes_budget": kv_bytes}
            print(json.dumps(row), flush=True)
            out[kv_dtype] = row
        finally:
            close(bench)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bf16", required=True, help="a bfloat16 checkpoint folder (e.g. the Llama-3-8B shape)")
    parser.add_argument("--fp8", required=True, help="the same shape as FP8 (make_random_checkpoint.py --fp8)")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument("--kv-gib", type=float, default=40)
    parser.add_argument("--cases", default="decode1,decode64,prefill,kv")
    args = parser.parse_args(argv)
    check_inputs(args.bf16, args.fp8)
    bandwidth, flops = ceilings()
    print(json.dumps({"case": "ceilings", "device": torch.cuda.get_device_name(), "copy_gb_per_s":
                      round(bandwidth / 1e9, 1), "matmul_tflops": round(flops / 1e12, 1)}), flush=True)
    kv_bytes = int(args.kv_gib * (1 << 30))
    bf16, bf16_prefill = measure_weights(args.bf16, False, bandwidth, flops, kv_bytes, args.load_format, args.cases)
    fp8, fp8_prefill = measure_weights(args.fp8, True, bandwidth, flops, kv_bytes, args.load_format, args.cases)
    for a, b in zip(bf16, fp8, strict=True):
        print(json.dumps({"case": f"fp8 vs bf16 weights, {a['case']}", "bf16_step_ms": a["step_ms"],
                          "fp8_step_ms": b["step_ms"], "speedup": round(a["step_ms"] / b["step_ms"], 3),
                          "fp8_x_floor": b["x_floor"], "bf16_x_floor": a["x_floor"]}), flush=True)
    if bf16_prefill and fp8_prefill:
        print(json.dumps({"case": "fp8 vs bf16 weights, prefill 1 x 2048", "bf16_ms": bf16_prefill["ms"],
                          "fp8_ms": fp8_prefill["ms"], "speedup": round(bf16_prefill["ms"] / fp8_prefill["ms"], 3)}),
              flush=True)
    if "kv" in args.cases:
        kv = measure_kv(args.bf16, bandwidth, flops, kv_bytes, args.load_format)
        a, b = kv["auto"], kv["fp8"]
        print(json.dumps({"case": f"fp8 vs bf16 KV cache, decode batch {LONG_CONTEXT[0]}, {LONG_CONTEXT[1]} context",
                          "bf16_kv_step_ms": a["step_ms"], "fp8_kv_step_ms": b["step_ms"],
                          "speedup": round(a["step_ms"] / b["step_ms"], 3), "bf16_kv_tokens": a["kv_tokens"],
                          "fp8_kv_tokens": b["kv_tokens"], "capacity_ratio": round(b["kv_tokens"] / a["kv_tokens"], 3),
                          "fp8_kv_x_floor": b["x_floor"], "bf16_kv_x_floor": a["x_floor"]}), flush=True)


if __name__ == "__main__":
    main()
