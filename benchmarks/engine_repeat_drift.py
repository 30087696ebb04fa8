"""Does the offline engine slow down with the requests it has served? `LLM.generate` over fresh prompts of one
shape, `--repeats` times in one process, one row per run: output tok/s, host ms per step() and where it went
(schedule, launch, the wait for sampled tokens, update), the collector's pauses, the block pool (free / cached, the
highest block id in use), tracked objects, the process's RSS, and the GPU's SM clock, temperature and power at the
run's end (nvidia-smi). Issue 13 saw the served and the offline engine on the 1B shape lose 20-30% over 3-4 runs in
one process on an H200 host; this program tells the candidates apart (`--no-prefix-cache`, `--reset-cache` between
runs, `--freeze` the heap between runs).

    python benchmarks/engine_repeat_drift.py --model /tmp/l1b --device cuda --repeats 4
    python benchmarks/engine_repeat_drift.py --repeats 3 --num-prompts 32 --input-len 128 --output-len 32   # tiny, CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine import LLM, SamplingParams  # noqa: E402
from engine.gc_pauses import GcPauses  # noqa: E402
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    args = p.parse_args()

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


if __name__ == "__main__":
    main()
