"""What a preempted request costs to bring back, per prompt length: swapping its KV blocks to the host and back
(engine.runner.swap_store, what preemption_mode swap does) against recomputing them (one prefill step of its
tokens, what recompute does), and which one preemption_mode auto would pick from its own measurements.

On a CPU engine (the default) the "host" copy is a memcpy within RAM and the prefill runs on the CPU: those figures
are CPU figures and say nothing of a GPU's PCIe copies or tensor-core prefill; `--device cuda` measures a GPU's.
Best of --repeats runs each.

    python benchmarks/swap_vs_recompute.py [--model tiny] [--device cpu] [--lengths 64,256,1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from engine import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lengths", default="64,256,1024")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
