"""The CPU decode step with the C decode-attention kernel (`kernels: auto`) against the plain torch path
(`kernels: torch`) on the same engine settings: `--rows` requests decode together after `--prompt-len`-token prompts;
each engine is timed over `--steps` decode-only steps at about `--prompt-len` tokens of context and again after
`--grow` more. The two engines are built and timed in turn, `--pairs` times (a shared machine drifts), and the
medians are printed with their ratio.

    python benchmarks/cpu_decode_step.py                       # tiny, float32, one torch thread (a served worker's)
    python benchmarks/cpu_decode_step.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from engine import LLM, SamplingParams


def step_ms(kernels: str, args: argparse.Namespace) -> tuple[float, float, bool]:
    """(median ms of a decode step near prompt-len, the same after `grow` more tokens, whether the kernel ran)."""
    llm = LLM(args.model, dtype=args.dtype, kernels=kernels, max_num_seqs=args.rows)
    engine, rng = llm.engine, random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.grow + 2 * args.steps + 8, ignore_eos=True)
    for i in range(args.rows):
        engine.add_request(f"r{i}", [rng.randrange(10, 2000) for _ in range(args.prompt_len)], params)
    for _ in range(4):  # the prefills and the first decode steps
        engine.step()

    def timed() -> float:
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1000
    early = timed()
    for _ in range(args.grow):
        engine.step()
    return early, timed(), engine.model.cpu_decode_kernel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--grow", type=int, default=500, help="tokens decoded between the two timings")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--pairs", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    runs: dict[str, list[tuple[float, float, bool]]] = {"torch": [], "auto": []}
    for _ in range(args.pairs):
        for kernels in runs:
            runs[kernels].append(step_ms(kernels, args))
    print(f"{args.model} ({args.dtype}), {args.threads} torch thread(s), {args.rows} rows decoding; medians of "
          f"{args.pairs} engines each")
    for index, context in ((0, args.prompt_len), (1, args.prompt_len + args.grow)):
        torch_ms = statistics.median(r[index] for r in runs["torch"])
        kernel_ms = statistics.median(r[index] for r in runs["auto"])
        print(f"  context ~{context:>4}: torch path {torch_ms:6.2f} ms, with the C kernel {kernel_ms:6.2f} ms "
              f"({kernel_ms / torch_ms:.2f}x){'' if all(r[2] for r in runs['auto']) else '  (kernel not built here)'}")


if __name__ == "__main__":
    main()
