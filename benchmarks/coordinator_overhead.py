"""The coordinator alone: its CPU per streamed token, and a probe request's TTFT while a flood of streams runs.
Produces docs/benchmarks.md's "coordinator CPU per output token" row (Serving overhead, CPU).

The real app (`coordinator.api.app.create_app` under `coordinator.api.http_server.uvicorn_config`: FastAPI, httptools
with
its head timeout, tokenizer, detokenizer, SSE, metrics) serves, in a subprocess of its own, over PacedBackend: one
token to every running stream per tick, as an engine's decode step gives one to every running request, and exactly
max_tokens of them. No engine and no Ray: what is measured is the coordinator's own work per token (issue 13,
serving overhead; issue 16, a high-priority request's TTFT behind a flood's per-token work).

Prints one JSON line per window: the probe's TTFT p50/p99 (Poisson `--probe-rate`, short outputs), the flood's
output tokens/s, and the server process's CPU (seconds per second, and microseconds per output token); the first
window has no flood (the reference), the others `--flood` streams each. `--tenants`: the probe is a high-priority
tenant's, the flood a low-priority one's (API keys), and the flood's client runs in a process of its own.

    python benchmarks/coordinator_overhead.py --flood 16,48 --duration 15
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchclient.arrivals import ArrivalSpec  # noqa: E402
from benchclient.client import Target  # noqa: E402
from benchclient.run import RunConfig, run_load  # noqa: E402
from benchclient.stats import SLO, summarize  # noqa: E402
from benchclient.workload import WorkloadSpec  # noqa: E402
from benchmarks.proc_cpu import process_cpu_s  # noqa: E402
from coordinator.backend.held_queue import HeldQueue  # noqa: E402
from coordinator.backend.output_intake import coalesced as _coalesced  # noqa: E402
from coordinator.contract import GenerateRequest, TokenDelta  # noqa: E402
from engine.core.scheduler import StepOutput  # noqa: E402


class PacedBackend:
    """A ServingBackend whose every stream gains one random token per tick (all streams on one ticker task). Its
    streams take step outputs as RayBackend's do: through a HeldQueue when the request streams n > 1 tokens a chunk
    (unless `hold` is off), coalesced by the reader."""

    def __init__(self, model_path: str, tick_s: float, vocab_size: int, hold: bool = True) -> None:
        self.model_name, self.model_path, self.max_model_len, self.vocab_size = "tiny", model_path, 4096, vocab_size
        self.tick_s, self.hold = tick_s, hold
        self._streams: dict[str, tuple[asyncio.Queue, list[int]]] = {}  # id -> (queue, [tokens left])
        self._ticker: asyncio.Task | None = None
        self._rng = random.Random(0)

    async def start(self) -> None:
        pass

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick())
        held = self.hold and request.stream_interval > 1
        queue = HeldQueue(request.stream_interval) if held else asyncio.Queue()
        self._streams[request.request_id] = (queue, [request.params.max_tokens])
        return self._stream(request.request_id, queue)

    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[TokenDelta]:
        try:
            while True:
                delta, _ = _coalesced(await queue.get(), queue)
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            self._streams.pop(request_id, None)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            for queue, left in list(self._streams.values()):
                if left[0] <= 0:  # ended; its consumer has not closed the stream yet
                    continue
                left[0] -= 1
                queue.put_nowait(StepOutput("paced", [self._rng.randrange(10, self.vocab_size)], [],
                                            "length" if left[0] <= 0 else None))

    def generate_group(self, request: GenerateRequest):
        raise NotImplementedError("n > 1 is not part of this benchmark")

    def health(self) -> tuple[bool, list[dict]]:
        return True, []

    def stats(self) -> dict:
        return {"workers": [], "transfer": {}, "queue_length": 0}

    async def shutdown(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()


def serve(port: int, tick_s: float, stream_interval: int, hold: bool, tenants: bool = False) -> None:
    """The server subprocess: the real app over PacedBackend on 127.0.0.1:port."""
    import uvicorn

    from coordinator.api.app import create_app
    from coordinator.api.http_server import uvicorn_config
    from coordinator.config.settings import ServerSettings
    from engine.tiny import ensure_tiny_model
    folder = ensure_tiny_model()
    from coordinator.config.tenants_config import parse_tenants
    settings = ServerSettings(port=port, stream_interval=stream_interval)
    app = create_app(PacedBackend(str(folder), tick_s, 2048, hold), settings,
                     parse_tenants(TENANTS) if tenants else None)
    uvicorn.Server(uvicorn_config(app, settings, log_config=None, log_level="warning")).run()


TENANTS = [{"name": "interactive", "api_keys": ["k-probe"], "priority": "high"},
           {"name": "bulk", "api_keys": ["k-flood"], "priority": "low"}]


def _run(url: str, key: str, arrival: ArrivalSpec, output_len: int, duration: float,
         tenants: bool = False) -> RunConfig:
    return RunConfig(Target(url, "tiny", ignore_eos=True, api_key=f"k-{key}" if tenants else None),
                     WorkloadSpec(kind="fixed", input_len=32, output_len=output_len, prompt_format="text",
                                  seed=1 if key == "probe" else 2),
                     arrival, SLO(), duration_s=duration, warmup_s=0.0, timeout_s=120)


def _load_in_process(cfg: RunConfig) -> list:
    return asyncio.run(run_load(cfg))


async def window(url: str, pid: int, args: argparse.Namespace, flood: int, flood_client=None) -> dict:
    """`flood_client` (with --tenants): a process of its own for the flood's closed loop, so that its chunks do not
    delay the probe's timestamps on a shared event loop."""
    runs = [run_load(_run(url, "probe", ArrivalSpec(rate=args.probe_rate, seed=1), 8, args.duration, args.tenants))]
    if flood:
        low = _run(url, "flood", ArrivalSpec(kind="concurrency", concurrency=flood), args.flood_output_len,
                   args.duration, args.tenants)
        runs.append(run_load(low) if flood_client is None else
                    asyncio.get_running_loop().run_in_executor(flood_client, _load_in_process, low))
    cpu, started = process_cpu_s(pid), time.monotonic()
    results = await asyncio.gather(*runs)
    cpu_per_s = (process_cpu_s(pid) - cpu) / (time.monotonic() - started)
    probe = summarize(results[0], SLO())
    out = {"flood": flood, "probe_ttft_p50_ms": round(probe["ttft_p50_ms"], 1),
           "probe_ttft_p99_ms": round(probe["ttft_p99_ms"], 1), "probe_failed": probe["failed"],
           "coordinator_cpu_s_per_s": round(cpu_per_s, 3)}
    if flood:
        low = summarize(results[1], SLO())
        tok_s = low["output_token_throughput"]
        out |= {"flood_output_tok_s": round(tok_s, 1), "cpu_us_per_token": round(1e6 * cpu_per_s / tok_s, 1)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flood", default="16,48", help="streams in flight per window (comma-separated)")
    p.add_argument("--tenants", action="store_true",
                   help="the probe as a high-priority tenant, the flood as a low-priority one (its client in its own "
                        "process)")
    p.add_argument("--tick-ms", type=float, default=10.0, help="one token to every stream this often")
    p.add_argument("--flood-output-len", type=int, default=128)
    p.add_argument("--probe-rate", type=float, default=4.0, help="probe requests per second (Poisson)")
    p.add_argument("--duration", type=float, default=15.0, help="seconds per window")
    p.add_argument("--port", type=int, default=18093)
    p.add_argument("--stream-interval", type=int, default=1, help="the server's stream_interval (tokens per chunk)")
    p.add_argument("--no-hold", action="store_true",
                   help="the backend wakes each stream every tick, whatever its stream_interval (no HeldQueue)")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args.port, args.tick_ms / 1e3, args.stream_interval, not args.no_hold, args.tenants)
        return
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--port", str(args.port),
                               "--stream-interval", str(args.stream_interval), *(["--no-hold"] * args.no_hold),
                               *(["--tenants"] * args.tenants),
                               "--tick-ms", str(args.tick_ms)])
    url = f"http://127.0.0.1:{args.port}"
    try:
        import httpx
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the coordinator did not start")
            time.sleep(0.2)
        flood_client = None
        if args.tenants:
            flood_client = ProcessPoolExecutor(1, mp_context=get_context("spawn"))
            flood_client.submit(int).result()  # started before any window's clock runs
        asyncio.run(window(url, server.pid, argparse.Namespace(**{**vars(args), "duration": 3.0}), 8,
                           flood_client))  # warm
        for flood in [0] + [int(x) for x in args.flood.split(",")]:
            print(json.dumps(asyncio.run(window(url, server.pid, args, flood, flood_client))), flush=True)
        if flood_client is not None:
            flood_client.shutdown()
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
