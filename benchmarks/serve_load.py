"""`pdserve serve` started from a config (with overrides) and driven by a load, figures as JSON lines. Produces
docs/benchmarks.md's served 70B rows (`smoke`: "70B FP8 collocated on one GPU" of the FP8 table, Q = `bash
benchmarks/gpu_run.sh fp8_70b`; "70B served collocated at TP=2" of the tensor-parallelism table, `tp70b`), the served
8B FP8 against bf16 rows (`bash benchmarks/gpu_run.sh fp8serve`) and the shifting-load report (`shift`:
docs/sweeps/gpu-4x-llama3-8b-adaptive-shift, `bash benchmarks/gpu_run.sh shift4`).

`python benchmarks/serve_load.py COMMAND CONFIG [options]`:

- `smoke --model /tmp/l1b --requests 64`: send concurrent streaming requests (all at once, after one warm-up), print
  one JSON line of figures per `--rounds` (the first cold, later ones warm: the same prompts again, so prefix-cache
  hits): TTFT and time-per-output-token percentiles, gaps between SSE chunks and tokens per chunk, output tokens/s,
  the busiest client process's CPU seconds per second (near 1 it may pace what it measures: `--client-processes N`
  streams from N processes, benchclient.client_processes), the KV-transfer
  counters from /metrics and, with `--floor`, TPOT and the median chunk gap over the decode floor measured before the
  server starts (benchmarks/read_floor.py: the step's weight and KV bytes over the copy rate). A functional check of
  a deployment, not a tuned benchmark (that is `pdserve bench`). It first waits (up to `--graphs-timeout-s`) until no
  worker has CUDA graphs left to capture: a worker captures most of them while it serves (EngineConfig.graph_capture
  "deferred"), between steps, and those captures would fall in the measured streams (a steady-state figure; the
  first seconds after a start are benchmarks/start.py's).
- `shift --set k=v ... --phase NAME:RATE:INPUT:OUTPUT:SECONDS ... --out DIR`: a load that changes during the run,
  served in mode adaptive: does the layout follow it? Launches `pdserve serve` (CONFIG with the `--set` overrides;
  mode adaptive, or a static layout to compare), then sends the phases one after the other without a gap (Poisson
  arrivals, the chat workload around INPUT prompt and OUTPUT output tokens, token-id prompts, ignore_eos), while it
  records every 0.5 s each worker's role (/health) and the prefill placements so far (/metrics). It prints, per time
  bin, the goodput under the config's SLO (requests sent in the bin that met both targets, per second) next to the
  offered rate, the TTFT and TPOT p90 and the roles, and writes `shift.json` (every request, the role timeline) and
  `shift.png` (goodput and offered rate over time, role changes marked). The reference in the same run is the
  offered rate: goodput cannot exceed it.

    python benchmarks/serve_load.py smoke configs/gpu-1p1d-llama3-8b.yaml --model /tmp/l1b --requests 64
    python benchmarks/serve_load.py shift configs/gpu-1p1d-llama3-8b.yaml --set mode=adaptive \
        --phase short:8:256:128:30 --phase long:16:2048:256:45 --out /tmp/shift

(Until f1a5769 these were two programs: serve_smoke.py and adaptive_shift.py.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchclient.arrivals import ArrivalSpec  # noqa: E402
from benchclient.client import Target, first_model  # noqa: E402
from benchclient.client_processes import Share, fan_out  # noqa: E402
from benchclient.launcher import launched_server, serving_config  # noqa: E402
from benchclient.run import RunConfig, json_safe, result_record, run_load  # noqa: E402
from benchclient.stats import SLO  # noqa: E402
from benchclient.workload import WorkloadSpec  # noqa: E402
from coordinator.config.serve_config import set_dotted  # noqa: E402
from tests.server_process import metric_values, running_server  # noqa: E402


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
            "tokens": tokens, "chunks": len(stamps), "e2e": stamps[-1] - start}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))] * 1000, 2)


async def drive(url: str, model: str, args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    async with httpx.AsyncClient(timeout=600) as client:
        await stream_one(client, url, model, prompts[0][:16], 4)  # warm-up
    if args.client_processes == 1:
        start, cpu = time.perf_counter(), time.process_time()  # as each fan_out process counts its own
        results, wall = await drive_share(Share(), start, None, url, model, prompts, args.max_tokens)
        return round_figures(results, wall, time.process_time() - cpu, args)
    shares = await asyncio.to_thread(fan_out, drive_share, (url, model, prompts, args.max_tokens),
                                     args.client_processes, 1200)
    results = [r for (part, _), _ in shares for r in part]
    wall = max(elapsed for (_, elapsed), _ in shares)
    busiest_cpu_s = max(cpu_s_per_s * elapsed for (_, elapsed), cpu_s_per_s in shares)
    return round_figures(results, wall, busiest_cpu_s, args)


async def drive_share(share: Share, t0: float, counts, url: str, model: str, prompts: list[list[int]],
                      max_tokens: int) -> tuple[list[dict], float]:
    """Every share.count-th prompt streamed at once from t0 (one client process's part: benchclient.client_processes):
    (stream_one's dicts, seconds from t0 to the last stream's end)."""
    mine = [p for i, p in enumerate(prompts) if share.mine(i)]
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000)) as client:
        await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
        results = await asyncio.gather(*[stream_one(client, url, model, p, max_tokens) for p in mine])
    return list(results), time.perf_counter() - t0


def round_figures(results: list[dict], wall: float, client_cpu_s: float, args: argparse.Namespace) -> dict:
    """A round's figures from its streams' stamps (stream_one's dicts), its wall time and the CPU seconds the busiest
    client process spent in it. Chunk gaps are what a client saw; `tokens_per_chunk` over 1 says the server merged
    tokens into chunks, `client_cpu_s_per_s` near 1 that a client process, not the server, may have set the pace
    (`--client-processes` spreads the streams over more)."""
    itl = [x for r in results for x in r["itl"]]  # gaps between SSE chunks (a chunk may carry several tokens)
    tpot = [(r["e2e"] - r["ttft"]) / max(1, r["tokens"] - 1) for r in results]  # time per output token
    return {"requests": args.requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
            "all_tokens_received": all(r["tokens"] == args.max_tokens for r in results),
            "ttft_ms_p50": pct([r["ttft"] for r in results], 0.5),
            "ttft_ms_p90": pct([r["ttft"] for r in results], 0.9),
            "tpot_ms_p50": pct(tpot, 0.5), "tpot_ms_p90": pct(tpot, 0.9),
            "chunk_gap_ms_p50": pct(itl, 0.5), "chunk_gap_ms_p99": pct(itl, 0.99),
            "e2e_s_mean": round(statistics.mean(r["e2e"] for r in results), 3),
            "output_tokens_per_s": round(sum(r["tokens"] for r in results) / wall, 1),
            "tokens_per_chunk": round(sum(r["tokens"] for r in results) / max(1, sum(r["chunks"] for r in results)),
                                      3),
            "client_cpu_s_per_s": round(client_cpu_s / wall, 3),
            "client_processes": args.client_processes}


GRAPHS_PENDING = "pdserve_worker_engine_graphs_pending"  # EngineLoad.graphs_pending, per worker


def wait_for_graphs(url: str, timeout_s: float, poll_s: float = 0.5, absent_s: float = 3.0,
                    values: Callable[[str, str], dict] = metric_values) -> dict:
    """Poll /metrics until every worker reports no CUDA graph left to capture, or `timeout_s` passes; a server
    whose workers export no such gauge for `absent_s` (no graphs to defer) counts as ready. Returns the figures
    that say what the measured load met: {"graphs_pending_at_start", "graphs_wait_s", "graphs_ready"}."""
    start = time.perf_counter()
    first = None
    while True:
        seen = values(url, GRAPHS_PENDING)
        elapsed = time.perf_counter() - start
        pending = int(sum(seen.values()))
        if seen and first is None:
            first = pending
        ready = pending == 0 and (bool(seen) or elapsed >= absent_s)
        if ready or elapsed >= timeout_s:
            return {"graphs_pending_at_start": first or 0, "graphs_wait_s": round(elapsed, 2), "graphs_ready": ready}
        time.sleep(poll_s)


def read_floor(config: dict, args: argparse.Namespace) -> dict:
    """benchmarks/read_floor.py in a process of its own (its CUDA context gone before the server starts): the bytes
    a decode step of all `--requests` streams reads at their mean context, over the copy rate measured now."""
    kv_dtype = config.get("decode", {}).get("kv_cache_dtype") or config.get("kv_cache_dtype") or "auto"
    kv_tokens = args.requests * (args.prompt_len + args.max_tokens // 2)
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("read_floor.py")), config["model"],
                           "--kv-tokens", str(kv_tokens), "--kv-cache-dtype", kv_dtype],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"--floor: benchmarks/read_floor.py failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def against_floor(figures: dict, floor: dict) -> dict:
    """A round's per-token figures over the floor: TPOT (prefills of the other streams fall in it) and the median
    gap between chunks (the steady decode step as served)."""
    return {"tpot_x_floor": round(figures["tpot_ms_p50"] / floor["floor_ms"], 3),
            "chunk_gap_x_floor": round(figures["chunk_gap_ms_p50"] / floor["floor_ms"], 3)}


def smoke(args: argparse.Namespace) -> None:
    if args.client_processes < 1:
        raise SystemExit(f"--client-processes must be at least 1, got {args.client_processes}")
    config = yaml.safe_load(Path(args.config).read_text())
    config.pop("ray_address", None)
    config |= {k: v for k, v in (("model", args.model), ("mode", args.mode)) if v}
    set_dotted(config, {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)})
    floor = read_floor(config, args) if args.floor else {}
    with tempfile.TemporaryDirectory() as tmp, running_server(Path(tmp), config) as server:
        url = server.url
        graphs = wait_for_graphs(url, args.graphs_timeout_s) if args.graphs_timeout_s > 0 else {}
        for round_ in range(1, args.rounds + 1):  # round 1 meets kernels and buckets the warm-up did not
            figures = {"round": round_} | asyncio.run(drive(url, config["model"], args)) | graphs
            figures["mode"] = config.get("mode", "disaggregated")
            if floor:
                figures |= {f"floor_{k}": v for k, v in floor.items()} | against_floor(figures, floor)
            time.sleep(2.5)  # the backend refreshes transfer counters every second
            for name in ("bytes_total", "failures_total", "read_count", "read_bytes", "read_seconds_sum",
                         "read_seconds_max"):
                values = metric_values(url, f"pdserve_transfer_{name}")
                if values:
                    figures[f"transfer_{name}"] = sum(values.values())
            print(json.dumps(figures), flush=True)


BIN_S = 3.0


def _phase(text: str) -> dict:
    name, rate, inp, out, seconds = text.split(":")
    return {"name": name, "rate": float(rate), "input_len": int(inp), "output_len": int(out),
            "seconds": float(seconds)}


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


async def _watch(url: str, stop: asyncio.Event, t0: float, timeline: list) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        while not stop.is_set():
            try:
                health = (await client.get(f"{url}/health")).json()
                metrics = (await client.get(f"{url}/metrics")).text
            except (httpx.HTTPError, ValueError):
                await asyncio.sleep(0.5)
                continue
            placed = {}
            for line in metrics.splitlines():
                if line.startswith("pdserve_prefill_placement_total{"):
                    placed[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
            timeline.append({"t": time.perf_counter() - t0, "placements": placed,
                             "roles": {w["name"]: w["role"] for w in health.get("workers", [])}})
            await asyncio.sleep(0.5)


async def _run(url: str, model: str, phases: list[dict], warmup_s: float, t0: float) -> list:
    target = Target(url=url, model=model, ignore_eos=True, phases=False)

    async def phase(i: int, p: dict, start_at: float):
        first = i == 0
        await asyncio.sleep(max(0.0, t0 + start_at - time.perf_counter()))
        work = WorkloadSpec(kind="chat", input_len=p["input_len"], output_len=p["output_len"], sigma=0.6,
                            max_input_len=7 * p["input_len"] // 2, max_output_len=4 * p["output_len"],
                            prompt_format="ids", seed=i)
        cfg = RunConfig(target=target, workload=work, arrival=ArrivalSpec(rate=p["rate"], seed=7 + i),
                        duration_s=p["seconds"] - (warmup_s if first else 0), warmup_s=warmup_s if first else 0,
                        timeout_s=120)
        return p["name"], await run_load(cfg)
    starts = [sum(q["seconds"] for q in phases[:i]) for i in range(len(phases))]
    return await asyncio.gather(*[phase(i, p, s) for i, (p, s) in enumerate(zip(phases, starts, strict=True))])


def shift(args: argparse.Namespace) -> None:
    overrides = {k: _value(v) for k, v in (s.split("=", 1) for s in args.set)}
    slo = SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    args.out.mkdir(parents=True, exist_ok=True)
    serve = serving_config(Path(args.config), overrides, None, None)
    with launched_server(serve, args.out / "server", 300) as server:
        model = first_model(server.url)
        timeline: list = []

        async def both():
            t0 = time.perf_counter() + 0.5
            stop = asyncio.Event()
            watcher = asyncio.create_task(_watch(server.url, stop, t0, timeline))
            try:
                return t0, await _run(server.url, model, args.phase, args.warmup_s, t0)
            finally:
                stop.set()
                await watcher
        t0, runs = asyncio.run(both())
    requests = [{**result_record(r, t0), "phase": name, "met": bool(r.ok and slo.met_by(r))}
                for name, results in runs for r in results]
    total_s = sum(p["seconds"] for p in args.phase)
    rows = _bins(requests, timeline, args.phase, total_s, args.warmup_s)
    for row in rows:
        print(json.dumps(row))
    doc = {"phases": args.phase, "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}, "overrides": overrides,
           "bins": rows, "timeline": timeline, "requests": requests}
    (args.out / "shift.json").write_text(json.dumps(json_safe(doc), indent=1) + "\n")
    _plot(rows, timeline, args.out / "shift.png", slo)


def _bins(requests: list, timeline: list, phases: list, total_s: float, warmup_s: float) -> list[dict]:
    rows, t = [], warmup_s
    while t < total_s - 1e-9:
        end = min(t + BIN_S, total_s)
        sent = [r for r in requests if t <= r["start_s"] < end and not r["warmup"]]
        offered = _phase_at(phases, t)["rate"]
        ttfts = sorted(r["ttft_s"] for r in sent if r["ok"] and r["ttft_s"] is not None)
        tpots = sorted(r["tpot_s"] for r in sent if r["ok"] and r["tpot_s"] is not None)
        roles = next((s["roles"] for s in reversed(timeline) if s["t"] <= end), {})
        rows.append({"from_s": round(t, 1), "to_s": round(end, 1), "phase": _phase_at(phases, t)["name"],
                     "offered_rps": offered, "goodput_rps": round(sum(r["met"] for r in sent) / (end - t), 2),
                     "failed": sum(not r["ok"] for r in sent), "ttft_p90_ms": _p90(ttfts),
                     "tpot_p90_ms": _p90(tpots), "roles": ",".join(f"{k}={v}" for k, v in sorted(roles.items()))})
        t = end
    return rows


def _phase_at(phases: list, t: float) -> dict:
    start = 0.0
    for p in phases:
        if t < start + p["seconds"]:
            return p
        start += p["seconds"]
    return phases[-1]


def _p90(values: list) -> float | None:
    return round(values[min(len(values) - 1, int(0.9 * len(values)))] * 1000, 1) if values else None


def _plot(rows: list, timeline: list, path: Path, slo: SLO) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    mids = [(r["from_s"] + r["to_s"]) / 2 for r in rows]
    ax.plot(mids, [r["goodput_rps"] for r in rows], marker="o", label="goodput (req/s meeting both SLOs)")
    ax.step([r["from_s"] for r in rows], [r["offered_rps"] for r in rows], where="post", linestyle="--",
            color="grey", label="offered rate")
    last = None
    for s in timeline:
        roles = ",".join(f"{k}={v}" for k, v in sorted(s["roles"].items()))
        if last is not None and roles != last:
            ax.axvline(s["t"], color="tab:red", linewidth=0.8)
            ax.annotate(roles, (s["t"], ax.get_ylim()[1] * 0.95), rotation=90, fontsize=6, va="top")
        last = roles
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("requests/s")
    ax.set_title(f"Load that changes, mode adaptive (SLO TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms);"
                 "\nred lines: role changes")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = commands.add_parser("smoke", help="concurrent streaming requests at once: TTFT, TPOT, chunk gaps, tok/s")
    p.add_argument("config")
    p.add_argument("--model", help="overrides the config's model")
    p.add_argument("--mode", help="overrides the config's mode")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. decode.workers=2 (YAML value syntax)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--graphs-timeout-s", type=float, default=300,
                   help="wait at most this long for the workers' deferred CUDA graphs before the load (0: not at all)")
    p.add_argument("--rounds", type=int, default=1, help="drive the load this many times on the one server "
                   "(a JSON line each: the first cold, the later ones warm)")
    p.add_argument("--client-processes", type=int, default=1,
                   help="stream the requests from this many processes (each every n-th): one process is busy all the "
                        "time near 12,000 chunks/s on a 2-core machine; client_cpu_s_per_s near 1 says it was")
    p.add_argument("--floor", action="store_true", help="measure the decode floor first (benchmarks/read_floor.py, "
                   "needs CUDA) and give each round's TPOT and chunk gap over it")
    p.set_defaults(run=smoke)
    p = commands.add_parser("shift", help="phases of load one after the other: goodput and roles over time")
    p.add_argument("config")
    p.add_argument("--set", action="append", default=[], help="serving override key=value (YAML value)")
    p.add_argument("--phase", action="append", required=True, type=_phase, help="NAME:RATE:INPUT:OUTPUT:SECONDS")
    p.add_argument("--slo-ttft-ms", type=float, default=500)
    p.add_argument("--slo-tpot-ms", type=float, default=40)
    p.add_argument("--warmup-s", type=float, default=3)
    p.add_argument("--out", type=Path, default=Path("shift"))
    p.set_defaults(run=shift)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
