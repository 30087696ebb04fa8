"""`pdserve bench` and `pdserve sweep`: argument parsing, printing and saving; the work is in run.py / sweep.py.

`pdserve bench --url http://127.0.0.1:8000 --rate 4 --duration 60 --input-len 512 --output-len 128 --out r.json`
drives any OpenAI-compatible server (pdserve or vLLM) and prints TTFT, TPOT, ITL and e2e percentiles,
throughputs, errors and goodput under `--slo-ttft-ms` / `--slo-tpot-ms`, and, from pdserve (asked for its phases
unless `--phases off`), a short "where did the time go" table of the requests' server-side phases.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import httpx

from benchclient.arrivals import ArrivalSpec
from benchclient.cache_tiers import read_tier_counters, tier_shares
from benchclient.client import Target, first_model, serves_pdserve
from benchclient.phase_table import format_phase_table
from benchclient.run import RunConfig, measured_load, run_report, save_json
from benchclient.stats import SLO, format_summary
from benchclient.workload import build_requests
from benchclient.workload_spec import KINDS, WorkloadSpec


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="load-test an OpenAI-compatible endpoint (pdserve, vLLM, ...)")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model id to send; default: the first one /v1/models lists")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--api-key")
    p.add_argument("--ignore-eos", action="store_true", help="exact output lengths (pdserve and vLLM accept it)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--phases", choices=["auto", "on", "off"], default="auto",
                   help="ask for each request's server-side phases (pdserve's stream_options.include_phases); "
                        "auto: when /v1/models says the server is pdserve")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=list(KINDS), default="fixed",
                   help="length distribution, a file (--dataset), or multi-turn conversations")
    w.add_argument("--dataset", help="JSONL (prompt|messages, max_tokens) or ShareGPT JSON file; multiturn: JSONL of "
                                     "conversations (messages)")
    w.add_argument("--conversations", type=int, default=100, help="multiturn: conversations in the run")
    w.add_argument("--turns", type=int, default=4, help="multiturn: turns per conversation")
    w.add_argument("--think-time", type=float, default=0.0, help="multiturn: mean seconds between a reply and the "
                                                                 "next turn (exponential)")
    w.add_argument("--system-prompt-len", type=int, default=0, help="multiturn: words of a shared system prompt")
    w.add_argument("--input-len", type=int, default=128, help="fixed length, uniform maximum, or chat median")
    w.add_argument("--output-len", type=int, default=64, help="fixed length, uniform maximum, or chat median")
    w.add_argument("--min-len", type=int, default=1)
    w.add_argument("--sigma", type=float, default=1.0, help="chat: log-normal spread")
    w.add_argument("--max-input-len", type=int, default=4096)
    w.add_argument("--max-output-len", type=int, default=1024)
    w.add_argument("--prompt-format", choices=["text", "ids"], default="text", help="ids: token-id list prompts")
    w.add_argument("--seed", type=int, default=0)
    a = p.add_argument_group("arrivals")
    a.add_argument("--rate", type=float, help="open loop: requests/s (Poisson unless --burstiness is not 1)")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    a.add_argument("--concurrency", type=int, help="closed loop: keep this many requests in flight")
    a.add_argument("--duration", type=float, default=60.0, help="measured seconds of sending")
    a.add_argument("--warmup", type=float, default=5.0, help="seconds of sending first, left out of the figures")
    a.add_argument("--num-requests", type=int, help="send exactly this many measured requests instead")
    a.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    a.add_argument("--client-processes", type=int, default=1,
                   help="send the load from this many processes (each every n-th request); one asyncio process "
                        "is busy all the time near 12,000 chunks/s on a 2-core machine; the run warns when one was")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--out", help="save the figures and every request as JSON here")
    p.add_argument("--no-progress", action="store_true")


def bench_main(args: argparse.Namespace) -> int:
    try:
        cfg = _run_config(args)
        build_requests(cfg.workload, 1)  # a dataset file is read and checked before any request goes out
    except (ValueError, OSError, httpx.HTTPError) as e:
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 2
    counters = read_tier_counters(cfg.target.url, cfg.target.api_key)  # None: not pdserve, or /metrics refused
    run = asyncio.run(measured_load(cfg, progress=sys.stderr.isatty() and not args.no_progress))
    doc = run_report(cfg, run.results, run.client)
    doc["summary"].update(tier_shares(counters, read_tier_counters(cfg.target.url, cfg.target.api_key)))
    print(format_summary(doc["summary"]))
    print(f"client: {len(run.client.cpu_s_per_s)} process(es), busiest {run.client.busiest:.0%} of a CPU")
    if run.client.warning():
        print(run.client.warning(), file=sys.stderr)
    table = format_phase_table(doc["phases"])
    if table:
        print(table)
    if args.out:
        save_json(doc, args.out)
        print(f"saved {args.out}")
    return 0


def _run_config(args: argparse.Namespace) -> RunConfig:
    if (args.rate is None) == (args.concurrency is None):
        raise ValueError("give one of --rate (open loop) or --concurrency (closed loop)")
    if args.concurrency is not None:
        arrival = ArrivalSpec(kind="concurrency", concurrency=args.concurrency, seed=args.seed)
    else:
        kind = "poisson" if args.burstiness == 1 else "gamma"
        arrival = ArrivalSpec(kind=kind, rate=args.rate, burstiness=args.burstiness, seed=args.seed)
    workload = WorkloadSpec(
        name=args.workload, kind=args.workload, input_len=args.input_len, output_len=args.output_len,
        min_len=args.min_len, sigma=args.sigma, max_input_len=args.max_input_len,
        max_output_len=args.max_output_len, path=args.dataset, prompt_format=args.prompt_format, seed=args.seed,
        conversations=args.conversations, turns=args.turns, think_time_s=args.think_time,
        system_prompt_len=args.system_prompt_len)
    model = args.model or first_model(args.url, args.api_key)
    phases = args.phases == "on" or (args.phases == "auto" and serves_pdserve(args.url, args.api_key))
    target = Target(url=args.url, model=model, endpoint=args.endpoint, api_key=args.api_key,
                    ignore_eos=args.ignore_eos, temperature=args.temperature, phases=phases)
    return RunConfig(target=target, workload=workload, arrival=arrival,
                     slo=SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms), duration_s=args.duration,
                     warmup_s=args.warmup, num_requests=args.num_requests, timeout_s=args.timeout,
                     client_processes=args.client_processes)


def add_sweep_parser(sub) -> None:
    p = sub.add_parser("sweep", help="pool-sizing sweep: layouts x workloads x loads, each on a fresh server")
    p.add_argument("config", help="sweep YAML, e.g. configs/sweeps/cpu-smoke.yaml")
    p.add_argument("--out", help="output folder; default: the config's output_dir")


def sweep_main(args: argparse.Namespace) -> int:
    from benchclient.sweep import run_sweep  # lazy: plots need matplotlib
    from benchclient.sweep_config import load_sweep_config
    from engine.config_error import ConfigError
    try:
        config = load_sweep_config(args.config)
    except ConfigError as e:
        print(f"pdserve sweep: error: {e}", file=sys.stderr)
        return 2
    outcome = run_sweep(config, out_dir=args.out)
    print(f"{outcome.ran} cells run, {outcome.skipped} already done, {outcome.failed} failed; "
          f"report: {outcome.report}")
    return 1 if outcome.failed else 0
