"""Chaos run: steady load on `pdserve serve` while a worker is killed every `--kill-every` seconds.

Starts the server from a YAML (with `server.admin_api` turned on), sends `pdserve bench`'s load (benchclient's
run_load, the same client and workload as `pdserve bench`) at a fixed rate, and kills the decode and prefill
workers in turn through `POST /admin/workers/{name}/kill`, each `--kill-every` seconds after /health was 200
again. Prints, and writes as Markdown with `--report`:
goodput per time window (requests that finished within the SLO, by finish time), the windows around each kill,
the time each kill took to recover (until /health is 200 again, and until a window's goodput is back to 90% of
the steady state before the first kill), and the requests lost (failed) of all sent: the reference is the
same run's goodput before the first kill.

    python benchmarks/chaos_run.py configs/default.yaml --rate 4 --duration 120 --kill-every 20 \
        --report docs/reliability/chaos-cpu.md
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import secrets
import subprocess
import sys
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

ADMIN_KEY = secrets.token_urlsafe(16)  # this run's operator key (server.admin_api_key)
OPERATOR = {"Authorization": f"Bearer {ADMIN_KEY}"}


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
             f"- command: `python benchmarks/chaos_run.py {' '.join(sys.argv[1:])}`",
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    args = p.parse_args()
    report = asyncio.run(chaos(args))
    print(report)
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
