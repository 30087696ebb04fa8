"""The CPU engine's C and AMX kernels, each against the torch path it replaces, timed in the same run (issue 13's CPU
work; the `tiny` model, one torch thread, as a served worker runs it). Produces docs/benchmarks.md's "Engine, CPU"
rows for the kernels (the decode step, the fused ops, the draw, prefill attention, the engine's steps).

`python benchmarks/cpu_kernels.py COMMAND [options]`, one command per comparison:

- `decode-step`: the CPU decode step with the C decode-attention kernel (`kernels: auto`) against the plain torch
  path (`kernels: torch`) on the same engine settings: `--rows` requests decode together after `--prompt-len`-token
  prompts; each engine is timed over `--steps` decode-only steps at about `--prompt-len` tokens of context and again
  after `--grow` more. The two engines are built and timed in turn, `--pairs` times (a shared machine drifts), and
  the medians are printed with their ratio.
- `fused-ops`: the CPU bfloat16 engine with its fused elementwise ops (engine.cpu_kernels.elementwise: RMSNorm with
  the residual add, SiLU-and-mul, RoPE with the KV store, one C pass each) against the same engine with torch's op
  chains, everything else equal (packed linears, the C decode attention). Engines of each kind are built and timed
  in turn, `--pairs` times; printed: the medians of a prefill of `--prompts` prompts of `--prompt-len` tokens
  together, and of a decode step of `--rows` rows after `--prompt-len`-token prompts, with their ratios.
- `step-kernels`: the C draw (engine.cpu_kernels.sampling) and AMX prefill attention
  (engine.cpu_kernels.prefill_attention), alone and inside the engine's steps:
  the draw: `Sampler.launch` on [rows, vocab] float32 logits at temperature 1 and greedy, with and without the
  kernel; prefill attention: one layer of `--prompts` whole prompts of `--prompt-len` tokens (tiny's heads) through
  `torch_attention.paged_attention` with and without the kernel (the torch path: a gather and SDPA per prompt);
  the engine (`tiny`, bfloat16): a prefill step of `--prompts` x `--prompt-len`, and decode steps of `--rows` rows
  at temperature 1 (as `vllm bench serve` sends: no temperature), each with the kernel on and off on one engine,
  alternated `--pairs` times; medians.

    python benchmarks/cpu_kernels.py decode-step --dtype bfloat16
    python benchmarks/cpu_kernels.py fused-ops
    python benchmarks/cpu_kernels.py step-kernels

(Until f1a5769 these were three programs: cpu_decode_step.py, cpu_fused_ops.py, cpu_step_kernels.py.)
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

import engine.model.decoder as decoder
from engine import LLM, SamplingParams
from engine.cpu_kernels import prefill_attention as prefill_kernel
from engine.cpu_kernels import sampling as draw_kernel
from engine.model import torch_attention
from engine.model.attention_metadata import AttentionMetadata
from engine.sampling.sampler import Sampler


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


def decode_step(args: argparse.Namespace) -> None:
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


def fused_ops(args: argparse.Namespace) -> None:
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


def step_kernels(args: argparse.Namespace) -> None:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = commands.add_parser("decode-step", help="the decode step, C decode attention against the torch path")
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--grow", type=int, default=500, help="tokens decoded between the two timings")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--pairs", type=int, default=2)
    p.set_defaults(run=decode_step)
    p = commands.add_parser("fused-ops", help="bfloat16 prefill and decode, fused elementwise ops against torch's")
    p.add_argument("--model", default="tiny")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--pairs", type=int, default=3)
    p.set_defaults(run=fused_ops)
    p = commands.add_parser("step-kernels", help="the C draw and AMX prefill attention, alone and in the steps")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--pairs", type=int, default=5)
    p.set_defaults(run=step_kernels)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
