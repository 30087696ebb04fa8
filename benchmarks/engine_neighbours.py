"""What a served worker's neighbours cost the engine's CPU step: the engine alone against the engine beside another
Python thread of its process (the actor's event loop and Ray's threads in a served worker) or another process.

The load is serving_overhead.py's closed loop, run on the engine directly: `--concurrency` requests in flight, each
replaced as it finishes, `--num-prompts` random-id prompts of `--input-len` tokens, `--output-len` new tokens each
(greedy, ignore_eos). Cases, each run `--repeats` times, interleaved:
  alone          the engine and nothing else of ours
  waker          a thread of the same process that wakes every `--wake-ms` and runs ~`--work` Python operations
  busy_thread    a thread of the same process that runs Python without pause (not in the default cases: the step
                 then waits a whole switch interval, 5 ms, at every op boundary, ~100x slower; minutes per run)
  copy_process   another process copying 64 MiB over and over (memory traffic on the other core)
Printed: output tok/s, host ms per engine step and its ratio to `alone`. Torch releases the GIL inside each op, so a
runnable Python thread takes it at every op boundary and the step waits for it to give it back.

    python benchmarks/engine_neighbours.py --dtype bfloat16          # tiny, one torch thread, on the CPU
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import threading
import time
from collections.abc import Callable

import torch

from engine import LLM, SamplingParams


def closed_loop(llm: LLM, args: argparse.Namespace, seed: int) -> tuple[float, float]:
    """(output tok/s, host ms per step) of one closed-loop run."""
    engine, rng = llm.engine, random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    sent = live = tokens = 0
    steps, step_s, start = engine.num_steps, engine.step_time_total_s, time.perf_counter()
    while sent < args.num_prompts or engine.has_unfinished():
        while live < args.concurrency and sent < args.num_prompts:
            engine.add_request(f"{seed}-{sent}", [rng.randrange(10, 2000) for _ in range(args.input_len)], params)
            sent, live = sent + 1, live + 1
        for out in engine.step():
            tokens += len(out.new_token_ids)
            live -= out.finish_reason is not None
    wall, steps = time.perf_counter() - start, engine.num_steps - steps
    return tokens / wall, (engine.step_time_total_s - step_s) * 1000 / steps


def _copy_forever(stop) -> None:  # a multiprocessing Event
    block = bytearray(64 << 20)
    while not stop.is_set():
        bytes(block)


def neighbour(case: str, args: argparse.Namespace) -> Callable[[], None]:
    """Start the case's neighbour; returns its stop function."""
    if case == "alone":
        return lambda: None
    if case == "copy_process":
        context = multiprocessing.get_context("spawn")
        stop = context.Event()
        proc = context.Process(target=_copy_forever, args=(stop,), daemon=True)
        proc.start()
        return lambda: (stop.set(), proc.join())
    done = threading.Event()

    def run() -> None:
        while not done.is_set():
            if case == "waker":
                time.sleep(args.wake_ms / 1000)
            sum(range(args.work))
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return lambda: (done.set(), thread.join())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1, help="torch threads (a served worker's: its num_cpus)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--wake-ms", type=float, default=1.0)
    p.add_argument("--work", type=int, default=200, help="Python operations per wake-up of the waker")
    p.add_argument("--cases", default="alone,waker,copy_process")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.concurrency)
    closed_loop(llm, args, seed=1)  # warm-up
    cases = args.cases.split(",")
    results: dict[str, list[tuple[float, float]]] = {c: [] for c in cases}
    seeds = iter(range(100, 100 + args.repeats * len(cases)))  # new prompts every run: no prefix-cache hits
    for _ in range(args.repeats):
        for case in cases:
            stop = neighbour(case, args)
            try:
                results[case].append(closed_loop(llm, args, seed=next(seeds)))
            finally:
                stop()
            print(f"  {case}: {results[case][-1][0]:.0f} tok/s, {results[case][-1][1]:.2f} ms a step", flush=True)
    base = statistics.median(ms for _, ms in results[cases[0]])
    print(f"{args.model} ({args.dtype}, {args.threads} torch thread(s)): {args.num_prompts} prompts of {args.input_len}"
          f" ids, {args.output_len} out, {args.concurrency} in flight; medians of {args.repeats}")
    print(f"{'case':>14} {'output_tok_s':>13} {'step_ms':>8} {'step / ' + cases[0]:>14}")
    for case, rows in results.items():
        ms = statistics.median(m for _, m in rows)
        print(f"{case:>14} {statistics.median(t for t, _ in rows):>13.0f} {ms:>8.2f} {ms / base:>14.2f}")


if __name__ == "__main__":
    main()
