"""The CPU bfloat16 engine with its fused elementwise ops (engine.cpu_kernels.elementwise: RMSNorm with the residual
add, SiLU-and-mul, RoPE with the KV store, one C pass each) against the same engine with torch's op chains,
everything else equal (packed linears, the C decode attention). Engines of each kind are built and timed in turn,
`--pairs` times (a shared machine drifts); printed: the medians of a prefill of `--prompts` prompts of
`--prompt-len` tokens together, and of a decode step of `--rows` rows after `--prompt-len`-token prompts, with their
ratios.

    python benchmarks/cpu_fused_ops.py          # tiny, one torch thread (a served worker's)
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import engine.model.decoder as decoder
from engine import LLM, SamplingParams


def timings(fused: bool, args: argparse.Namespace, seed: int) -> tuple[float, float]:
    """(median ms of the prefill, median ms of a decode step) of one engine."""
    original = decoder.CausalLM.use_cpu_elementwise
    if not fused:
        decoder.CausalLM.use_cpu_elementwise = lambda self: False
    try:
        engine = LLM(args.model, dtype="bfloat16", max_num_seqs=args.rows).engine
    finally:
        decoder.CausalLM.use_cpu_elementwise = original
    assert engine.model.model.norm.cpu_fused == fused, "the fused kernels did not build here"
    rng = random.Random(seed)

    def prompt() -> list[int]:
        return [rng.randrange(10, 2000) for _ in range(args.prompt_len)]

    def prefill() -> float:
        for _ in range(args.prompts):
            engine.add_request(f"p{rng.random()}", prompt(), SamplingParams(temperature=0, max_tokens=1,
                                                                           ignore_eos=True))
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - start
    for _ in range(2):
        prefill()
    prefill_s = statistics.median(prefill() for _ in range(5))
    for _ in range(args.rows):
        engine.add_request(f"d{rng.random()}", prompt(), SamplingParams(temperature=0, max_tokens=args.steps + 8,
                                                                      ignore_eos=True))
    for _ in range(6):
        engine.step()
    steps = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return prefill_s * 1000, statistics.median(steps) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--pairs", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for pair in range(args.pairs):
        for fused in (False, True):
            runs[fused].append(timings(fused, args, pair))
    print(f"{args.model} (bfloat16), one torch thread; medians of {args.pairs} engines each")
    for index, what in ((0, f"prefill of {args.prompts} x {args.prompt_len} tokens"),
                        (1, f"decode step, {args.rows} rows")):
        plain = statistics.median(r[index] for r in runs[False])
        fused = statistics.median(r[index] for r in runs[True])
        print(f"  {what}: torch ops {plain:7.2f} ms, fused {fused:7.2f} ms ({fused / plain:.2f}x)")


if __name__ == "__main__":
    main()
