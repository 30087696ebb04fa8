"""The first minute of a server: goodput in the first window after /health turns 200 against the second window.

For each layout (a YAML plus overrides), `pdserve serve` starts, and the moment /health is 200 an open-loop load
at a near-constant rate (gamma arrivals of shape 50, so both windows get about the same number of requests;
chat-like lengths, ids prompts, ignore_eos) runs for two windows of `--window` seconds. Requests are split by send
time; each window's goodput (requests meeting the SLO, per second) is printed next to the second
window's, the reference, with their ratio (goal: at least 0.95). Also printed: the time from launch to /health 200
and each worker's start-up phases (from the server log), so warm-up's cost shows next to its gain. Each layout
gets an empty Triton cache, as on a freshly started machine.

    python benchmarks/cold_start_serving.py configs/gpu-1p1d-llama3-8b.yaml --model /tmp/l8b --rate 4 \\
        --layout warm: --layout cold:prefill.warmup=false,decode.warmup=false
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import tempfile
import time
from pathlib import Path

import yaml

from benchclient.arrivals import ArrivalSpec
from benchclient.client import Target
from benchclient.launcher import launched_server, serving_config
from benchclient.run import RunConfig, run_load
from benchclient.stats import SLO
from benchclient.workload import WorkloadSpec


def _overrides(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        out[key] = yaml.safe_load(value)
    return out


def _goodput(results: list, lo: float, hi: float, slo: SLO) -> tuple[float, int, int]:
    window = [r for r in results if lo <= r.start < hi]
    good = sum(slo.met_by(r) for r in window)
    return good / (hi - lo), good, len(window)


def run_layout(args: argparse.Namespace, name: str, overrides: dict, workdir: Path) -> dict:
    config = serving_config(args.config, {"model": args.model, **overrides}, None, None)
    slo = SLO(args.ttft_ms, args.tpot_ms)
    os.environ["TRITON_CACHE_DIR"] = str(workdir / name / "triton-cache")  # every layout starts as on a new machine
    launched = time.perf_counter()
    with launched_server(config, workdir / name, start_timeout_s=900) as server:
        ready_s = time.perf_counter() - launched
        cfg = RunConfig(Target(server.url, args.model, ignore_eos=True),
                        WorkloadSpec(kind="chat", input_len=args.input_len, output_len=args.output_len,
                                     max_input_len=args.max_input_len, max_output_len=args.max_output_len,
                                     prompt_format="ids"),
                        ArrivalSpec(kind="gamma", rate=args.rate, burstiness=50), slo,
                        duration_s=2 * args.window, warmup_s=0)
        t0 = time.perf_counter()
        results = asyncio.run(run_load(cfg))
    first, good1, n1 = _goodput(results, t0, t0 + args.window, slo)
    second, good2, n2 = _goodput(results, t0 + args.window, t0 + 2 * args.window, slo)
    log = (workdir / name / "server.log").read_text(errors="replace")
    phases = re.findall(r"worker (\S+) ready: (.*)", log)
    return {"layout": name, "ready_s": round(ready_s, 1), "goodput_first": round(first, 2),
            "goodput_second": round(second, 2), "ratio": round(first / second, 3) if second else None,
            "good_first": f"{good1}/{n1}", "good_second": f"{good2}/{n2}",
            "failed": sum(not r.ok for r in results),
            "errors": sorted({(r.error or "")[:120] for r in results if not r.ok}),
            "startup": {w: p for w, p in phases}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", type=Path)
    ap.add_argument("--model", required=True)
    ap.add_argument("--layout", action="append", default=[],
                    help="NAME:key=value,... (dotted YAML overrides); repeatable; default: one layout as is")
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--window", type=float, default=18.0)
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--max-input-len", type=int, default=7168)  # + the longest output: within an 8k context
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--ttft-ms", type=float, default=1000.0)
    ap.add_argument("--tpot-ms", type=float, default=100.0)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="cold-start-"))
    rows = []
    for spec in args.layout or ["as-is:"]:
        name, _, text = spec.partition(":")
        row = run_layout(args, name, _overrides(text), workdir)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("| layout | ready after | goodput first window | second window (reference) | ratio | failed |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['ready_s']} s | {r['goodput_first']} req/s ({r['good_first']}) | "
              f"{r['goodput_second']} req/s ({r['good_second']}) | {r['ratio']} | {r['failed']} |")


if __name__ == "__main__":
    main()
