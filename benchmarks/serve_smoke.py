"""Start `pdserve serve` from a config, send concurrent streaming requests, print one JSON line of figures.

`python benchmarks/serve_smoke.py configs/gpu-1p1d-llama3-8b.yaml --model /tmp/l1b --requests 64`
Reports TTFT and time-per-output-token percentiles, gaps between SSE chunks, output tokens/s, and the KV-transfer
counters from /metrics.
A functional check of a deployment, not a tuned benchmark (that is `pdserve bench`, to come).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from coordinator.config.serve_config import set_dotted
from tests.server_process import metric_values, running_server


async def stream_one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}
    start, stamps, tokens = time.perf_counter(), [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                stamps.append(time.perf_counter())  # chunks may merge tokens held back for UTF-8
    return {"ttft": stamps[0] - start, "itl": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
            "tokens": tokens, "e2e": stamps[-1] - start}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))] * 1000, 2)


async def drive(url: str, model: str, args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000)) as client:
        await stream_one(client, url, model, prompts[0][:16], 4)  # warm-up
        start = time.perf_counter()
        results = await asyncio.gather(*[stream_one(client, url, model, p, args.max_tokens) for p in prompts])
        wall = time.perf_counter() - start
    itl = [x for r in results for x in r["itl"]]  # gaps between SSE chunks (a chunk may carry several tokens)
    tpot = [(r["e2e"] - r["ttft"]) / max(1, r["tokens"] - 1) for r in results]  # time per output token
    return {"requests": args.requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
            "all_tokens_received": all(r["tokens"] == args.max_tokens for r in results),
            "ttft_ms_p50": pct([r["ttft"] for r in results], 0.5),
            "ttft_ms_p90": pct([r["ttft"] for r in results], 0.9),
            "tpot_ms_p50": pct(tpot, 0.5), "tpot_ms_p90": pct(tpot, 0.9),
            "chunk_gap_ms_p50": pct(itl, 0.5), "chunk_gap_ms_p99": pct(itl, 0.99),
            "e2e_s_mean": round(statistics.mean(r["e2e"] for r in results), 3),
            "output_tokens_per_s": round(sum(r["tokens"] for r in results) / wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--model", help="overrides the config's model")
    parser.add_argument("--mode", help="overrides the config's mode")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. decode.workers=2 (YAML value syntax)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    config = yaml.safe_load(Path(args.config).read_text())
    config.pop("ray_address", None)
    config |= {k: v for k, v in (("model", args.model), ("mode", args.mode)) if v}
    set_dotted(config, {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)})
    with tempfile.TemporaryDirectory() as tmp, running_server(Path(tmp), config) as server:
        url = server.url
        figures = asyncio.run(drive(url, config["model"], args))
        figures["mode"] = config.get("mode", "disaggregated")
        time.sleep(2.5)  # the backend refreshes transfer counters every second
        for name in ("bytes_total", "failures_total", "read_count", "read_bytes", "read_seconds_sum",
                     "read_seconds_max"):
            values = metric_values(url, f"pdserve_transfer_{name}")
            if values:
                figures[f"transfer_{name}"] = sum(values.values())
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
