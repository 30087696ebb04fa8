"""The engine's host time on its own (no server): does it grow run after run, and does a short prompt's prefill wait
on it. Issue 13's questions; `bash benchmarks/gpu_run.sh drift` and `prefill` run it. Its figures are in
docs/benchmark-log.md only (docs/benchmarks.md lists the 64-token prefill under "Not carried over": measured before
prefill CUDA graphs).

`python benchmarks/engine_host.py COMMAND [options]`:

- `drift`: does the offline engine slow down with the requests it has served? `LLM.generate` over fresh prompts of
  one shape, `--repeats` times in one process, one row per run: output tok/s, host ms per step() and where it went
  (schedule, launch, the wait for sampled tokens, update), the collector's pauses, the block pool (free / cached,
  the highest block id in use), tracked objects, the process's RSS, and the GPU's SM clock, temperature and power at
  the run's end (nvidia-smi). Issue 13 saw the served and the offline engine on the 1B shape lose 20-30% over 3-4
  runs in one process on an H200 host; this tells the candidates apart (`--no-prefix-cache`, `--reset-cache`
  between runs, `--freeze` the heap between runs).
- `prefill`: prefill latency of short prompts, prefill CUDA graphs against the eager forward. A short prompt's
  prefill step is host-bound (one H100, 1B shape: 7.8 ms for 64 tokens, eager, against a 1.7 ms decode step of
  eight from a CUDA graph), and that step is on every short request's critical path. This builds `LLMEngine` with
  the YAML's prefill-pool settings twice, in turn: prefill graphs off (`prefill_graph_tokens` 0: the reference,
  measured in the same run) and on (the config's bound, 512 by default). For each prompt length in `--prompt-lens`
  and for 1 and `--batch` prompts at once, it adds the prompts, steps until every first token (max_tokens 1),
  `--iters` times, and prints the p50 wall time of the whole request and of its `step()` calls, the ratio to the
  eager engine's, each engine's start-up phases (the graphs' capture time), and the decode step of the same engine
  (one token for `--batch` running requests).

    python benchmarks/engine_host.py drift --model /tmp/l1b --device cuda --repeats 4
    python benchmarks/engine_host.py drift --repeats 3 --num-prompts 32 --input-len 128 --output-len 32   # tiny, CPU
    python benchmarks/engine_host.py prefill --config configs/gpu-1p1d-llama3-8b.yaml --model /tmp/l1b --device cuda

(Until f1a5769 these were two programs: engine_repeat_drift.py and prefill_latency.py.)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from coordinator.config.serve_config import load_serve_config  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.gc_pauses import GcPauses  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.runner.model_runner import LaunchedStep  # noqa: E402


def _timed(owner: object, name: str, totals: dict[str, float]) -> None:
    """Wrap owner.name so its wall time adds up in totals[name]."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start
    setattr(owner, name, wrapper)


def _gpu_state() -> dict:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw",
                              "--format=csv,noheader,nounits", "-i", os.environ.get("CUDA_VISIBLE_DEVICES", "0")],
                             capture_output=True, text=True, timeout=10).stdout.split(",")
        return {"sm_mhz": float(out[0]), "mem_mhz": float(out[1]), "temp_c": float(out[2]), "power_w": float(out[3])}
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return {}


def closed_loop(engine, prompts: list[list[int]], params: SamplingParams, in_flight: int, delay_steps: int,
                prefix: str) -> int:
    """Run `prompts` keeping `in_flight` requests going: a finished request's successor is added `delay_steps`
    steps after the step that returned its end. Returns the output tokens."""
    queue = list(reversed(prompts))
    due = [0] * min(in_flight, len(queue))  # the step at which each next request is added, in order
    tokens, step, live = 0, 0, 0
    while due or live:
        while due and due[0] <= step:
            due.pop(0)
            engine.add_request(f"{prefix}{len(queue)}", queue.pop(), params)
            live += 1
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                live -= 1
                if len(queue) > len(due):  # a prompt is left without a slot yet: it succeeds this one
                    due.append(step + delay_steps)
        step += 1
    return tokens


def drift(args: argparse.Namespace) -> None:
    p = args.parser

    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              enable_prefix_caching=not args.no_prefix_cache)
    engine = llm.engine
    totals: dict[str, float] = defaultdict(float)
    for name in ("schedule", "schedule_after", "update"):
        _timed(engine.scheduler, name, totals)
    _timed(engine.runner, "launch", totals)
    _timed(engine, "_apply", totals)
    _timed(LaunchedStep, "result", totals)  # the wait for a step's sampled tokens
    pauses = GcPauses()
    pauses.install()
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    blocks = engine.block_manager
    highest = [0]
    pop_free = blocks._pop_free

    def tracked_pop_free() -> int:  # the highest block id a run touched
        b = pop_free()
        highest[0] = max(highest[0], b)
        return b
    blocks._pop_free = tracked_pop_free
    print(json.dumps({"variant": {k: v for k, v in vars(args).items() if v != p.get_default(k)},
                      "num_kv_blocks": blocks.num_blocks, "gpu": _gpu_state()}))
    for repeat in range(args.repeats + 1):  # run 0 is a warm-up (a quarter of the prompts)
        rng = random.Random(repeat)
        n = args.num_prompts if repeat else max(1, args.num_prompts // 4)
        prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(n)]
        if repeat and args.reset_cache:
            blocks.reset_prefix_cache()
        if repeat and args.freeze:
            gc.collect()
            gc.freeze()
        totals.clear()
        highest[0] = 0
        steps, gc0 = engine.num_steps, dict(pauses.figures())
        step_s = engine.step_time_total_s
        start = time.perf_counter()
        if args.closed_loop is None:
            tokens = sum(len(o.token_ids) for o in llm.generate(prompts, params))
        else:
            tokens = closed_loop(engine, prompts, params, args.max_num_seqs, args.closed_loop, f"r{repeat}-")
        wall = time.perf_counter() - start
        if not repeat:
            continue
        num = max(1, engine.num_steps - steps)
        gc1 = pauses.figures()
        print(json.dumps({
            "run": repeat, "tok_s": round(tokens / wall), "steps": num,
            "step_ms": round((engine.step_time_total_s - step_s) * 1000 / num, 3),
            **{f"{k}_ms": round(v * 1000 / num, 3) for k, v in sorted(totals.items())},
            "gc_pauses": gc1["gc_pauses_total"] - gc0["gc_pauses_total"],
            "gc_full": gc1["gc_full_collections_total"] - gc0["gc_full_collections_total"],
            "gc_ms": round((gc1["gc_pause_seconds_total"] - gc0["gc_pause_seconds_total"]) * 1000, 1),
            "free_blocks": len(blocks._free),
            "cached_blocks": blocks.num_cached_blocks,
            "highest_block": highest[0],
            "tracked_objects": len(gc.get_objects()),
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
            **_gpu_state()}), flush=True)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab - 10, (length,), generator=g).tolist() for _ in range(n)]


def _prefill(engine: LLMEngine, prompts: list[list[int]], tag: str, device: str) -> tuple[float, float]:
    """Wall seconds from adding `prompts` to every first token, and of the step() calls inside it."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    _sync(device)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    stepping = 0.0
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        stepping += time.perf_counter() - t
    _sync(device)
    return time.perf_counter() - start, stepping


def _decode_step(engine: LLMEngine, prompts: list[list[int]], device: str, steps: int = 20) -> float:
    """p50 seconds of one step with len(prompts) requests decoding."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"dec-{i}", p, params)
    times = []
    while engine.has_unfinished():
        _sync(device)
        t = time.perf_counter()
        outs = engine.step()
        _sync(device)
        if outs and all(len(o.new_token_ids) == 1 for o in outs) and len(outs) == len(prompts):
            times.append(time.perf_counter() - t)
    return statistics.median(times[2:] or times)


def _measure(engine: LLMEngine, args, length: int, batch: int) -> dict:
    vocab = engine.model_config.vocab_size
    for i in range(3):  # warm-up
        _prefill(engine, _prompts(batch, length, vocab, 100 + i), f"w{length}-{batch}-{i}", args.device)
    walls, steps = [], []
    for i in range(args.iters):
        wall, stepping = _prefill(engine, _prompts(batch, length, vocab, i), f"m{length}-{batch}-{i}", args.device)
        walls.append(wall)
        steps.append(stepping)
    return {"prefill_ms_p50": 1e3 * statistics.median(walls), "step_calls_ms_p50": 1e3 * statistics.median(steps)}


def prefill(args: argparse.Namespace) -> None:
    raw = yaml.safe_load(Path(args.config).read_text())
    raw.pop("ray_address", None)
    raw["model"] = args.model
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(raw, f)
        f.flush()
        serve = load_serve_config(f.name)
    config = serve.engine_config(serve.prefill)
    if args.device == "cpu":
        config = dataclasses.replace(config, device="cpu")
    lengths = [int(x) for x in args.prompt_lens.split(",")]
    eager: dict[tuple[int, int], dict] = {}
    for tokens in (0, config.prefill_graph_tokens):
        engine = LLMEngine(dataclasses.replace(config, prefill_graph_tokens=tokens))
        vocab = engine.model_config.vocab_size
        graphs = engine.runner.prefill_graphs
        decode = 1e3 * _decode_step(engine, _prompts(args.batch, 64, vocab, 999), args.device)
        for length in lengths:
            for batch in (1, args.batch):
                before = graphs.replays if graphs else 0
                row = _measure(engine, args, length, batch)
                ref = eager.setdefault((length, batch), row)
                print(json.dumps({"model": args.model, "prefill_graph_tokens": tokens, "prompt_len": length,
                                  "prompts": batch, **{k: round(v, 3) for k, v in row.items()},
                                  "eager_prefill_ms_p50": round(ref["prefill_ms_p50"], 3),
                                  "over_eager": round(row["prefill_ms_p50"] / ref["prefill_ms_p50"], 3),
                                  "graph_replays": (graphs.replays - before) if graphs else 0,
                                  f"decode_step_ms_batch_{args.batch}": round(decode, 3),
                                  "prefill_over_decode_step": round(row["prefill_ms_p50"] / decode, 2)}), flush=True)
        print(json.dumps({"prefill_graph_tokens": tokens, "startup_s": dict(engine.startup_s)}), flush=True)
        del engine, graphs
        if args.device == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = commands.add_parser("drift", help="the offline engine run after run in one process: does it slow down")
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--reset-cache", action="store_true", help="reset the prefix cache between runs")
    p.add_argument("--freeze", action="store_true", help="gc.collect() + gc.freeze() between runs")
    p.add_argument("--closed-loop", type=int, default=None, metavar="K",
                   help="instead of LLM.generate's waves, keep --max-num-seqs requests in flight, each finished "
                        "one replaced K steps later (a server's closed loop without its network)")
    # command, run and parser as defaults: the variant line prints only what differs from a default
    p.set_defaults(command="drift", run=drift, parser=p)
    p = commands.add_parser("prefill", help="short prompts' prefill, CUDA graphs against eager, next to a decode step")
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--prompt-lens", default="64,256")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--iters", type=int, default=50)
    p.set_defaults(run=prefill)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
