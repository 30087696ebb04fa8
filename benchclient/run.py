"""One load run: send a workload at an arrival process, collect every result, summarize, save.

Owns `run_load` / `measured_load` (the results, and with them what the client's CPUs spent: a client busy all the
time measures itself) and the saved document (`run_report`). How a load is sent (warm-up marking, open and closed
loops, multi-turn conversations, the end of sending and the wait for requests in flight) is benchclient.sender's,
the settings (`RunConfig`) benchclient.run_config's. With `client_processes` > 1 the load goes out from that many
processes (benchclient.client_processes, `run_share` each), every n-th request, conversation or closed-loop lane of
the same seeded load from one common start. The saved document adds the server's per-request phases when it sent
them (benchclient.phase_table) and the client's CPU figures. `pdserve bench` is `main` in benchclient/cli.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchclient.client import RequestResult
from benchclient.client_processes import ClientUsage, Share, fan_out
from benchclient.phase_table import phase_summary
from benchclient.progress import Progress
from benchclient.run_config import RunConfig
from benchclient.sender import send_share
from benchclient.stats import summarize


@dataclass(frozen=True)
class LoadRun:
    results: list[RequestResult]  # every request's, warm-up ones included (marked)
    client: ClientUsage           # what sending cost the client processes' CPUs


async def run_load(cfg: RunConfig, progress: bool = False) -> list[RequestResult]:
    """Every request's result, warm-up ones included (marked)."""
    return (await measured_load(cfg, progress)).results


async def measured_load(cfg: RunConfig, progress: bool = False) -> LoadRun:
    """run_load's results and the client processes' CPU seconds per second of the run."""
    horizon = cfg.warmup_s + (math.inf if cfg.num_requests else cfg.duration_s)
    bar = Progress(horizon if math.isfinite(horizon) else None, cfg.num_requests, enabled=progress)
    ticker = asyncio.create_task(bar.tick_forever())
    try:
        if cfg.client_processes == 1:
            t0, cpu0 = time.perf_counter(), time.process_time()
            results = await send_share(cfg, Share(), t0, bar)
            return LoadRun(results, ClientUsage(((time.process_time() - cpu0) / (time.perf_counter() - t0),)))

        def show(counts: list[int]) -> None:  # from fan_out's thread: sent, done, failed of every process
            bar.sent, bar.done, bar.failed = (sum(counts[k::3]) for k in range(3))
        # each process ends by itself (every request has its timeout); the deadline only bounds a stuck one
        deadline = horizon + cfg.timeout_s + 60
        shares = await asyncio.to_thread(fan_out, run_share, (cfg,), cfg.client_processes, deadline, show)
        results = [r for part, _ in shares for r in part]
        results.sort(key=lambda r: r.start)
        return LoadRun(results, ClientUsage(tuple(cpu for _, cpu in shares)))
    finally:
        ticker.cancel()
        bar.close()


async def run_share(share: Share, t0: float, counts, cfg: RunConfig) -> list[RequestResult]:
    """One client process's part of a load (benchclient.client_processes.fan_out's function): its requests' results;
    its progress kept in `counts` [3 x processes] (sent, done, failed)."""
    bar = Progress(None, None, enabled=False)

    async def keep_counts() -> None:
        while True:
            counts[3 * share.index:3 * share.index + 3] = [bar.sent, bar.done, bar.failed]
            await asyncio.sleep(0.25)
    keeper = asyncio.create_task(keep_counts())
    try:
        delay = t0 - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        return await send_share(cfg, share, t0, bar)
    finally:
        keeper.cancel()
        counts[3 * share.index:3 * share.index + 3] = [bar.sent, bar.done, bar.failed]


def result_record(r: RequestResult, t0: float) -> dict[str, Any]:
    """One request for the saved JSON: times in seconds from the run's first send."""
    return {"start_s": r.start - t0, "warmup": r.warmup, "ok": r.ok, "error": r.error, "ttft_s": r.ttft,
            "e2e_s": r.e2e, "tpot_s": r.tpot, "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.completion_tokens, "max_tokens": r.max_tokens, "input_len": r.input_len,
            "chunks": len(r.chunk_times), "finish_reason": r.finish_reason,
            "chunk_offsets_ms": [round((t - r.start) * 1000, 2) for t in r.chunk_times], "phases_s": r.phases,
            "cached_tokens": r.cached_tokens, "conversation": r.conversation, "turn": r.turn}


def run_report(cfg: RunConfig, results: list[RequestResult], client: ClientUsage | None = None) -> dict[str, Any]:
    """The saved document: the run's settings (no API key), the summary, the server's phases (where did the time
    go), what the client processes' CPUs spent (when given), and every request."""
    settings = dataclasses.asdict(cfg)
    settings["target"].pop("api_key", None)
    t0 = min((r.start for r in results), default=0.0)
    doc = {"settings": settings, "summary": summarize(results, cfg.slo), "phases": phase_summary(results)}
    if client is not None:
        doc["client"] = client.record()
    return doc | {"requests": [result_record(r, t0) for r in results]}


def save_json(doc: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(doc), indent=1, allow_nan=False) + "\n")


def json_safe(x: Any) -> Any:
    """NaN (a figure with no samples) becomes null, so the file is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x
