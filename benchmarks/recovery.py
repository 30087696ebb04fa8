"""A worker of a running `pdserve serve` killed under load: how the server comes back, and what the load loses.
Produces docs/benchmarks.md's "Reliability: a killed worker" rows (`kill` on the GPU, `chaos` on the CPU) and
docs/reliability/chaos-cpu.md (`chaos --report`).

`python benchmarks/recovery.py COMMAND CONFIG [options]`:

- `kill` (`bash benchmarks/gpu_run.sh recovery`, `x4kill`): recovery time. For each worker named with --kill (in
  turn), while `--streams` greedy streams run in a closed loop: the kill goes through
  `POST /admin/workers/{name}/kill`; the client side measures the time until /health shows the slot down (death
  noticed; or already replaced) and live again with /health 200, the longest gap between two chunks of any stream
  (the pause a user sees) and whether every stream still got exactly its tokens; the server side reports the
  replacement's phases from /health (`last_recovery_s`: backoff, actor start = process + engine, engine = weights,
  KV cache and CUDA graphs, agent, peer exchange; a warm spare's `takeover_s` instead of a start). With
  `recovery.spares`, each kill waits until the spares are ready. The reference is the same run's chunk gap p50
  before the kill. Pauses with and without the fallback: `--set recovery.fallback=false`; with spares `--set
  recovery.spares=1`.
- `chaos`: steady load on `pdserve serve` while a worker is killed every `--kill-every` seconds. Starts the server
  from a YAML (with `server.admin_api` turned on), sends `pdserve bench`'s load (benchclient's run_load, the same
  client and workload as `pdserve bench`) at a fixed rate, and kills the decode and prefill workers in turn through
  `POST /admin/workers/{name}/kill`, each `--kill-every` seconds after /health was 200 again. Prints, and writes as
  Markdown with `--report`: goodput per time window (requests that finished within the SLO, by finish time), the
  windows around each kill, the time each kill took to recover (until /health is 200 again, and until a window's
  goodput is back to 90% of the steady state before the first kill), and the requests lost (failed) of all sent:
  the reference is the same run's goodput before the first kill.

    python benchmarks/recovery.py kill configs/gpu-1p1d-llama3-8b.yaml --model /tmp/l1b --kill decode-0 prefill-0
    python benchmarks/recovery.py kill configs/gpu-1p1d-llama3-70b-tp2.yaml --model /tmp/l70b \
        --set load_format=dummy --kill decode-0:1   # one rank of the decode TP group (4 GPUs): replaced whole
    python benchmarks/recovery.py chaos configs/default.yaml --rate 4 --duration 120 --kill-every 20 \
        --report docs/reliability/chaos-cpu.md

(Until f1a5769 `chaos` was its own program, chaos_run.py, and `kill` this program without a command word.)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from benchclient.arrivals import ArrivalSpec
from benchclient.client import Target
from benchclient.launcher import launched_server
from benchclient.run import RunConfig, run_load
from benchclient.stats import SLO
from benchclient.workload import WorkloadSpec
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


def kill_mode(args: argparse.Namespace) -> None:
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


async def _killer(url: str, roles: list[str], every_s: float, until: float, log: list[dict]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=OPERATOR) as client:
        k = 0
        while time.perf_counter() + every_s < until:
            await asyncio.sleep(every_s)
            name = f"{roles[k % len(roles)]}-0"
            killed_at = time.perf_counter()
            r = await client.post(f"/admin/workers/{name}/kill")
            entry = {"worker": name, "at": killed_at, "status": r.status_code, "healthy_at": None}
            while (await client.get("/health")).status_code != 200:
                await asyncio.sleep(0.05)
            entry["healthy_at"] = time.perf_counter()
            log.append(entry)
            k += 1


def _windows(results, slo: SLO, t0: float, width: float, horizon: float) -> list[tuple[float, int, int]]:
    """(window start, good requests finished in it, failed requests finished in it)."""
    n = int(horizon // width) + 1
    good, bad = [0] * n, [0] * n
    for r in results:
        if r.end is None:
            continue
        i = min(n - 1, max(0, int((r.end - t0) // width)))
        meets = r.ok and r.ttft is not None and r.ttft * 1000 <= slo.ttft_ms and (
            r.tpot is None or r.tpot * 1000 <= slo.tpot_ms)
        if meets:
            good[i] += 1
        elif not r.ok:
            bad[i] += 1
    return [(i * width, good[i], bad[i]) for i in range(n)]


async def chaos(args: argparse.Namespace) -> str:
    config = yaml.safe_load(Path(args.config).read_text()) or {}
    config.setdefault("server", {}).update(admin_api=True, admin_api_key=ADMIN_KEY)
    config["server"]["port"] = None
    mode = config.get("mode", "disaggregated")
    roles = ["decode", "prefill"] if mode == "disaggregated" else ["decode"]
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    with launched_server(config, workdir, 600, 120) as server:
        model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
        cfg = RunConfig(Target(server.url, model, ignore_eos=True),
                        WorkloadSpec(kind="fixed", input_len=args.input_len, output_len=args.output_len),
                        ArrivalSpec(rate=args.rate), slo, duration_s=args.duration, warmup_s=0.0, timeout_s=300)
        kills: list[dict] = []
        t0 = time.perf_counter()
        results, _ = await asyncio.gather(run_load(cfg), _killer(server.url, roles, args.kill_every,
                                                                t0 + args.duration, kills))
    width = args.window
    windows = _windows(results, slo, t0, width, args.duration + 60)
    first_kill = kills[0]["at"] - t0 if kills else args.duration
    steady = [g for start, g, _ in windows if start + width <= first_kill]
    baseline = sum(steady) / len(steady) if steady else 0.0
    lines = [f"# Chaos run: {mode}, a worker killed {args.kill_every:g} s after the previous one recovered", "",
             f"- command: `python benchmarks/recovery.py {' '.join(sys.argv[1:])}`",
             f"- commit: {_commit()}, {datetime.date.today()}, machine: {args.machine}",
             f"- load: {args.rate:g} req/s, {args.input_len} in / {args.output_len} out, "
             f"SLO TTFT {slo.ttft_ms:g} ms, TPOT {slo.tpot_ms:g} ms",
             f"- sent {len(results)}, failed {sum(1 for r in results if not r.ok)}, "
             f"good {sum(g for _, g, _ in windows)}",
             f"- reference: goodput per {width:g} s window before the first kill: {baseline:.2f}", "",
             "| kill | worker | /health 200 again after | goodput back to 90% after |", "|---|---|---|---|"]
    for k in kills:
        at = k["at"] - t0
        back = next((start + width - at for start, g, _ in windows if start >= at and g >= 0.9 * baseline), None)
        recovered = f"{back:.1f} s" if back is not None else "not within the run"
        lines.append(f"| {at:.1f} s | {k['worker']} | {k['healthy_at'] - k['at']:.2f} s | {recovered} |")
    lines += ["", "| window start (s) | good requests finished | failed | ratio to reference |", "|---|---|---|---|"]
    for start, g, b in windows:
        if start < args.duration:
            mark = " (kill)" if any(start <= k["at"] - t0 < start + width for k in kills) else ""
            ratio = f"{g / baseline:.2f}" if baseline else "-"
            lines.append(f"| {start:.0f}{mark} | {g} | {b} | {ratio} |")
    return "\n".join(lines) + "\n"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def chaos_mode(args: argparse.Namespace) -> None:
    report = asyncio.run(chaos(args))
    print(report)
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = commands.add_parser("kill", help="kill the named workers in turn under streams, time each recovery")
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
    p.set_defaults(run=kill_mode)
    p = commands.add_parser("chaos", help="a worker killed every --kill-every s under steady load: goodput windows")
    p.add_argument("config")
    p.add_argument("--rate", type=float, default=4.0)
    p.add_argument("--duration", type=float, default=120.0)
    p.add_argument("--kill-every", type=float, default=20.0)
    p.add_argument("--window", type=float, default=5.0)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--workdir", default="/tmp/pdserve-chaos")
    p.add_argument("--machine", default="the 2-core CPU machine")
    p.add_argument("--report", help="also write the Markdown report here")
    p.set_defaults(run=chaos_mode)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
