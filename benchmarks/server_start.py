"""Start-up against another checkout's, interleaved: /health 200 first and second time, the first structured request,
a worker replacement.

    python benchmarks/server_start.py --against /tmp/base --rounds 2     # base: git worktree add /tmp/base <commit>

Each round runs, for the other checkout and then this one (same config: `--config`, the CPU default with half a CPU
per worker unless given), two servers one after the other on a fresh cache folder (PDSERVE_CACHE): the first start
finds it empty (the `tiny` checkpoint is built, the CPU kernels compiled), the second finds
what the first left. Each server is timed from launching `pdserve serve` to /health 200 (polled every 0.5 s by the
launcher, for both checkouts alike); then `--streams` greedy streams run (a chunk per token) and one `json_schema`
chat request is sent: its latency, and the longest gap between two chunks of the other streams while it ran (the
pause its grammar's set-up inflicts on them; `gap_before_s`, the longest gap before it was sent, is the same
streams' ordinary jitter); then `--kill` is SIGKILLed (POST /admin/workers/NAME/kill) and timed
until /health shows the slot replaced, live, 200, with its start-up phases as /health reports them (where the
checkout reports them). Prints every server's figures and, per measure, the means and their ratio (this / other).
The other checkout runs with its own directory first on PYTHONPATH (its coordinator and workers import its code).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
ONE_SERVER = r"""
import asyncio, json, sys, tempfile, time
import httpx, yaml
from pathlib import Path
from tests.server_process import OPERATOR, running_server

config = yaml.safe_load(Path(sys.argv[1]).read_text())
half, streams, kill = sys.argv[2] == "half", int(sys.argv[3]), sys.argv[4]
if half:
    for pool in ("prefill", "decode"):
        config.setdefault(pool, {})["num_cpus"] = 0.5
config.setdefault("server", {})["admin_api"] = True
config.setdefault("recovery", {}).setdefault("backoff_initial_s", 0.1)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


async def stream(client, url, prompt, stop, gaps):
    while not stop.is_set():
        body = {"model": config["model"], "prompt": prompt, "max_tokens": 64, "ignore_eos": True, "stream": True,
                "temperature": 0, "logprobs": 0}
        last = None
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append((last, now))
                    last = now


async def structured(url):
    gaps, stop = [], asyncio.Event()
    async with httpx.AsyncClient(timeout=300) as client:
        tasks = [asyncio.create_task(stream(client, url, [10 + i, 20, 30, 40], stop, gaps)) for i in range(streams)]
        while len(gaps) < 10 * streams:
            await asyncio.sleep(0.05)
        sent = time.perf_counter()
        r = await client.post(f"{url}/v1/chat/completions", json={
            "model": config["model"], "messages": [{"role": "user", "content": "a person"}], "max_tokens": 16,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}})
        done = time.perf_counter()
        stop.set()
        await asyncio.gather(*tasks)
    assert r.status_code == 200, r.text
    during = [b - a for a, b in gaps if b > sent and a < done]
    before = [b - a for a, b in gaps if b <= sent]
    return done - sent, max(during, default=0.0), max(before, default=0.0)


async def replacement(url):
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=OPERATOR) as admin:
        slot = lambda h: next(w for w in h.json()["workers"] if w["name"] == kill)
        restarts = slot(await admin.get("/health"))["restarts"]
        killed = time.perf_counter()
        assert (await admin.post(f"/admin/workers/{kill}/kill")).status_code == 200
        while True:
            h = await admin.get("/health")
            w = slot(h)
            if w["restarts"] > restarts and w["state"] == "live" and h.status_code == 200:
                return time.perf_counter() - killed, w.get("last_recovery_s", {}), w.get("start_phases_s")
            await asyncio.sleep(0.02)


with tempfile.TemporaryDirectory() as tmp:
    t = time.perf_counter()
    with running_server(Path(tmp), config) as server:
        start_s = time.perf_counter() - t
        structured_s, stall_s, gap_before_s = asyncio.run(structured(server.url))
        replace_s, recovery, phases = asyncio.run(replacement(server.url))
    print(json.dumps({"start_s": start_s, "structured_s": structured_s, "stall_s": stall_s,
                      "gap_before_s": gap_before_s, "replace_s": replace_s,
                      "replacement_phases_s": {k: round(v, 2) for k, v in (phases or recovery).items()}}))
"""
MEASURES = ("start_s", "structured_s", "stall_s", "gap_before_s", "replace_s")


def one_server(checkout: Path, config: Path, half: bool, cache: Path, streams: int, kill: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")]),
           "PDSERVE_CACHE": str(cache)}
    out = subprocess.run([sys.executable, "-c", ONE_SERVER, str(config), "half" if half else "as-is", str(streams),
                          kill], cwd=checkout, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"a server in {checkout} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--against", type=Path, required=True, help="another checkout (e.g. a git worktree)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--config", type=Path, default=HERE / "configs/default.yaml")
    p.add_argument("--as-is", action="store_true", help="keep the config's num_cpus (default: half a CPU each)")
    p.add_argument("--streams", type=int, default=4, help="streams running while the structured request is served")
    p.add_argument("--kill", default="decode-0", help="the worker to kill and time until replaced")
    args = p.parse_args()
    runs: dict[str, dict[str, list[dict]]] = {"this": {"first": [], "second": []}, "other": {"first": [], "second": []}}
    for _ in range(args.rounds):
        for side, checkout in (("other", args.against.resolve()), ("this", HERE)):
            with tempfile.TemporaryDirectory(prefix="pdserve-cache-") as cache:
                for start in ("first", "second"):
                    row = one_server(checkout, args.config.resolve(), not args.as_is, Path(cache), args.streams,
                                     args.kill)
                    runs[side][start].append(row)
                    print(json.dumps({"checkout": side, "start": start,
                                      **{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}}),
                          flush=True)
    for start in ("first", "second"):
        summary = {"start": start}
        for measure in MEASURES:
            mine = statistics.mean(r[measure] for r in runs["this"][start])
            other = statistics.mean(r[measure] for r in runs["other"][start])
            summary[measure] = {"this": round(mine, 3), "other": round(other, 3), "ratio": round(mine / other, 3)}
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
