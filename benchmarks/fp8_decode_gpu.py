"""GPU benchmark: the decode step with FP8 weights against the same shape in bfloat16, and each against its floor.

`python benchmarks/fp8_decode_gpu.py --bf16 /tmp/l8bd --fp8 /tmp/l8bd-fp8 --load-format dummy`
(`bash benchmarks/gpu_run.sh fp8` writes both 8B-shaped folders with make_random_checkpoint.py, the FP8 one with
`--fp8 channel`, and runs this). UNMEASURED: written without GPU time, checked by reading only; its first run is
its test. Prints one JSON line per case, in one process and on one GPU:
- the ceilings (engine_bench_gpu.ceilings: copy bandwidth, bf16 matmul);
- per checkpoint, decode at batch 1 (1k context) and batch 64 (2k context): the median engine.step() time
  against the floor (weights read per step, counted in each parameter's own bytes, + KV read and written) /
  copy bandwidth (engine_bench_gpu.Bench.decode), so the FP8 line's floor is the FP8 weight-read floor;
- the FP8 step's speedup over the bfloat16 step at each batch (issue 38's goals: <= 1.2x its floor, >= 1.6x
  faster than bfloat16 at batch 64).
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


def measure(folder: str, fp8: bool, bandwidth: float, flops: float, kv_bytes: int, load_format: str) -> list[dict]:
    bench = Bench(folder, bandwidth, flops, kv_bytes, load_format=load_format)
    try:
        layers = [m for m in bench.engine.model.modules() if isinstance(m, Fp8Linear)]
        if bool(layers) != fp8:
            raise SystemExit(f"{folder}: the engine built {len(layers)} FP8 linears; expected "
                             f"{'some' if fp8 else 'none'}")
        if fp8 and not all(m.weight.is_cuda and m.weight.dtype == torch.float8_e4m3fn for m in layers):
            raise SystemExit(f"{folder}: an FP8 linear's weight is not float8_e4m3fn on the GPU")
        rows = []
        for batch, context in CASES:
            row = bench.decode(batch, context)
            row |= {"weights": "fp8" if fp8 else "bf16", "weight_bytes": bench.weight_bytes, "fp8_linears": len(layers)}
            print(json.dumps(row), flush=True)
            rows.append(row)
        return rows
    finally:
        bench.engine.close()
        del bench
        gc.collect()
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bf16", required=True, help="a bfloat16 checkpoint folder (e.g. the Llama-3-8B shape)")
    parser.add_argument("--fp8", required=True, help="the same shape as FP8 (make_random_checkpoint.py --fp8)")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument("--kv-gib", type=float, default=40)
    args = parser.parse_args(argv)
    check_inputs(args.bf16, args.fp8)
    bandwidth, flops = ceilings()
    print(json.dumps({"case": "ceilings", "device": torch.cuda.get_device_name(), "copy_gb_per_s":
                      round(bandwidth / 1e9, 1), "matmul_tflops": round(flops / 1e12, 1)}), flush=True)
    kv_bytes = int(args.kv_gib * (1 << 30))
    bf16 = measure(args.bf16, False, bandwidth, flops, kv_bytes, args.load_format)
    fp8 = measure(args.fp8, True, bandwidth, flops, kv_bytes, args.load_format)
    for (batch, context), a, b in zip(CASES, bf16, fp8, strict=True):
        print(json.dumps({"case": f"fp8 vs bf16, decode batch {batch}, {context} context",
                          "bf16_step_ms": a["step_ms"], "fp8_step_ms": b["step_ms"],
                          "speedup": round(a["step_ms"] / b["step_ms"], 3), "fp8_x_floor": b["x_floor"],
                          "bf16_x_floor": a["x_floor"]}), flush=True)


if __name__ == "__main__":
    main()
