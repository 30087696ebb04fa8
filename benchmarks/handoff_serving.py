"""The KV handoff inside real serving (`pdserve serve`, disaggregated): the wait between a request's prefill and its
first decode step against the raw transfer time of its KV, per KV cache dtype, and how much running streams slow
while transfers land. Produces docs/benchmarks.md's "KV handoff inside serving" table (`bash benchmarks/gpu_run.sh
handoff`) and the handoff rows of its FP8 table (H, `handoff1`).

    python benchmarks/handoff_serving.py --config configs/gpu-1p1d-llama3-8b.yaml --model /tmp/l8b   # 2 GPUs
    python benchmarks/handoff_serving.py --config configs/gpu-1p1d-llama3-8b.yaml --model /tmp/l8bd \\
        --set load_format=dummy --one-gpu --kv-dtypes auto,fp8 --no-streams   # 1 GPU, bf16 then fp8 KV
    python benchmarks/handoff_serving.py --model tiny --device cpu --prompt-len 400 --stream-tokens 1600 \\
        --window-s 3 --kv-dtypes auto,fp8 --set dtype=bfloat16   # a smoke run (UCX on loopback; figures mean little)

The raw reference, measured before the first server starts and named in the first line printed: a 1 GiB copy
GPU 0 -> GPU 1 (what cuda_ipc moves over between two GPUs); with `--one-gpu` both workers share GPU 0
(`num_gpus: 0.5` each, `kv_cache_memory_bytes` of `--kv-cache-gib` each, so neither sizes its cache from the
device's free memory) and the reference is a copy GPU 0 -> GPU 0 (a handoff there reads and writes the same
memory); on the CPU a host copy. `--kv-dtypes auto,fp8` serves and measures each `kv_cache_dtype` in turn, one
server start each, then prints their ratios. Prints JSON lines, each figure next to its reference from the same run:
- `handoff`: requests of `--prompt-len` tokens sent one at a time (none queues behind another), after one warm-up
  request of the same length; the KV bytes each moved, from the transfer layer's own byte counter (/metrics
  `pdserve_transfer_read_bytes` + `_write_bytes`: the agent that starts a transfer counts it; its change over the
  measured requests, divided by their number) and the backend that moved them (`ucx` when the serving side counted
  bytes too, `cuda_ipc`, one-sided, when it did not); per request the workers' phases
  (coordinator.observability.phases): `kv_transfer` (reserve + pull; pushed: the wait for the last writes after
  the forward) and `decode_join` (KV landed -> its first decode step starts; at TP=1 over cuda_ipc a request joins
  the batch before its copies end and the device runs its first step after them, so this is what is left after
  the copies are seen to end), medians and p90; the raw time of the same bytes at the reference rate;
  `handoff_x_raw` = (kv_transfer + decode_join) / raw (issue 13's goal: at most 1.5) and the effective rate
  bytes / kv_transfer against the reference rate (goal: at least 0.5 of it).
- `handoff_stages`: the same requests' stages inside the decode worker's decode() (PDSERVE_TRACE_HANDOFF, set here):
  ms from the call to its blocks booked, the pull launched, the request joined (TP=1 over cuda_ipc) and the KV seen
  to land, medians.
- `handoff_e2e`: the same requests' whole handoff, from the end of the prefill worker's step that sampled the first
  token (its engine thread's time.monotonic(), PDSERVE_TRACE_HANDOFF) to the decode worker's first step of the
  request, both workers on one host: the worker-measured figures above plus the Ray calls between them (the
  prefill's result to the coordinator, its decode() call), against the raw transfer time; and how long after its
  step the prefill worker handed its result back (a pushed prompt's last writes landing).
- `decode_during_transfers` (not with `--no-streams`): `--streams` streams decoding; the time per output token of
  each, first in a window with no arrivals, then in a window while long prompts arrive (their KV transfers landing
  on the same decode worker), then in a second window with no arrivals; the ratio to the mean of the quiet windows
  on both sides (a step's KV reads grow with the streams' contexts; goal: at most 1.05); and those arrivals' own
  `kv_transfer` and handoff medians, and their `decode_join` in ms and in the streams' steps (joining a running
  batch, where waits for step boundaries show).
- `kv_dtype_comparison` (several `--kv-dtypes`): each later dtype's bytes per request, kv_transfer and handoff
  medians over the first's (fp8 over bf16: 0.5 for the bytes, the per-layer scales never move).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch
import yaml

from coordinator.backend.worker_events import STATS_PERIOD_S
from coordinator.config.serve_config import set_dotted
from engine.tiny import ensure_tiny_model
from tests.server_process import running_server

WITH_PHASES = {"stream": True, "stream_options": {"include_usage": True, "include_phases": True}}
# the transfer layer's byte counters in /metrics (kvtransfer.metrics, summed over the workers' agents): the agent
# that starts a transfer counts its bytes once (read: a pull, write: a push); UCX's serving side counts them again
MOVED = ("pdserve_transfer_read_bytes", "pdserve_transfer_write_bytes")
SERVED = ("pdserve_transfer_serve_read_bytes", "pdserve_transfer_serve_write_bytes")
FAILED = ("pdserve_transfer_read_failures", "pdserve_transfer_write_failures")


def copy_rate(device: str, one_gpu: bool) -> tuple[float, str]:
    """Bytes/s of one 1 GiB copy, the raw reference: GPU 0 -> GPU 1 (what cuda_ipc moves over between two GPUs),
    GPU 0 -> GPU 0 with one_gpu (both workers' caches in one device's memory), or host memory on the CPU."""
    n = 1 << 29  # bf16 elements: 1 GiB
    if device == "cuda":
        target = "cuda:0" if one_gpu else "cuda:1"
        src = torch.empty(n, dtype=torch.bfloat16, device="cuda:0")
        dst = torch.empty(n, dtype=torch.bfloat16, device=target)
        dst.copy_(src)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            dst.copy_(src)
        torch.cuda.synchronize()
        rate = 5 * 2 * n / (time.perf_counter() - start)
        del src, dst
        torch.cuda.empty_cache()
        return rate, ("cuda:0 -> cuda:0 copy (one GPU: both workers on it)" if one_gpu
                      else "cuda:0 -> cuda:1 peer copy")
    src, dst = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    dst.copy_(src)
    start = time.perf_counter()
    dst.copy_(src)
    return 2 * n / (time.perf_counter() - start), "host memory copy"


async def one_with_phases(client: httpx.AsyncClient, url: str, model: str, prompt: list[int]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "ignore_eos": True, "temperature": 0, **WITH_PHASES}
    phases = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                phases = chunk.get("phases") or phases
    return phases or {}


async def transfer_counters(client: httpx.AsyncClient, url: str, above: float) -> dict[str, float]:
    """pdserve_transfer_* once the coordinator's stats loop (every STATS_PERIOD_S) has gathered every finished
    transfer: the moved bytes above `above` and unchanged over two refreshes (or as they are after 20 refreshes)."""
    last, same, found = None, 0, {}
    for _ in range(20):
        text = (await client.get(f"{url}/metrics")).text
        found = {name: float(value) for name, value in (line.split()[:2] for line in text.splitlines()
                                                        if line.startswith("pdserve_transfer_"))}
        moved = sum(found.get(k, 0.0) for k in MOVED)
        same = same + 1 if moved == last and moved > above else 0
        if same == 2:
            break
        last = moved
        await asyncio.sleep(STATS_PERIOD_S)
    return found


async def handoff(url: str, model: str, warmup: list[int], prompts: list[list[int]]) -> tuple[list[dict], dict]:
    """The measured requests' phases, and the change of the transfer counters over them."""
    async with httpx.AsyncClient(timeout=600) as client:
        await one_with_phases(client, url, model, warmup)
        before = await transfer_counters(client, url, 0.0)
        phases = [await one_with_phases(client, url, model, p) for p in prompts]
        after = await transfer_counters(client, url, sum(before.get(k, 0.0) for k in MOVED))
    return phases, {k: v - before.get(k, 0.0) for k, v in after.items()}


async def stream_tokens(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
                        stamps: list[float]) -> None:
    """Stream one request, appending one timestamp per output token (tokens counted from the chunks' logprobs)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "logprobs": 0, "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    now = time.perf_counter()
                    stamps.extend([now] * len((choice.get("logprobs") or {}).get("tokens") or [0]))


def tpot_in(stamps: list[float], start: float, end: float) -> float | None:
    inside = [t for t in stamps if start <= t < end]
    return (inside[-1] - inside[0]) / (len(inside) - 1) if len(inside) > 2 else None


async def decode_during_transfers(url: str, model: str, args: argparse.Namespace, vocab: int) -> dict:
    rng = random.Random(1)
    stamps: list[list[float]] = [[] for _ in range(args.streams)]
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        short = [[rng.randrange(3, vocab) for _ in range(16)] for _ in stamps]
        background = [asyncio.create_task(stream_tokens(client, url, model, p, args.stream_tokens, s))
                      for p, s in zip(short, stamps, strict=True)]
        while not all(len(s) >= 3 for s in stamps):
            for task in background:
                if task.done():  # a stream refused (e.g. past the model's length) or ended: say so, never hang
                    task.result()
                    raise SystemExit("a stream ended before the windows: raise --stream-tokens")
            await asyncio.sleep(0.05)
        quiet_start = time.perf_counter()
        await asyncio.sleep(args.window_s)
        busy_start = time.perf_counter()
        arrivals = []
        while time.perf_counter() - busy_start < args.window_s:
            prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
            arrivals.append(asyncio.create_task(one_with_phases(client, url, model, prompt)))
            await asyncio.sleep(args.arrival_interval_s)
        busy_end = time.perf_counter()
        landed = await asyncio.gather(*arrivals)
        after_start = time.perf_counter()  # a quiet window after, too: the streams' contexts grow all along
        await asyncio.sleep(args.window_s)
        after_end = time.perf_counter()
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
    before = [x for s in stamps if (x := tpot_in(s, quiet_start, busy_start)) is not None]
    busy = [x for s in stamps if (x := tpot_in(s, busy_start, busy_end)) is not None]
    after = [x for s in stamps if (x := tpot_in(s, after_start, after_end)) is not None]
    if not before or not busy or not after:
        return {"case": "decode_during_transfers", "error": "the streams ended before the three windows closed: "
                "raise --stream-tokens or lower --window-s"}
    # the reference: the quiet windows on both sides (a step reads more KV as the streams' contexts grow)
    q, b = (statistics.median(before) + statistics.median(after)) / 2, statistics.median(busy)
    kv = [p.get("kv_transfer", 0.0) for p in landed]
    join = statistics.median(p.get("decode_join", 0.0) for p in landed)
    handoff = [p.get("kv_transfer", 0.0) + p.get("decode_join", 0.0) for p in landed]
    return {"case": "decode_during_transfers", "streams": args.streams, "arrivals": len(arrivals),
            "prompt_len": args.prompt_len, "tpot_ms_quiet": round(q * 1e3, 3),
            "tpot_ms_quiet_before": round(statistics.median(before) * 1e3, 3),
            "tpot_ms_quiet_after": round(statistics.median(after) * 1e3, 3), "tpot_ms_transfers": round(b * 1e3, 3),
            "slowdown": round(b / q, 3),  # and the arrivals' own handoff, joining a running batch
            "arrivals_kv_transfer_ms_p50": round(statistics.median(kv) * 1e3, 3),
            "arrivals_handoff_ms_p50": round(statistics.median(handoff) * 1e3, 3),
            "arrivals_decode_join_ms_p50": round(join * 1e3, 3),
            "arrivals_decode_join_in_steps": round(join / b, 2)}  # b: the streams' time per token, one step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--model", required=True, help="a local checkpoint folder, or tiny")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--one-gpu", action="store_true", help="both workers on GPU 0 (num_gpus 0.5 each); the "
                        "reference is then a same-device copy")
    parser.add_argument("--kv-cache-gib", type=float, default=8.0, help="with --one-gpu: each worker's KV cache")
    parser.add_argument("--kv-dtypes", default=None, help="kv_cache_dtype values served in turn, e.g. auto,fp8 "
                        "(default: the config's)")
    parser.add_argument("--no-streams", action="store_true", help="skip decode_during_transfers")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--streams", type=int, default=32, help="streams decoding in the slowdown windows")
    parser.add_argument("--stream-tokens", type=int, default=4000)
    parser.add_argument("--window-s", type=float, default=5.0)
    parser.add_argument("--arrival-interval-s", type=float, default=0.25)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. load_format=dummy (YAML value syntax)")
    args = parser.parse_args()
    if args.one_gpu and args.device != "cuda":
        parser.error("--one-gpu puts both workers on GPU 0: it needs --device cuda")
    if args.device == "cuda" and not args.one_gpu and torch.cuda.device_count() < 2:
        parser.error(f"the peer-copy reference needs 2 GPUs, this machine has {torch.cuda.device_count()}: pass "
                     "--one-gpu to share GPU 0 between both workers")
    if args.requests < 1 or args.prompt_len < 1 or args.kv_cache_gib <= 0:
        parser.error("--requests, --prompt-len and --kv-cache-gib must be positive")
    rate, what = copy_rate(args.device, args.one_gpu)
    print(json.dumps({"reference": what, "gb_per_s": round(rate / 1e9, 1)}), flush=True)
    config = yaml.safe_load(Path(args.config).read_text())
    config.pop("ray_address", None)
    config |= {"model": args.model, "mode": "disaggregated"}
    if args.one_gpu:  # before --set, which may change these too
        kv = int(args.kv_cache_gib * (1 << 30))
        set_dotted(config, {f"{pool}.{key}": value for pool in ("prefill", "decode")
                            for key, value in (("num_gpus", 0.5), ("kv_cache_memory_bytes", kv))})
    set_dotted(config, {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)})
    model_dir = ensure_tiny_model() if args.model == "tiny" else Path(args.model)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    warmup, *prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests + 1)]
    dtypes = args.kv_dtypes.split(",") if args.kv_dtypes else [config.get("kv_cache_dtype", "auto")]
    os.environ["PDSERVE_TRACE_HANDOFF"] = "1"  # the decode worker logs each handoff's stages (decode_pool.handoff)
    results = []
    for dtype in dtypes:
        served = config | {"kv_cache_dtype": dtype}
        with tempfile.TemporaryDirectory() as tmp, running_server(Path(tmp), served) as server:
            phases, counters = asyncio.run(handoff(server.url, args.model, warmup, prompts))
            results.append(print_handoff(phases, counters, dtype, args.prompt_len, rate, what))
            print_stages(Path(tmp) / "server.log", args.requests, results[-1]["kv_bytes_per_request"] / rate)
            if not args.no_streams:
                print(json.dumps(asyncio.run(decode_during_transfers(server.url, args.model, args, vocab))),
                      flush=True)
    for other in results[1:]:
        print(json.dumps(compare(results[0], other)), flush=True)


def print_stages(log: Path, requests: int, raw_s: float) -> None:
    """Medians of the decode worker's handoff stages (ms since its decode() began) over the measured requests (the
    log's first handoff lines after the warm-up's); then, for the same requests, the whole way from the end of the
    prefill worker's step that sampled the first token to the decode worker's first step of the request (both
    workers' time.monotonic() stamps: one host), against the raw transfer time."""
    text = log.read_text(errors="replace")
    rows = [json.loads(m.group(0)) for m in re.finditer(r'\{"handoff_trace".*\}', text)]
    rows = rows[1:1 + requests]
    if not rows:
        print(json.dumps({"case": "handoff_stages", "error": f"no handoff_trace line in {log}"}), flush=True)
        return
    stages = [k for k in rows[0] if k not in ("handoff_trace", "first_step_at", "heard_at")]
    print(json.dumps({"case": "handoff_stages", "requests": len(rows), "since_decode_call_ms_p50": {
        k: round(statistics.median(r[k] for r in rows if k in r), 3) for k in stages}}), flush=True)
    prefills = {p["prefill_trace"]: p for p in (json.loads(m.group(0)) for m in
                                                re.finditer(r'\{"prefill_trace".*\}', text))}
    pairs = [(prefills[r["handoff_trace"]], r) for r in rows if r["handoff_trace"] in prefills and "first_step_at" in r]
    if not pairs:
        print(json.dumps({"case": "handoff_e2e", "error": "no prefill_trace lines matching the decode worker's"}))
        return
    whole = sorted(d["first_step_at"] - p["step_end"] for p, d in pairs)
    result = sorted(p["result_at"] - p["step_end"] for p, _ in pairs)
    p50 = statistics.median(whole)
    heard = [(d["heard_at"] - p["result_at"], d["first_step_at"] - d["heard_at"]) for p, d in pairs if "heard_at" in d]
    split = {"notified": len(heard)}
    if heard:  # the notification's way (prefill result -> decode agent's thread), then on to the first step
        split |= {"result_to_heard_ms_p50": round(statistics.median(h for h, _ in heard) * 1e3, 3),
                  "heard_to_first_step_ms_p50": round(statistics.median(f for _, f in heard) * 1e3, 3)}
    print(json.dumps({"case": "handoff_e2e", "requests": len(pairs), "pushed": sum(p["pushed"] for p, _ in pairs),
                      **split, "prefill_result_ms_p50": round(statistics.median(result) * 1e3, 3),
                      "step_end_to_first_decode_step_ms_p50": round(p50 * 1e3, 3),
                      "p90": round(whole[int(0.9 * (len(whole) - 1))] * 1e3, 3), "raw_ms": round(raw_s * 1e3, 3),
                      "x_raw": round(p50 / raw_s, 2) if raw_s > 0 else None}), flush=True)


def print_handoff(phases: list[dict], counters: dict[str, float], dtype: str, prompt_len: int, rate: float,
                  reference: str) -> dict:
    """Print and return the `handoff` line of one server's measured requests."""
    n = len(phases)
    nbytes = sum(counters.get(k, 0.0) for k in MOVED) / n
    failures = sum(counters.get(k, 0.0) for k in FAILED)
    kv = sorted(p.get("kv_transfer", 0.0) for p in phases)
    join = [p.get("decode_join", 0.0) for p in phases]
    both = sorted(p.get("kv_transfer", 0.0) + p.get("decode_join", 0.0) for p in phases)
    raw = nbytes / rate
    line = {"case": "handoff", "kv_cache_dtype": dtype, "requests": n, "prompt_len": prompt_len,
            "kv_bytes_per_request": round(nbytes), "transfer_failures": round(failures),
            "backend": "ucx" if sum(counters.get(k, 0.0) for k in SERVED) > 0 else "cuda_ipc",
            "kv_transfer_ms_p50": round(statistics.median(kv) * 1e3, 3), "kv_transfer_ms_p90": round(p90(kv) * 1e3, 3),
            "decode_join_ms_p50": round(statistics.median(join) * 1e3, 3),
            "handoff_ms_p50": round(statistics.median(both) * 1e3, 3), "handoff_ms_p90": round(p90(both) * 1e3, 3),
            "raw_ms": round(raw * 1e3, 3), "raw_reference": reference}
    if nbytes <= 0 or statistics.median(kv) <= 0:  # the handoffs failed (recomputed: no bytes) or had no phase
        line["error"] = "no KV bytes moved or no kv_transfer phase: see the server log's transfer errors"
    else:
        line |= {"handoff_x_raw": round(statistics.median(both) / raw, 2),
                 "effective_gb_per_s": round(nbytes / statistics.median(kv) / 1e9, 2),
                 "effective_x_reference": round(nbytes / statistics.median(kv) / rate, 3)}
    print(json.dumps(line), flush=True)
    return line


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.9 * (len(ordered) - 1))]


def compare(base: dict, other: dict) -> dict:
    """`other`'s bytes and times over `base`'s (fp8 over bf16 KV: bytes 0.5)."""
    def ratio(key: str) -> float | None:
        return round(other[key] / base[key], 3) if base.get(key) else None
    return {"case": "kv_dtype_comparison", "of": f"{other['kv_cache_dtype']} / {base['kv_cache_dtype']}",
            "bytes_per_request": [base["kv_bytes_per_request"], other["kv_bytes_per_request"]],
            "bytes_ratio": ratio("kv_bytes_per_request"), "kv_transfer_p50_ratio": ratio("kv_transfer_ms_p50"),
            "handoff_p50_ratio": ratio("handoff_ms_p50"), "handoff_p90_ratio": ratio("handoff_ms_p90")}


if __name__ == "__main__":
    main()
