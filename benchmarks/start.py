"""A server's and an engine's start: how long until ready, and what the first requests after it cost. Produces
docs/benchmarks.md's "Start-up" rows and its "Worker start, CPU (issue 45 part 1)" table.

`python benchmarks/start.py COMMAND [options]`, one command per measurement:

- `server`: start-up against another checkout's, interleaved: /health 200 first and second time, the first
  structured request, a worker replacement (the CPU tables).
  Each round runs, for the other checkout and then this one (same config: `--config`, the CPU default with half a
  CPU per worker unless given), two servers one after the other on a fresh cache folder (PDSERVE_CACHE): the first
  start finds it empty (the `tiny` checkpoint is built, the CPU kernels compiled), the second finds what the first
  left. Each server is timed from launching `pdserve serve` to /health 200 (polled every 0.5 s by the launcher, for
  both checkouts alike); then `--streams` greedy streams run (a chunk per token) and one `json_schema` chat request
  is sent: its latency, and the longest gap between two chunks of the other streams while it ran (the pause its
  grammar's set-up inflicts on them; `gap_before_s`, the longest gap before it was sent, is the same streams'
  ordinary jitter); then, `--settle-s` later, `--kill` is SIGKILLed (POST /admin/workers/NAME/kill) and timed until
  /health shows the slot replaced, live, 200, with its start-up phases as /health reports them (where the checkout
  reports them).
  Prints every server's figures and, per measure, the means and their ratio (this / other). The other checkout
  runs with its own directory first on PYTHONPATH (its coordinator and workers import its code). Without
  `--against` this checkout runs alone (its figures, no ratio: `bash benchmarks/gpu_run.sh structured1`, the 8B
  shape on a GPU through `--set` overrides); `--kill none` skips the replacement.
- `engine`: cold vs warm engine, the same workload run twice on one fresh LLMEngine, with Triton compilations
  counted. Prints one JSON line per pass and a summary: the wall time of each pass, the Triton kernel
  specialisations compiled during it (by kernel), and the ratio of the first pass's time to the second's. The
  second pass is the reference: same request shapes and sampling options, different token ids (so the prefix cache
  does not help it). A warm engine compiles nothing in either pass.
- `serving` (`bash benchmarks/gpu_run.sh coldstart`): the first minute of a server, goodput in the first window
  after /health turns 200 against the second window. For each layout (a YAML plus overrides), `pdserve serve`
  starts, and the moment /health is 200 an open-loop load at a near-constant rate (gamma arrivals of shape 50, so
  both windows get about the same number of requests; chat-like lengths, ids prompts, ignore_eos) runs for two
  windows of `--window` seconds. Requests are split by send time; each window's goodput (requests meeting the SLO,
  per second) is printed next to the second window's, the reference, with their ratio (goal: at least 0.95). Also
  printed: the time from launch to /health 200 and each worker's start-up phases (from the server log), so
  warm-up's cost shows next to its gain, and the time from launch to the first streamed token (issue 45: an
  8B server serving its first request). Each layout gets an empty Triton cache, as on a freshly started machine
  (`--shared-triton-cache`: one for all, so a repeated layout is a second start on the same machine).

    python benchmarks/start.py server --against /tmp/base --rounds 2     # base: git worktree add /tmp/base <commit>
    python benchmarks/start.py engine --model /tmp/l1b --device cuda
    python benchmarks/start.py serving configs/gpu-1p1d-llama3-8b.yaml --model /tmp/l8b --rate 4 \\
        --layout warm: --layout cold:prefill.warmup=false,decode.warmup=false

(Until f1a5769 these were three programs: server_start.py, warm_start.py, cold_start_serving.py.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
import yaml
from triton import knobs

from benchclient.arrivals import ArrivalSpec
from benchclient.client import Target
from benchclient.launcher import launched_server, serving_config
from benchclient.run import RunConfig, run_load
from benchclient.stats import SLO
from benchclient.workload import WorkloadSpec
from engine.core.sampling_params import SamplingParams
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine

HERE = Path(__file__).resolve().parent.parent
ONE_SERVER = r"""
import asyncio, json, sys, tempfile, time
import httpx, yaml
from pathlib import Path
from tests.server_process import OPERATOR, running_server

config = yaml.safe_load(Path(sys.argv[1]).read_text())
half, streams, kill, settle_s = sys.argv[2] == "half", int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
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
        replace_s, recovery, phases = None, {}, None
        if kill != "none":
            time.sleep(settle_s)
            replace_s, recovery, phases = asyncio.run(replacement(server.url))
    print(json.dumps({"start_s": start_s, "structured_s": structured_s, "stall_s": stall_s,
                      "gap_before_s": gap_before_s, "replace_s": replace_s,
                      "replacement_phases_s": {k: round(v, 2) for k, v in (phases or recovery).items()}}))
"""
MEASURES = ("start_s", "structured_s", "stall_s", "gap_before_s", "replace_s")


def one_server(checkout: Path, config: Path, half: bool, cache: Path, streams: int, kill: str, settle_s: float
               ) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")]),
           "PDSERVE_CACHE": str(cache)}
    out = subprocess.run([sys.executable, "-c", ONE_SERVER, str(config), "half" if half else "as-is", str(streams),
                          kill, str(settle_s)], cwd=checkout, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"a server in {checkout} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def server_mode(args: argparse.Namespace) -> None:
    sides = [("this", HERE)] if args.against is None else [("other", args.against.resolve()), ("this", HERE)]
    runs: dict[str, dict[str, list[dict]]] = {side: {"first": [], "second": []} for side, _ in sides}
    with tempfile.TemporaryDirectory(prefix="pdserve-config-") as folder:
        config = args.config.resolve()
        if args.set:  # the YAML with the overrides, run locally (no ray_address)
            config = Path(folder) / "config.yaml"
            config.write_text(yaml.safe_dump(serving_config(args.config, _overrides(",".join(args.set)), None, None)))
        for _ in range(args.rounds):
            _server_round(args, sides, config, runs)
    for start in ("first", "second"):
        summary = {"start": start}
        for measure in MEASURES:
            mine = [r[measure] for r in runs["this"][start] if r[measure] is not None]
            if not mine:
                continue
            summary[measure] = {"this": round(statistics.mean(mine), 3)}
            if "other" in runs:
                other = statistics.mean(r[measure] for r in runs["other"][start])
                summary[measure] |= {"other": round(other, 3), "ratio": round(statistics.mean(mine) / other, 3)}
        print(json.dumps(summary))


def _server_round(args: argparse.Namespace, sides: list[tuple[str, Path]], config: Path,
                  runs: dict[str, dict[str, list[dict]]]) -> None:
    for side, checkout in sides:
        with tempfile.TemporaryDirectory(prefix="pdserve-cache-") as cache:
            for start in ("first", "second"):
                row = one_server(checkout, config, not args.as_is, Path(cache), args.streams, args.kill,
                                 args.settle_s)
                runs[side][start].append(row)
                print(json.dumps({"checkout": side, "start": start,
                                  **{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}}),
                      flush=True)


VARIANTS = [  # the sampling options users send, cycled over the requests
    dict(temperature=0.0),
    dict(temperature=0.8, top_p=0.9),
    dict(temperature=0.7, top_k=50, seed=7),
    dict(temperature=0.0, logprobs=5),
    dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.2),
    dict(temperature=0.0, logit_bias={11: 5.0}),
    dict(temperature=0.9, min_p=0.05),
]


class CompileCounter:
    """Counts Triton compilations (in-memory cache misses) by kernel while installed."""

    def __init__(self) -> None:
        self.misses: Counter[str] = Counter()

    def __call__(self, *args, **kwargs) -> bool:
        self.misses[kwargs["fn"].name if "fn" in kwargs else "?"] += 1
        return False  # go on compiling

    def __enter__(self) -> CompileCounter:
        self._old = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self
        return self

    def __exit__(self, *exc: object) -> None:
        knobs.runtime.jit_cache_hook = self._old


def workload(seed: int, n: int, vocab: int, max_prompt: int) -> list[tuple[list[int], SamplingParams]]:
    """n requests: prompt lengths log-uniform in [4, max_prompt] (fixed by n, not seed), outputs 16-128."""
    shapes = random.Random(0)
    ids = random.Random(seed)
    out = []
    for i in range(n):
        plen = int(4 * (max_prompt / 4) ** shapes.random())
        params = SamplingParams(max_tokens=shapes.randint(16, 128), ignore_eos=True, **VARIANTS[i % len(VARIANTS)])
        out.append(([ids.randrange(3, vocab) for _ in range(plen)], params))
    return out


def run_pass(engine: LLMEngine, reqs: list, tag: str, wave: int) -> tuple[float, int]:
    """Adds `wave` requests every 4 steps (so prefills mix with running decodes) and steps until all finish."""
    start, steps, i = time.perf_counter(), 0, 0
    while i < len(reqs) or engine.has_unfinished():
        if steps % 4 == 0:
            for prompt, params in reqs[i:i + wave]:
                engine.add_request(f"{tag}-{i}", prompt, params)
                i += 1
        engine.step()
        steps += 1
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return time.perf_counter() - start, steps


def engine_mode(args: argparse.Namespace) -> None:
    with CompileCounter() as startup:
        t0 = time.perf_counter()
        engine = LLMEngine(EngineConfig(model=args.model, device=args.device, max_num_seqs=args.max_num_seqs))
        start_s = time.perf_counter() - t0
    print(json.dumps({"phase": "start", "seconds": round(start_s, 2), "compiled": sum(startup.misses.values()),
                      "by_kernel": dict(startup.misses)}), flush=True)
    vocab = engine.model_config.vocab_size
    times = []
    for n, seed in enumerate((1, 2)):
        with CompileCounter() as counter:
            seconds, steps = run_pass(engine, workload(seed, args.requests, vocab, args.max_prompt), f"p{n}",
                                      args.wave)
        times.append(seconds)
        print(json.dumps({"phase": f"pass{n + 1}", "seconds": round(seconds, 3), "steps": steps,
                          "compiled": sum(counter.misses.values()), "by_kernel": dict(counter.misses)}), flush=True)
    print(json.dumps({"summary": "first pass time / second pass time (1.0 = no cold-start cost)",
                      "ratio": round(times[0] / times[1], 3), "model": args.model, "device": args.device}))


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
    # every layout starts as on a new machine, or (--shared-triton-cache) finds what the layouts before it compiled
    os.environ["TRITON_CACHE_DIR"] = str(workdir / ("" if args.shared_triton_cache else name) / "triton-cache")
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
    first_token = min((r.chunk_times[0] for r in results if r.chunk_times), default=None)
    log = (workdir / name / "server.log").read_text(errors="replace")
    phases = re.findall(r"worker (\S+) ready: (.*?)(?: \([^)]*\))?$", log, re.MULTILINE)
    return {"layout": name, "ready_s": round(ready_s, 1),
            "first_token_s": round(first_token - launched, 1) if first_token is not None else None,
            "goodput_first": round(first, 2),
            "goodput_second": round(second, 2), "ratio": round(first / second, 3) if second else None,
            "good_first": f"{good1}/{n1}", "good_second": f"{good2}/{n2}",
            "failed": sum(not r.ok for r in results),
            "errors": sorted({(r.error or "")[:120] for r in results if not r.ok}),
            "startup": {w: p for w, p in phases}}


def serving_mode(args: argparse.Namespace) -> None:
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="cold-start-"))
    rows = []
    for spec in args.layout or ["as-is:"]:
        name, _, text = spec.partition(":")
        row = run_layout(args, name, _overrides(text), workdir)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("| layout | ready after | first token after | goodput first window | second window (reference) | ratio "
          "| failed |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['ready_s']} s | {r['first_token_s']} s | {r['goodput_first']} req/s "
              f"({r['good_first']}) | "
              f"{r['goodput_second']} req/s ({r['good_second']}) | {r['ratio']} | {r['failed']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = commands.add_parser("server", help="start, first structured request, replacement: this checkout vs another")
    p.add_argument("--against", type=Path, help="another checkout (e.g. a git worktree); without: this one alone")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted config overrides (e.g. model=/tmp/l8bd); the server then runs without ray_address")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--config", type=Path, default=HERE / "configs/default.yaml")
    p.add_argument("--as-is", action="store_true", help="keep the config's num_cpus (default: half a CPU each)")
    p.add_argument("--streams", type=int, default=4, help="streams running while the structured request is served")
    p.add_argument("--kill", default="decode-0", help="the worker to kill and time until replaced (none: no kill)")
    p.add_argument("--settle-s", type=float, default=10.0, help="wait after the structured request before the "
                   "kill (a server up for a while: what it starts after /health 200, e.g. processes started ahead, "
                   "is ready)")
    p.set_defaults(run=server_mode)
    p = commands.add_parser("engine", help="cold vs warm engine: one workload twice, Triton compilations counted")
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--wave", type=int, default=6)
    p.add_argument("--max-prompt", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.set_defaults(run=engine_mode)
    p = commands.add_parser("serving", help="goodput in the first window after /health 200 against the second")
    p.add_argument("config", type=Path)
    p.add_argument("--model", required=True)
    p.add_argument("--layout", action="append", default=[],
                   help="NAME:key=value,... (dotted YAML overrides); repeatable; default: one layout as is")
    p.add_argument("--rate", type=float, default=4.0)
    p.add_argument("--shared-triton-cache", action="store_true",
                   help="one Triton cache for all layouts (a layout finds what the ones before it compiled: a second "
                        "start on the same machine); default: an empty one each, as on a new machine")
    p.add_argument("--window", type=float, default=18.0)
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--max-input-len", type=int, default=7168)  # + the longest output: within an 8k context
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--ttft-ms", type=float, default=1000.0)
    p.add_argument("--tpot-ms", type=float, default=100.0)
    p.add_argument("--workdir", type=Path, default=None)
    p.set_defaults(run=serving_mode)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
