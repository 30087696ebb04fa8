"""Engine throughput benchmark: `python benchmarks/engine_bench.py --model tiny --batch 8 --prompt-len 256`.
Produces docs/benchmarks.md's "Engine, one GPU" table (`--gpu`, `bash benchmarks/gpu_run.sh engine`) and its
`engine_bench.py` rows of "Engine, CPU", and docs/engine.md's swap-against-recompute figures (`--swap-vs-recompute`).

`python benchmarks/engine_bench.py --gpu --model FOLDER` runs the GPU benchmark of engine_bench_gpu.py instead.

Prints one JSON line per phase with its figure next to the ceiling measured in the same run:
- prefill: tokens/s and achieved FLOP/s (2 x parameters per token) against a dense matmul's FLOP/s;
- decode: tokens/s and achieved bytes/s (weights + KV context read per step) against a large copy's bytes/s.

`python benchmarks/engine_bench.py --swap-vs-recompute [--model tiny] [--device cpu] [--lengths 64,256,1024]
[--repeats 5]`: what a preempted request costs to bring back, per prompt length: swapping its KV blocks to the host
and back (engine.runner.swap_store, what preemption_mode swap does) against recomputing them (one prefill step of
its tokens, what recompute does), and which one preemption_mode auto would pick from its own measurements. On a CPU
engine (the default) the "host" copy is a memcpy within RAM and the prefill runs on the CPU: those figures are CPU
figures and say nothing of a GPU's PCIe copies or tensor-core prefill; `--device cuda` measures a GPU's. Best of
--repeats runs each. (Until f1a5769 this was its own program, benchmarks/swap_vs_recompute.py.)
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from engine import LLM
from engine.core.sampling_params import SamplingParams
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.runner.kv_cache import TORCH_DTYPES


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    _sync(device)
    reps, start = 5, time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - start)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes read plus written per second by one large device copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    reps, start = 5, time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    _sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - start)


def run(args: argparse.Namespace) -> list[dict]:
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                    max_num_seqs=args.batch, max_num_batched_tokens=args.batch * args.prompt_len,
                                    enable_prefix_caching=False))
    device, dtype = engine.device, TORCH_DTYPES[engine.config.dtype]
    n_params = sum(p.numel() for p in engine.model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_len + 1, ignore_eos=True)

    def add_batch(tag: str) -> None:
        for i in range(args.batch):
            engine.add_request(f"{tag}{i}", torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist(),
                               params)

    add_batch("warm")  # first calls allocate and warm up kernels
    while engine.has_unfinished():
        engine.step()
    add_batch("r")
    _sync(device)
    start = time.perf_counter()
    engine.step()  # the whole batch's prompts fit one step's budget
    _sync(device)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    decode_tokens = 0  # counted from the outputs: with overlapped decode, step() calls != decode steps
    while engine.has_unfinished():
        decode_tokens += sum(len(o.new_token_ids) for o in engine.step())
    _sync(device)
    decode_s = time.perf_counter() - start
    prefill_tokens = args.batch * args.prompt_len
    steps = decode_tokens // args.batch
    mean_context = args.prompt_len + args.output_len / 2
    kv_bytes_per_step = args.batch * mean_context * engine.kv_spec.layer_bytes * engine.kv_spec.num_layers \
        / engine.kv_spec.block_size
    flops_ceiling = matmul_flops(device, dtype, args.matmul_n)
    bw_ceiling = copy_bandwidth(device, args.copy_mib << 20)
    prefill_flops = 2 * n_params * prefill_tokens / prefill_s
    decode_bw = (weight_bytes + kv_bytes_per_step) * steps / decode_s
    common = {"model": args.model, "device": str(device), "dtype": engine.config.dtype, "batch": args.batch,
              "prompt_len": args.prompt_len, "output_len": args.output_len}
    return [
        {**common, "phase": "prefill", "tokens": prefill_tokens, "seconds": round(prefill_s, 4),
         "tokens_per_s": round(prefill_tokens / prefill_s, 1), "achieved_tflops": round(prefill_flops / 1e12, 4),
         "matmul_tflops_ceiling": round(flops_ceiling / 1e12, 4), "ratio": round(prefill_flops / flops_ceiling, 3)},
        {**common, "phase": "decode", "tokens": decode_tokens, "seconds": round(decode_s, 4),
         "tokens_per_s": round(decode_tokens / decode_s, 1), "achieved_gb_per_s": round(decode_bw / 1e9, 2),
         "copy_gb_per_s_ceiling": round(bw_ceiling / 1e9, 2), "ratio": round(decode_bw / bw_ceiling, 3)},
    ]


def swap_vs_recompute(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description="what a preempted request costs to bring back: swap against recompute")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lengths", default="64,256,1024")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    engine = LLM(args.model, device=args.device, preemption_mode="auto", enable_prefix_caching=False,
                 max_num_batched_tokens=max(lengths)).engine
    store, space = engine.swap_store, engine.swap_space
    vocab = engine.model_config.vocab_size
    where = (torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda"
             else f"CPU {platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}")
    print(f"# {where} figures, "
          f"model {args.model}, {store.block_bytes} bytes a block; copy bandwidth measured at start: "
          f"{space.copy_bytes_per_s / 1e9:.2f} GB/s")
    print(f"{'tokens':>7} {'blocks':>7} {'swap out+in ms':>15} {'recompute ms':>13} {'ratio':>7}  auto picks")
    for n in lengths:
        blocks = engine.block_manager.blocks_needed(n)
        pairs = [(b, b) for b in range(blocks)]
        swap = min(_timed(lambda p=pairs: (store.copy_out(p), store.copy_in(p), store.sync()))
                   for _ in range(args.repeats))
        prompt = torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        recompute = min(_prefill(engine, prompt) for _ in range(args.repeats))
        space.observe_prefill(n, recompute)
        picks = "swap" if space.wants_swap(n, blocks) else "recompute"
        print(f"{n:>7} {blocks:>7} {swap * 1e3:>15.3f} {recompute * 1e3:>13.3f} {recompute / swap:>6.1f}x  {picks}")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _prefill(engine, prompt: list[int]) -> float:
    """Seconds of the step that computes `prompt` (and samples one token)."""
    engine.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    import sys
    if "--gpu" in sys.argv[1:]:  # the Llama-3-8B GPU benchmark (engine_bench_gpu.py)
        from engine_bench_gpu import main as gpu_main
        gpu_main([a for a in sys.argv[1:] if a != "--gpu"])
        return
    if "--swap-vs-recompute" in sys.argv[1:]:  # preemption's two ways back (docs/engine.md)
        swap_vs_recompute([a for a in sys.argv[1:] if a != "--swap-vs-recompute"])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--matmul-n", type=int, default=2048)
    parser.add_argument("--copy-mib", type=int, default=256)
    for line in run(parser.parse_args()):
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
