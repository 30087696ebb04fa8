"""Prefill latency of one short prompt on the engine alone, against the serving phases that contain it.

The tenants benchmark (tenant_priority.py) puts ~11-12 ms of a 64-token prompt's TTFT on the 1B shape in the prefill
worker's `prefill_compute` phase (its first step -> first token out), far above the forward's compute. This program
times the same work with no server around it: `LLMEngine` with the YAML's prefill-pool settings, one prompt of
`--prompt-len` random ids added, stepped until its first token (max_tokens 1), `--iters` times, and the same with
`--batch` prompts at once; each line prints the p50 wall time of the whole request and of its `step()` calls, and the
decode step of the same engine (one token for `--batch` running requests) as the reference measured in the same run.

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
from coordinator.serve_config import load_serve_config  # noqa: E402
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--prompt-len", type=int, default=64)
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
    engine = LLMEngine(config)
    vocab = engine.model_config.vocab_size
    rows = {}
    for batch in (1, args.batch):
        for i in range(3):  # warm-up: kernels specialise per shape
            _prefill(engine, _prompts(batch, args.prompt_len, vocab, 100 + i), f"w{batch}-{i}", args.device)
        walls, steps = [], []
        for i in range(args.iters):
            wall, stepping = _prefill(engine, _prompts(batch, args.prompt_len, vocab, i), f"m{batch}-{i}", args.device)
            walls.append(wall)
            steps.append(stepping)
        rows[batch] = {"prefill_ms_p50": 1e3 * statistics.median(walls),
                       "step_calls_ms_p50": 1e3 * statistics.median(steps)}
    decode = 1e3 * _decode_step(engine, _prompts(args.batch, args.prompt_len, vocab, 999), args.device)
    for batch, row in rows.items():
        print(json.dumps({"model": args.model, "prompt_len": args.prompt_len, "prompts": batch,
                          **{k: round(v, 3) for k, v in row.items()},
                          f"decode_step_ms_batch_{args.batch}": round(decode, 3),
                          "prefill_over_decode_step": round(row["prefill_ms_p50"] / decode, 2)}), flush=True)


if __name__ == "__main__":
    main()
