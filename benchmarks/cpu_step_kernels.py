"""The CPU's C draw (engine.cpu_kernels.sampling) and AMX prefill attention (engine.cpu_kernels.prefill_attention),
each against the torch path it replaces, timed in the same run, alone and inside the engine's steps:

- the draw: `Sampler.launch` on [rows, vocab] float32 logits at temperature 1 and greedy, with and without the kernel;
- prefill attention: one layer of `--prompts` whole prompts of `--prompt-len` tokens (tiny's heads) through
  `torch_attention.paged_attention` with and without the kernel (the torch path: a gather and SDPA per prompt);
- the engine (`tiny`, bfloat16, one torch thread): a prefill step of `--prompts` x `--prompt-len`, and decode steps
  of `--rows` rows at temperature 1 (as `vllm bench serve` sends: no temperature), each with the kernel on and off
  on one engine, alternated `--pairs` times; medians.

    python benchmarks/cpu_step_kernels.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from engine import LLM, SamplingParams
from engine.cpu_kernels import prefill_attention as prefill_kernel
from engine.cpu_kernels import sampling as draw_kernel
from engine.model import torch_attention
from engine.model.attention_metadata import AttentionMetadata
from engine.sampling.sampler import Sampler


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def draw(args: argparse.Namespace) -> None:
    logits = torch.randn(args.rows, args.vocab)
    for name, temperature in (("temperature 1", 1.0), ("greedy", 0.0)):
        params = [SamplingParams(temperature=temperature, max_tokens=8)] * args.rows
        times = {}
        for on in (False, True):
            sampler = Sampler(torch.device("cpu"), cpu_kernel=on)
            times[on] = per_call_us(lambda s=sampler, p=params: s.launch(logits, p, [0] * args.rows).result(), 300)
        print(f"  draw, {args.rows} x {args.vocab}, {name}: torch {times[False]:7.1f} us, C {times[True]:7.1f} us "
              f"({times[True] / times[False]:.2f}x)")


def attention(args: argparse.Namespace) -> None:
    heads, kv_heads, dim, bs = 8, 4, 32, 16  # tiny's
    n, prompts = args.prompt_len, args.prompts
    nb = -(-n // bs)
    kv = torch.randn(prompts * nb + 4, 2, bs, kv_heads, dim).to(torch.bfloat16)
    q = torch.randn(prompts * n, heads, dim).to(torch.bfloat16)
    tables = torch.arange(prompts * nb, dtype=torch.int32).view(prompts, nb)
    meta = AttentionMetadata(slots=torch.zeros(prompts * n, dtype=torch.int32), num_decode=0,
                             decode_block_tables=torch.zeros(0, 1, dtype=torch.int32),
                             decode_context_lens=torch.zeros(0, dtype=torch.int32), prefill_block_tables=tables,
                             prefill_query_start=torch.zeros(prompts + 1, dtype=torch.int32),
                             prefill_context_lens=torch.full((prompts,), n, dtype=torch.int32),
                             prefill_lens=((n, n),) * prompts, sliding_window=None)
    times = {}
    for on in (False, True):
        planned = torch_attention.with_plan(meta, kv, prefill_kernel=on)
        times[on] = per_call_us(lambda m=planned: torch_attention.paged_attention(q, kv, m, dim ** -0.5), 30)
    print(f"  prefill attention, one layer of {prompts} x {n} tokens: torch (gather + SDPA) {times[False]:8.1f} us, "
          f"AMX kernel {times[True]:8.1f} us ({times[True] / times[False]:.2f}x)")


def engine_steps(args: argparse.Namespace) -> None:
    llm = LLM("tiny", dtype="bfloat16", max_num_seqs=max(args.rows, args.prompts))
    engine, rng = llm.engine, random.Random(0)
    model, sampler = engine.model, engine.runner.sampler
    prefill = {False: [], True: []}
    decode = {False: [], True: []}

    def prompt() -> list[int]:
        return [rng.randrange(10, 2000) for _ in range(args.prompt_len)]
    for _ in range(args.pairs):
        for on in (False, True):
            model.cpu_prefill_kernel = on
            sampler.cpu_kernel = on
            once = SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True)
            for i in range(args.prompts):
                engine.add_request(f"p{on}{len(prefill[on])}-{i}", prompt(), once)
            start = time.perf_counter()
            engine.step()
            prefill[on].append(time.perf_counter() - start)
            while engine.has_unfinished():
                engine.step()
            many = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
            for i in range(args.rows):
                engine.add_request(f"d{on}{len(decode[on])}-{i}", prompt(), many)
            while engine.has_unfinished():
                scheduled, start = engine.scheduler.num_scheduled_tokens, time.perf_counter()
                outputs = engine.step()
                if len(outputs) == args.rows == engine.scheduler.num_scheduled_tokens - scheduled:  # decode only
                    decode[on].append(time.perf_counter() - start)
    for name, table in ((f"prefill step, {args.prompts} x {args.prompt_len}", prefill),
                        (f"decode step, {args.rows} rows, temperature 1", decode)):
        off, on = statistics.median(table[False]) * 1e3, statistics.median(table[True]) * 1e3
        print(f"  engine {name}: torch path {off:6.2f} ms, C kernels {on:6.2f} ms ({on / off:.2f}x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--pairs", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    if draw_kernel.load() is None or prefill_kernel.load() is None:
        print("the C draw or the AMX prefill kernel cannot run here (no AVX-512 / AMX, or no compiler): nothing to "
              "compare")
        return
    print("one torch thread; each line: the torch path and the kernel in the same run")
    with torch.inference_mode():
        draw(args)
        attention(args)
    engine_steps(args)


if __name__ == "__main__":
    main()
