"""Recovery time: kill a worker of a running `pdserve serve` under streaming load and time how it comes back.

For each worker named with --kill (in turn), while `--streams` greedy streams run in a closed loop: the kill goes
through `POST /admin/workers/{name}/kill`; the client side measures the time until /health shows the slot down
(death noticed; or already replaced) and live again with /health 200, the longest gap between two chunks of any
stream (the pause a user sees) and whether every stream still got exactly its tokens; the server side reports the
replacement's phases from /health (`last_recovery_s`: backoff, actor start = process + engine, engine = weights, KV
cache and CUDA graphs, agent, peer exchange; a warm spare's `takeover_s` instead of a start). With
`recovery.spares`, each kill waits until the spares are ready. The reference is the same run's chunk gap p50 before
the kill. Pauses with and without the fallback: `--set recovery.fallback=false`; with spares `--set
recovery.spares=1`.

    python benchmarks/recovery.py configs/gpu-1p1d-llama3-8b.yaml --model /tmp/l1b --kill decode-0 prefill-0
    python benchmarks/recovery.py configs/gpu-1p1d-llama3-70b-tp2.yaml --model /tmp/l70b --set load_format=dummy \
        --kill decode-0:1      # one rank of the decode TP group (4 GPUs): the group is replaced whole
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from coordinator.config.serve_config import set_dotted
from tests.server_process import running_server

ADMIN_KEY = secrets.token_urlsafe(16)  # this run's operator key (server.admin_api_key)
OPERATOR = {"Authorization": f"Bearer {ADMIN_KEY}"}


async def _stream(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0, "logprobs": 0,  # a chunk per token, even one that decodes to no text
            "stream_options": {"include_usage": True}}
    stamps, tokens, error = [], 0, None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            error = chunk.get("error") or error
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                stamps.append(time.perf_counter())
    return {"stamps": stamps, "tokens": tokens, "error": error, "status": r.status_code}


async def _load(url: str, model: str, args, stop: asyncio.Event, results: list[dict]) -> None:
    rng = random.Random(0)

    async def loop(client):
        while not stop.is_set():
            prompt = [rng.randrange(3, 1000) for _ in range(args.prompt_len)]
            results.append(await _stream(client, url, model, prompt, args.max_tokens))
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000)) as client:
        await asyncio.gather(*[loop(client) for _ in range(args.streams)])


async def _until_slot(client: httpx.AsyncClient, name: str, restarts: int, live: bool, timeout_s: float) -> float:
    """When slot `name` was seen not live (`live` false) or live again (true) after `restarts` restarts, and the
    server healthy: polled from /health (a spare's takeover may be over before a poll sees the slot down)."""
    deadline = time.perf_counter() + timeout_s
    while True:
        r = await client.get("/health")
        slot = next(w for w in r.json()["workers"] if w["name"] == name)
        again = slot["restarts"] > restarts
        if (again and slot["state"] == "live" and r.status_code == 200) if live else (again or slot["state"] != "live"):
            return time.perf_counter()
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{name} not {'back' if live else 'down'} within {timeout_s} s: {r.text}")
        await asyncio.sleep(0.02)


async def _until_spares(client: httpx.AsyncClient, wanted: int, timeout_s: float) -> None:
    """Until /health lists `wanted` warm spares (recovery.spares per pool: they start after the pools)."""
    deadline = time.perf_counter() + timeout_s
    while sum(w["state"] == "spare" for w in (await client.get("/health")).json()["workers"]) < wanted:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"fewer than {wanted} spares ready within {timeout_s} s")
        await asyncio.sleep(0.2)


async def drive(url: str, model: str, args) -> list[dict]:
    rows = []
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=OPERATOR) as admin:
        for target in args.kill:
            name, _, rank = target.partition(":")  # "decode-0:1": rank 1 of decode-0's tensor-parallel group
            query = f"?rank={rank}" if rank else ""
            await _until_spares(admin, args.spares, args.recovery_timeout_s)
            restarts = next(w["restarts"] for w in (await admin.get("/health")).json()["workers"] if w["name"] == name)
            stop, results = asyncio.Event(), []
            load = asyncio.create_task(_load(url, model, args, stop, results))
            await asyncio.sleep(args.settle_s)
            before = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:], strict=False)]
            killed = time.perf_counter()
            assert (await admin.post(f"/admin/workers/{name}/kill{query}")).status_code == 200
            print(f"killed {target} after {len(results)} finished requests", flush=True)
            noticed = await _until_slot(admin, name, restarts, False, args.recovery_timeout_s)
            back = await _until_slot(admin, name, restarts, True, args.recovery_timeout_s)
            print(f"{name} back after {back - killed:.2f} s", flush=True)
            await asyncio.sleep(args.settle_s)
            stop.set()
            await load
            health = (await admin.get("/health")).json()
            phases = next(w.get("last_recovery_s", {}) for w in health["workers"] if w["name"] == name)
            spanning = [r for r in results if r["stamps"] and r["stamps"][0] < killed < r["stamps"][-1]]
            gaps = [b - a for r in spanning for a, b in zip(r["stamps"], r["stamps"][1:], strict=False)]
            failed = sum(1 for r in results if r["error"] or r["status"] != 200)
            rows.append({"worker": target, "streams_through_kill": len(spanning), "requests": len(results),
                         "failed": failed,
                         "exact_token_counts": all(r["tokens"] == args.max_tokens for r in results),
                         "death_noticed_s": round(noticed - killed, 3), "healthy_again_s": round(back - killed, 3),
                         "longest_stream_pause_s": round(max(gaps, default=0.0), 3),
                         "chunk_gap_ms_p50_before": round(statistics.median(before) * 1000, 2) if before else None,
                         "server_phases_s": {k: round(v, 3) for k, v in phases.items()}})
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("--model", help="overrides the config's model")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. load_format=dummy (YAML value syntax)")
    p.add_argument("--kill", nargs="+", default=["decode-0"],
                   help="workers to kill in turn; NAME:RANK kills one rank of a tensor-parallel worker")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--settle-s", type=float, default=5.0)
    p.add_argument("--recovery-timeout-s", type=float, default=240.0)
    p.add_argument("--workdir", help="keep the server's config and log here (default: a temporary folder)")
    args = p.parse_args()
    config = yaml.safe_load(Path(args.config).read_text())
    config.pop("ray_address", None)
    if args.model:
        config["model"] = args.model
    set_dotted(config, {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)})
    config.setdefault("server", {}).update(admin_api=True, admin_api_key=ADMIN_KEY)
    config.setdefault("recovery", {}).setdefault("backoff_initial_s", 0.1)
    recovery = config["recovery"]
    args.spares = recovery.get("spares", 0) * (1 if config.get("mode") == "collocated" else 2)
    with tempfile.TemporaryDirectory() as tmp, running_server(Path(args.workdir or tmp), config) as server:
        print(f"serving {config['model']} at {server.url}", flush=True)
        for row in asyncio.run(drive(server.url, config["model"], args)):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
