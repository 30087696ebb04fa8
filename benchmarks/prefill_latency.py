"""Prefill latency of short prompts on the engine alone: prefill CUDA graphs against the eager forward.

A short prompt's prefill step is host-bound (one H100, 1B shape: 7.8 ms for 64 tokens, eager, against a 1.7 ms
decode step of eight from a CUDA graph), and that step is on every short request's critical path. This program
builds `LLMEngine` with the YAML's prefill-pool settings twice, in turn: prefill graphs off (`prefill_graph_tokens`
0: the reference, measured in the same run) and on (the config's bound, 512 by default). For each prompt length in
`--prompt-lens` and for 1 and `--batch` prompts at once, it adds the prompts, steps until every first token (max_tokens
1), `--iters` times, and prints the p50 wall time of the whole request and of its `step()` calls, the ratio to the
eager engine's, each engine's start-up phases (the graphs' capture time), and the decode step of the same engine
(one token for `--batch` running requests).

    python benchmarks/prefill_latency.py --config configs/gpu-1p1d-llama3-8b.yaml --model /tmp/l1b --device cuda
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from coordinator.config.serve_config import load_serve_config  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--prompt-lens", default="64,256")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
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


if __name__ == "__main__":
    main()
