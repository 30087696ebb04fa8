"""Serving overhead: `pdserve serve` collocated (one worker) against the offline engine on the same prompts, and
against `vllm serve` on the same checkpoint folder when a `vllm` command is found (`--vllm`, default the one on PATH;
this program installs nothing: vLLM may live in a virtual environment of its own). Produces docs/benchmarks.md's
"Serving overhead" rows (GPU: `bash benchmarks/gpu_run.sh overhead`; the CPU served/offline row) and the piecewise
graphs row of its tensor-parallelism table.

The load (issue 13): random token-id prompts of `--input-len` (256) tokens, `--output-len` (64) new tokens each with
ignore_eos and greedy sampling, `--num-prompts` (100) of them, sent by benchclient's closed loop at `--concurrency`
(16) in flight. The offline reference is `engine.LLM.generate` on the same prompts and sampling parameters, with the
served worker's engine settings (built from the same YAML) and `max_num_seqs` = the concurrency, so it runs the
batches the closed loop keeps in flight: the served/offline ratio is what the HTTP, Ray and coordinator layers cost.
Its TPOT comes from the engine's step timestamps (every step is timed; generation itself is LLM.generate's).
Each server gets a discarded warm-up of `--concurrency` requests (another seed, so no prefix-cache hit) first.
The load client is Python too, and near a core at GPU token rates it becomes the limit: `client_cpu` (seconds of
CPU per second, every client process) shows it, and `--client-processes N` sends the closed loop from N processes
(benchclient.client_processes: every n-th request of the one seeded load; 1623a33's GPU rows drew each process's
prompts from a seed of its own, the same shape).

Printed, one row per measured run (`--repeats` runs of each, back to back, to show the spread on a shared machine):
output tok/s, TPOT p50, TTFT p50 (served only), tokens sampled per engine step() call and host milliseconds per
step() (offline: the engine's counters; pdserve: its /metrics), and CPU time per output token of the process running
the engine (offline: this one; pdserve: its engine worker) and of pdserve's coordinator (/proc, Linux; on a shared
machine these move less than the rates), then the served/offline ratio and, with vLLM, pdserve/vLLM (and the CPU of
its API server
process). `--profile DIR` adds py-spy samples of each process through its first measured run.

    python benchmarks/serving_overhead.py                                  # tiny, on the CPU
    python benchmarks/serving_overhead.py --config configs/gpu-1p1d-llama3-8b.yaml --model /tmp/l1b --device cuda
    python benchmarks/serving_overhead.py --config configs/gpu-1p1d-llama3-8b.yaml --model /tmp/l8bd --device cuda \
        --set load_format=dummy      # a --no-weights checkpoint: random weights made on the GPU
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchclient.arrivals import ArrivalSpec  # noqa: E402
from benchclient.client import Target, first_model  # noqa: E402
from benchclient.launcher import _stop, _wait_healthy, free_port  # noqa: E402
from benchclient.run import RunConfig, measured_load  # noqa: E402
from benchclient.stats import SLO, summarize  # noqa: E402
from benchclient.workload import WorkloadSpec, build_requests  # noqa: E402
from benchmarks.proc_cpu import process_cpu_s  # noqa: E402
from coordinator.config.serve_config import load_serve_config, set_dotted  # noqa: E402
from tests.server_process import frontend_pids, metric_values, running_server, worker_pids  # noqa: E402


def _serving_config(args: argparse.Namespace) -> dict:
    """The YAML given, made collocated with one worker on `--device`, on a local Ray."""
    config = yaml.safe_load(Path(args.config).read_text()) or {}
    config.pop("ray_address", None)
    config.update(model=args.model, mode="collocated", **({"dtype": args.dtype} if args.dtype else {}))
    set_dotted(config, {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)})
    decode = config.setdefault("decode", {})
    decode["workers"] = 1
    if args.device == "cpu":
        decode["num_gpus"] = 0
    elif not decode.get("num_gpus"):
        decode["num_gpus"] = 1
    return config


def _seed(repeat: int) -> int:
    """The prompts' seed of a measured run: new prompts each repeat (the same ones again would hit the prefix
    cache), never the warm-up's (1)."""
    return 0 if repeat == 0 else repeat + 1


def _workload(args: argparse.Namespace, seed: int) -> WorkloadSpec:
    return WorkloadSpec(kind="fixed", input_len=args.input_len, output_len=args.output_len, prompt_format="ids",
                        seed=seed)


class Profiler:
    """`--profile DIR`: py-spy (on PATH) samples a process through the first measured run, into DIR/<name>.txt
    (raw collapsed stacks, idle frames and thread ids kept, so the engine's step thread can be told from the rest)."""

    def __init__(self, directory: str | None) -> None:
        self.directory = Path(directory) if directory else None
        self._taken: set[str] = set()

    def start(self, name: str, pid: int) -> subprocess.Popen | None:
        if self.directory is None or name in self._taken:
            return None
        self._taken.add(name)
        self.directory.mkdir(parents=True, exist_ok=True)
        return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", "250", "--idle", "--threads",
                                 "--format", "raw", "--nonblocking", "--output", str(self.directory / f"{name}.txt")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    @staticmethod
    def stop(spy: subprocess.Popen | None) -> None:
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            spy.wait(60)


def offline_runs(args: argparse.Namespace, config: dict, tmp: Path, profiler: Profiler) -> list[dict]:
    """LLM.generate over the measured prompts, `--repeats` times, with the served worker's engine settings."""
    import torch

    from engine import LLM, SamplingParams

    path = tmp / "offline.yaml"
    path.write_text(yaml.safe_dump(config))
    serve = load_serve_config(path)
    engine_config = dataclasses.replace(serve.engine_config(serve.decode), max_num_seqs=args.concurrency)
    if args.device == "cpu":
        torch.set_num_threads(max(1, int(serve.decode.num_cpus)))  # the worker's threads (coordinator.backend.pools)
    llm = LLM(**dataclasses.asdict(engine_config))
    step, stamps = llm.engine.step, []

    def timed_step() -> list:  # LLM.generate's own loop calls this: record when each step's tokens exist
        outputs = step()
        stamps.append((time.perf_counter(), outputs))
        return outputs
    llm.engine.step = timed_step
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([r.prompt for r in build_requests(_workload(args, 1), args.concurrency)], params)  # warm-up
    rows = []
    for repeat in range(args.repeats):
        prompts = [r.prompt for r in build_requests(_workload(args, _seed(repeat)), args.num_prompts)]
        stamps.clear()
        spy = profiler.start("offline", os.getpid())
        steps, sampled = llm.engine.num_steps, llm.engine.scheduler.num_sampled_tokens
        step_s = llm.engine.step_time_total_s
        start, cpu = time.perf_counter(), time.process_time()
        outputs = llm.generate(prompts, params)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        profiler.stop(spy)
        tokens = sum(len(o.token_ids) for o in outputs)
        rows.append({"name": "offline", "output_tok_s": tokens / wall, "tpot_p50_ms": _offline_tpot(stamps) * 1000,
                     "tokens": tokens, "engine_cpu_us_per_tok": cpu * 1e6 / tokens,
                     "tok_per_step": (llm.engine.scheduler.num_sampled_tokens - sampled)
                     / max(1, llm.engine.num_steps - steps),
                     "step_ms": (llm.engine.step_time_total_s - step_s) * 1000 / max(1, llm.engine.num_steps - steps)})
    del llm  # its engine and timed_step form a cycle: collected below
    gc.collect()
    return rows


def _offline_tpot(stamps: list) -> float:
    first, last, count = {}, {}, {}
    for t, outputs in stamps:
        for out in outputs:
            if out.new_token_ids:
                first.setdefault(out.request_id, t)
                last[out.request_id] = t
                count[out.request_id] = count.get(out.request_id, 0) + len(out.new_token_ids)
    return statistics.median((last[r] - first[r]) / (count[r] - 1) for r in first if count[r] > 1)


def _measure(url: str, args: argparse.Namespace, seed: int, num: int) -> dict:
    """The closed loop's summary, with the load client's CPU use (seconds per second, summed over its
    `--client-processes`, each every n-th request of the one seeded load: benchclient.client_processes)."""
    target = Target(url, first_model(url), ignore_eos=True, temperature=0.0)
    cfg = RunConfig(target, _workload(args, seed), ArrivalSpec(kind="concurrency", concurrency=args.concurrency),
                    SLO(), warmup_s=0.0, num_requests=num, timeout_s=args.timeout,
                    client_processes=args.client_processes)
    run = asyncio.run(measured_load(cfg))
    summary = summarize(run.results, SLO())
    summary["client_cpu"] = sum(run.client.cpu_s_per_s)
    return summary


def _served_row(name: str, summary: dict, args: argparse.Namespace, cpu: dict[str, float]) -> dict:
    if summary["failed"] or summary["completion_tokens_mean"] != args.output_len:
        raise SystemExit(f"{name}: {summary['failed']} failed requests ({summary['errors']}), "
                         f"{summary['completion_tokens_mean']} tokens per request, expected {args.output_len}")
    tokens = summary["completion_tokens_mean"] * summary["completed"]
    row = {"name": name, "output_tok_s": summary["output_token_throughput"], "tpot_p50_ms": summary["tpot_p50_ms"],
           "ttft_p50_ms": summary["ttft_p50_ms"], "tokens": tokens, "client_cpu": summary["client_cpu"]}
    frontends = [v for k, v in cpu.items() if k.startswith("frontend")]  # HTTP processes (server.api_processes)
    cpu = {k: v for k, v in cpu.items() if not k.startswith("frontend")} | (
        {"frontends": sum(frontends)} if frontends else {})
    return row | {f"{k}_cpu_us_per_tok": v * 1e6 / tokens for k, v in cpu.items()}


def served_runs(name: str, url: str, args: argparse.Namespace, pids: dict[str, int],
                profiler: Profiler | None = None) -> list[dict]:
    _measure(url, args, 1, args.concurrency)  # warm-up, discarded
    rows = []
    for repeat in range(args.repeats):
        before = {k: process_cpu_s(p) for k, p in pids.items()}
        counts = _engine_counts(url) if name == "pdserve" else None
        spies = [profiler.start(f"{name}_{k}", p) for k, p in pids.items()] if profiler else []
        summary = _measure(url, args, _seed(repeat), args.num_prompts)
        for spy in spies:
            Profiler.stop(spy)
        rows.append(_served_row(name, summary, args, {k: process_cpu_s(p) - before[k] for k, p in pids.items()}))
        if counts is not None:
            (steps, sampled, step_s), (steps0, sampled0, step_s0) = _engine_counts(url), counts
            rows[-1]["tok_per_step"] = (sampled - sampled0) / max(1, steps - steps0)
            rows[-1]["step_ms"] = (step_s - step_s0) * 1000 / max(1, steps - steps0)
    return rows


def _engine_counts(url: str) -> tuple[float, float, float]:
    """The served engines' steps, sampled tokens and seconds in step() so far (/metrics)."""
    return (sum(metric_values(url, "pdserve_worker_engine_steps").values()),
            sum(metric_values(url, "pdserve_worker_engine_sampled_tokens_total").values()),
            sum(metric_values(url, "pdserve_worker_engine_step_time_total_s").values()))


def pdserve_runs(args: argparse.Namespace, config: dict, tmp: Path, profiler: Profiler) -> list[dict]:
    with running_server(tmp / "pdserve", config) as server:
        workers = worker_pids(server, "collocated")
        pids = {"coordinator": server.pid} | ({"engine": workers[0]} if len(workers) == 1 else {}) | {
            f"frontend{i}": pid for i, pid in frontend_pids(server.pid).items()}  # server.api_processes > 1
        return served_runs("pdserve", server.url, args, pids, profiler)


def vllm_runs(args: argparse.Namespace, tmp: Path) -> list[dict]:
    """`vllm serve` on the same checkpoint folder (tiny's is built by engine.tiny), driven by the same client."""
    from engine.tiny import resolve_model_path

    port, log_path = free_port(), tmp / "vllm.log"
    command = [args.vllm, "serve", str(resolve_model_path(args.model)), "--host", "127.0.0.1", "--port", str(port),
               *shlex.split(args.vllm_args)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, url, log_path, args.start_timeout)
        return served_runs("vllm", url, args, {"vllm_api": proc.pid})
    finally:
        _stop(proc, 60)


def _table(rows: list[dict]) -> str:
    cols = ["name", "output_tok_s", "tpot_p50_ms", "ttft_p50_ms", "tok_per_step", "step_ms", "engine_cpu_us_per_tok",
            "coordinator_cpu_us_per_tok", "frontends_cpu_us_per_tok", "vllm_api_cpu_us_per_tok", "client_cpu"]
    cols = [c for c in cols if any(c in r for r in rows)]
    lines = ["  ".join(f"{c:>26}" for c in cols)]
    for r in rows:
        lines.append("  ".join(f"{r[c]:>26}" if isinstance(r.get(c), str) else
                               f"{r[c]:>26.1f}" if c in r else f"{'-':>26}" for c in cols))
    return "\n".join(lines)


def _ratio(rows: list[dict], num: str, den: str) -> str:
    a = [r["output_tok_s"] for r in rows if r["name"] == num]
    b = [r["output_tok_s"] for r in rows if r["name"] == den]
    ratios = sorted(x / statistics.median(b) for x in a)
    return (f"{num}/{den} output tok/s: median {statistics.median(a) / statistics.median(b):.3f}"
            f" (each {num} run over the median {den}: {', '.join(f'{x:.3f}' for x in ratios)})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/default.yaml", help="base serving YAML (made collocated, 1 worker)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", help="overrides the config's dtype")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override (dotted key, YAML value), e.g. load_format=dummy; offline gets it too")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--client-processes", type=int, default=1,
                   help="load client processes sharing the closed loop (one Python client tops out near a core)")
    p.add_argument("--repeats", type=int, default=1, help="measured runs of each, back to back")
    p.add_argument("--skip", action="append", default=[], choices=["offline", "pdserve", "vllm"])
    p.add_argument("--vllm", default="vllm", help="the `vllm` command to run (e.g. one in a virtual environment of "
                   "its own)")
    p.add_argument("--vllm-args", default="", help="extra `vllm serve` arguments, e.g. '--dtype float32'")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--profile", metavar="DIR", help="py-spy samples the offline engine and every pdserve process "
                   "through their first measured run, into DIR")
    p.add_argument("--start-timeout", type=float, default=600.0, help="vLLM start-up, seconds")
    args = p.parse_args()
    config = _serving_config(args)
    has_vllm = shutil.which(args.vllm) is not None
    rows: list[dict] = []
    profiler = Profiler(args.profile)
    with tempfile.TemporaryDirectory() as tmp:
        # the servers first: their engines live in processes that give the GPU back when they exit, while an engine
        # built in this process may keep its memory (CUDA graphs, the caching allocator) from the servers after it
        if "pdserve" not in args.skip:
            rows += pdserve_runs(args, config, Path(tmp), profiler)
        if has_vllm and "vllm" not in args.skip:
            rows += vllm_runs(args, Path(tmp))
        if "offline" not in args.skip:
            rows += offline_runs(args, config, Path(tmp), profiler)
    print(f"{args.model} on {args.device}: {args.num_prompts} prompts of {args.input_len} random ids, "
          f"{args.output_len} tokens each (ignore_eos, greedy), concurrency {args.concurrency}")
    print(_table(rows))
    names = {r["name"] for r in rows}
    if {"pdserve", "offline"} <= names:
        print(_ratio(rows, "pdserve", "offline"))
    if {"pdserve", "vllm"} <= names:
        print(_ratio(rows, "pdserve", "vllm"))
    elif not has_vllm:
        print(f"no {args.vllm} command here: no pdserve/vLLM ratio (install vLLM to get it; this program does not)")


if __name__ == "__main__":
    main()
