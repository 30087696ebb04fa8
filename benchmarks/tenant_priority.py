"""Tenant priority and admission under saturation, measured through `pdserve serve` as users run it. Produces
docs/benchmarks.md's "Tenants" table (`bash benchmarks/gpu_run.sh tenants`).

1. Priority: after a warm-up window (flood and high load together, discarded: the first requests compile
   kernels and capture graphs), a high-priority tenant's steady load (Poisson, `--rate`) alone, then the same
   load while a low-priority tenant floods the server (closed loop, each size in `--flood` requests in flight,
   started `--ramp` seconds before the window opens, so the window sees the flood, not its first instant's burst).
   Prints the high tenant's TTFT p50/p99 per window, the ratio to the window without a flood (the reference,
   same run), where its time went (the server's phases, means), the low tenant's throughput, and the coordinator
   process's CPU use (seconds of CPU per second: 1.0 is one core saturated, where queueing in its event loop,
   which priority cannot reorder, sets in); with `--set server.api_processes=N` (N > 1), the core's and the HTTP
   frontends' together (`frontends_cpu`).
   `--low-stream-interval N` streams the flood N tokens a chunk (the tenant's stream_interval).
2. Preemptions (`--skip-preemptions` leaves it out): the decode engines' preemption counter per 1,000 finished
   requests under the largest flood, with `admission.reserve_output` 1.0 (the whole output booked at admission) and
   0.5 (half, the rest grown on demand).
`--profile FILE`: py-spy (on PATH) samples the coordinator process through the largest flood window, into FILE
(collapsed stacks, idle frames left out), to see where its CPU goes. `--keep-log FILE` keeps the server's log (with
`--set server.stall_report_ms=10`: each process's event-loop stalls and the stack that ran in each).

    python benchmarks/tenant_priority.py --config configs/default.yaml --duration 30
    python benchmarks/tenant_priority.py --config configs/gpu-1p1d-llama3-8b.yaml --model /tmp/l1b \
        --prompt-format ids --decode-blocks 0
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import gc
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchclient.arrivals import ArrivalSpec  # noqa: E402
from benchclient.client import Target  # noqa: E402
from benchclient.phase_table import phase_summary  # noqa: E402
from benchclient.run import RunConfig, run_load  # noqa: E402
from benchclient.stats import SLO, summarize  # noqa: E402
from benchclient.workload import WorkloadSpec  # noqa: E402
from benchmarks.proc_cpu import process_cpu_s  # noqa: E402
from coordinator.config.serve_config import set_dotted  # noqa: E402
from engine.gc_pauses import GcPauses  # noqa: E402
from tests.server_process import frontend_pids, metric_values, running_server, scrape, values_in  # noqa: E402

TENANTS = [{"name": "interactive", "api_keys": ["k-high"], "priority": "high"},
           {"name": "bulk", "api_keys": ["k-low"], "priority": "low"}]


def _load(url: str, key: str, arrival: ArrivalSpec, args, output_len: int, duration: float) -> RunConfig:
    return RunConfig(Target(url, args.model, api_key=key, ignore_eos=True, phases=key == "k-high"),
                     WorkloadSpec(kind="fixed", input_len=args.input_len, output_len=output_len,
                                  prompt_format=args.prompt_format, seed=1 if key == "k-high" else 2),
                     arrival, SLO(), duration_s=duration, warmup_s=0.0, timeout_s=600)


def _server_cpu_s(pid: int, frontends: list[int]) -> tuple[float, float]:
    """(the core process's CPU seconds, its HTTP frontends' together); one process serves both without frontends."""
    return process_cpu_s(pid), sum(process_cpu_s(f) for f in frontends)


def _slowest(results: list, n: int) -> list[dict]:
    """The n high requests with the longest TTFT: when each started (seconds into the window: a periodic stall
    shows as regular starts) and the server's phases (ms; `overhead` includes the tail after the last token)."""
    done = [r for r in results if r.ok and r.ttft is not None]
    first = min((r.start for r in done), default=0.0)
    return [{"ttft_ms": round(1e3 * r.ttft, 1), "start_s": round(r.start - first, 2),
             "phases_ms": {k: round(1e3 * v, 1) for k, v in (r.phases or {}).items()}}
            for r in sorted(done, key=lambda r: r.ttft, reverse=True)[:n]]


BEFORE_FIRST_TOKEN = ("ingress", "admission", "prefill_queue", "prefill_compute")  # disaggregated: the first token
# comes from the prefill worker, before the KV handoff


def _outside_phases(results: list) -> float | None:
    """p50 of TTFT minus the server's phases before the first token: the client's and HTTP's share, the Ray calls
    to and from the prefill worker, and the coordinator's work until the first chunk is written."""
    gaps = [r.ttft - sum(r.phases.get(p, 0.0) for p in BEFORE_FIRST_TOKEN)
            for r in results if r.ok and r.ttft is not None and r.phases]
    return round(1e3 * statistics.median(gaps), 2) if gaps else None


STALL_COUNTERS = {"coordinator_loop_stalls": "pdserve_coordinator_loop_stalls_total",
                  "coordinator_gc_full": "pdserve_coordinator_gc_full_collections_total",
                  "coordinator_gc_s": "pdserve_coordinator_gc_pause_seconds_total",
                  "workers_gc_full": "pdserve_worker_engine_gc_full_collections_total",
                  "workers_gc_s": "pdserve_worker_engine_gc_pause_seconds_total"}


def _stall_counts(text: str) -> dict[str, float]:
    """What can stall every request at once, so far: the coordinator loop's stalls (ticks >= 10 ms late) and the
    garbage collectors' full collections and pause seconds (coordinator; all workers summed), from one /metrics
    text (each scrape costs the HTTP process that answers it some milliseconds)."""
    return {k: sum(values_in(text, name).values()) for k, name in STALL_COUNTERS.items()}


def _load_in_process(cfg: RunConfig) -> list:
    return asyncio.run(run_load(cfg))


async def _window(url: str, pid: int, args, flood: int, duration: float, flood_client: ProcessPoolExecutor) -> dict:
    """One window; the flood's client runs in its own process (`flood_client`): sharing the high tenant's event
    loop, its ~100 chunks a millisecond would delay the high tenant's first chunks on the client, not the server."""
    high = _load(url, "k-high", ArrivalSpec(rate=args.rate, seed=1), args, args.output_len, duration)
    runs = []
    if flood:  # the flood first, in full swing before the measured window opens (its first `flood` arrivals come
        # in one instant: a burst, not the steady flood the window measures)
        low = _load(url, "k-low", ArrivalSpec(kind="concurrency", concurrency=flood), args, args.flood_output_len,
                    duration + args.ramp)
        runs.append(asyncio.get_running_loop().run_in_executor(flood_client, _load_in_process, low))
        await asyncio.sleep(args.ramp)
    runs.insert(0, run_load(high))
    frontends = list(frontend_pids(pid).values())
    cpu, started, stalls = _server_cpu_s(pid, frontends), time.monotonic(), _stall_counts(scrape(url))
    client_gc = GcPauses()  # this process's collections delay the high tenant's chunk stamps: counted apart
    client_gc.install()
    try:
        results = await asyncio.gather(*runs)
    finally:
        client_gc.remove()
    elapsed = time.monotonic() - started
    cpu = [round((now - then) / elapsed, 2) for now, then in zip(_server_cpu_s(pid, frontends), cpu, strict=True)]
    text = scrape(url)
    stalls = {k: round(v - stalls.get(k, 0.0), 3) for k, v in _stall_counts(text).items()}
    lag_ms = 1e3 * sum(values_in(text, "pdserve_coordinator_loop_lag_seconds").values())  # the last ~50 ms
    summary = summarize(results[0], SLO())
    phases = phase_summary(results[0])["phases"]  # where the high tenant's time went (server-side, means)
    out = {"flood": flood} | {k: round(summary[k], 1) for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                                                                "itl_p99_ms") if k in summary} | {
        "high_requests": summary["requests"], "high_failed": summary["failed"], "coordinator_cpu": cpu[0],
        "frontends_cpu": cpu[1] if frontends else None,
        "coordinator_loop_lag_ms_at_end": round(lag_ms, 2), "stalls_in_window": stalls,
        "coordinator_gc_max_ms_so_far": round(1e3 * max(
            values_in(text, "pdserve_coordinator_gc_pause_max_s").values(), default=0.0), 1),
        "client_gc": {"full": client_gc.full, "max_ms": round(1e3 * client_gc.max_s, 1)},
        "high_phases_mean_ms": {name: round(row["mean_ms"], 2) for name, row in phases.items()}}
    out["high_slowest"] = _slowest(results[0], 3)
    out["high_ttft_outside_phases_ms_p50"] = _outside_phases(results[0])
    if flood:
        low = summarize(results[1], SLO())
        out |= {"low_requests": low["requests"], "low_output_tok_s": round(low["output_token_throughput"], 1)}
    return out


def _config(args, reserve_output: float) -> dict:
    config = copy.deepcopy(yaml.safe_load(Path(args.config).read_text()))
    config.pop("ray_address", None)
    config["model"] = args.model
    config["tenants"] = [t | {"stream_interval": args.low_stream_interval} if t["priority"] == "low" else t
                         for t in TENANTS]
    config.setdefault("admission", {}).update(reserve_output=reserve_output, reserved_for_high=args.reserved_for_high,
                                              timeout_s=120)
    if args.decode_blocks:
        config.setdefault("decode", {})["num_kv_blocks"] = args.decode_blocks
    set_dotted(config, {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)})
    return config


def _profiler(pid: int, out: str | None, seconds: float) -> subprocess.Popen | None:
    if out is None:
        return None
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", "200", "--duration",
                             str(max(1, int(seconds))), "--format", "raw", "--nonblocking", "--output", out])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--model", default="tiny", help="overrides the config's model")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. prefill.prefill_graph_tokens=0 (YAML value syntax)")
    p.add_argument("--prompt-format", default="text", choices=["text", "ids"])
    p.add_argument("--rate", type=float, default=2.0, help="high-priority requests/s")
    p.add_argument("--flood", default="48", help="low-priority requests in flight (comma-separated sizes)")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of discarded load before measuring")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--flood-output-len", type=int, default=128)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--ramp", type=float, default=2.0, help="seconds the flood runs before a flood window opens")
    p.add_argument("--decode-blocks", type=int, default=384, help="decode KV blocks (0: the engine's own sizing)")
    p.add_argument("--reserved-for-high", type=float, default=0.25)
    p.add_argument("--low-stream-interval", type=int, default=1,
                   help="the low-priority tenant's stream_interval (tokens per streamed chunk)")
    p.add_argument("--skip-preemptions", action="store_true", help="leave out part 2 (the second server)")
    p.add_argument("--profile", metavar="FILE", help="py-spy samples the coordinator during the largest flood")
    p.add_argument("--keep-log", metavar="FILE", help="copy the (first) server's log here: with --set "
                   "server.stall_report_ms=10 it holds every process's loop stalls and what ran in them")
    args = p.parse_args()
    floods = [int(x) for x in args.flood.split(",")]
    gc.collect()  # the load client's start-up objects stay out of its collections during the windows
    gc.freeze()
    flood_client = ProcessPoolExecutor(1, mp_context=get_context("spawn"))
    flood_client.submit(int).result()  # started (and its imports done) before any window's clock runs
    with flood_client, tempfile.TemporaryDirectory() as tmp:
        with running_server(Path(tmp) / "a", _config(args, 1.0)) as server:
            asyncio.run(_window(server.url, server.pid, args, max(floods), args.warmup, flood_client))
            alone = asyncio.run(_window(server.url, server.pid, args, 0, args.duration, flood_client))
            print(json.dumps({"high_alone": alone}), flush=True)
            for flood in floods:
                before = sum(metric_values(server.url, "pdserve_worker_engine_preemptions_total").values())
                spy = _profiler(server.pid, args.profile, args.duration) if flood == max(floods) else None
                flooded = asyncio.run(_window(server.url, server.pid, args, flood, args.duration, flood_client))
                if spy is not None:
                    try:
                        status = spy.wait(60)
                    except subprocess.TimeoutExpired:
                        spy.kill()
                        status = "killed: still running 60 s after the window"
                    print(json.dumps({"profile": args.profile, "py_spy_exit": status}), flush=True)
                preempted = sum(metric_values(server.url, "pdserve_worker_engine_preemptions_total").values()) - before
                print(json.dumps({"high_with_low_flood": flooded,
                                  "ttft_p50_ratio": round(flooded["ttft_p50_ms"] / alone["ttft_p50_ms"], 3),
                                  "ttft_p99_ratio": round(flooded["ttft_p99_ms"] / alone["ttft_p99_ms"], 3)}),
                      flush=True)
        if args.keep_log:
            shutil.copyfile(Path(tmp) / "a" / "server.log", args.keep_log)
        rows = [(1.0, preempted, flooded["high_requests"] + flooded["low_requests"])]
        if args.skip_preemptions:
            return
        with running_server(Path(tmp) / "b", _config(args, 0.5)) as server:
            asyncio.run(_window(server.url, server.pid, args, max(floods), args.duration,
                                flood_client))
            done = sum(metric_values(server.url, "pdserve_requests_total").values())
            rows.append((0.5, sum(metric_values(server.url, "pdserve_worker_engine_preemptions_total").values()),
                         done))
        for reserve, n, requests in rows:
            print(json.dumps({"reserve_output": reserve, "requests": requests, "preemptions": n,
                              "preemptions_per_1000_requests": round(1000 * n / max(1, requests), 1)}), flush=True)


if __name__ == "__main__":
    main()
