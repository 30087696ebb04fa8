"""One load run: send a workload at an arrival process, collect every result, summarize, save.

Owns `RunConfig` and `run_load`. Requests sent in the first `warmup_s` seconds are marked warm-up and left out of
the figures; measured requests are those sent in the next `duration_s` seconds (or exactly `num_requests` of them).
A `multiturn` workload sends conversations: the arrival process starts them (a closed loop keeps `concurrency` of
them going), each sends its turns one after the other, a turn after the previous reply and its think time, its
prompt the history with the server's replies (benchclient.conversations); every turn is one measured (or warm-up)
request, and no conversation starts or goes on once the run's sending ends. Sending stops then, and the run waits
for every request in flight to finish or hit `timeout_s` (a timeout is a failed request). The saved document adds
the server's per-request phases when it sent them (benchclient.phase_table). `pdserve bench` is `main` in
benchclient/cli.py.
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

import httpx

from benchclient.arrivals import ArrivalSpec, send_times
from benchclient.client import RequestResult, Target, stream_request
from benchclient.conversations import Conversation, build_conversations, turn_prompt
from benchclient.phase_table import phase_summary
from benchclient.progress import Progress
from benchclient.stats import SLO, summarize
from benchclient.workload import BenchRequest, iter_requests
from benchclient.workload_spec import WorkloadSpec


@dataclass(frozen=True)
class RunConfig:
    target: Target
    workload: WorkloadSpec = WorkloadSpec()
    arrival: ArrivalSpec = ArrivalSpec(rate=1.0)
    slo: SLO = SLO()
    duration_s: float = 60.0
    warmup_s: float = 5.0
    num_requests: int | None = None   # measured requests; when set, the run sends this many instead of a duration
    timeout_s: float = 600.0          # per request, from send to [DONE]

    def __post_init__(self) -> None:
        if not self.duration_s > 0 or self.warmup_s < 0 or not self.timeout_s > 0:
            raise ValueError("duration_s and timeout_s must be positive and warmup_s not negative")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be positive, got {self.num_requests}")


KEEPALIVE_EXPIRY_S = 2.0


async def run_load(cfg: RunConfig, progress: bool = False) -> list[RequestResult]:
    """Every request's result, warm-up ones included (marked)."""
    # an idle pooled connection is dropped after KEEPALIVE_EXPIRY_S, before a server with a 5 s keep-alive (pdserve's
    # and vLLM's default) closes it: at equal timeouts a request sent as the server closes fails with a ReadError
    # (seen once in 852 requests of the multi-turn agents load, whose turns come 10 s apart)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=KEEPALIVE_EXPIRY_S)
    timeout = httpx.Timeout(cfg.timeout_s, connect=min(30.0, cfg.timeout_s))
    horizon = cfg.warmup_s + (math.inf if cfg.num_requests else cfg.duration_s)
    bar = Progress(horizon if math.isfinite(horizon) else None, cfg.num_requests, enabled=progress)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        send = _Sender(client, cfg, bar, time.perf_counter())
        ticker = asyncio.create_task(bar.tick_forever())
        try:
            if cfg.workload.kind == "multiturn":
                await send.conversations()
            elif cfg.arrival.open_loop:
                await send.open_loop()
            else:
                await asyncio.gather(*[send.closed_loop_worker() for _ in range(cfg.arrival.concurrency)])
            bar.draining = True
            return list(await asyncio.gather(*send.tasks))
        finally:
            ticker.cancel()
            bar.close()


class _Sender:
    def __init__(self, client: httpx.AsyncClient, cfg: RunConfig, bar: Progress, t0: float) -> None:
        self.client, self.cfg, self.bar, self.t0 = client, cfg, bar, t0
        self.requests = iter_requests(cfg.workload)
        self.tasks: list[asyncio.Task] = []
        self.measured_sent = 0

    def _more(self, now: float) -> bool:
        if self.cfg.num_requests is not None:
            return self.measured_sent < self.cfg.num_requests
        return now - self.t0 < self.cfg.warmup_s + self.cfg.duration_s

    def _start(self, req: BenchRequest, now: float) -> asyncio.Task:
        warmup = now - self.t0 < self.cfg.warmup_s
        self.measured_sent += not warmup
        task = asyncio.create_task(self._one(req, warmup))
        self.tasks.append(task)
        return task

    async def conversations(self) -> None:
        """Start each conversation at its arrival (open loop) or when one of `concurrency` ends (closed loop)."""
        cfg = self.cfg
        pending = build_conversations(cfg.workload)
        if cfg.arrival.open_loop:
            runs = []
            for offset, conv in zip(send_times(cfg.arrival, math.inf, limit=len(pending)), pending, strict=False):
                delay = self.t0 + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if not self._more(time.perf_counter()):
                    break
                runs.append(asyncio.create_task(self._conversation(conv)))
            await asyncio.gather(*runs)
            return

        async def lane() -> None:
            while pending and self._more(time.perf_counter()):
                await self._conversation(pending.pop(0))
        await asyncio.gather(*[lane() for _ in range(cfg.arrival.concurrency)])

    async def _conversation(self, conv: Conversation) -> None:
        """Its turns in order, each with the history and the server's replies so far; ends at a failed turn."""
        replies: list[str] = []
        for turn in range(conv.turns):
            now = time.perf_counter()
            if not self._more(now):
                return
            prompt = turn_prompt(conv, replies, turn, chat=self.cfg.target.endpoint == "chat")
            result = await self._start(BenchRequest(prompt, len(conv.users[turn].split()), conv.max_tokens[turn]),
                                       now)
            result.conversation, result.turn = conv.index, turn
            if not result.ok:
                return
            replies.append(result.text)
            if conv.think_s[turn] > 0:
                await asyncio.sleep(conv.think_s[turn])

    async def _one(self, req: BenchRequest, warmup: bool) -> RequestResult:
        start = time.perf_counter()
        self.bar.sent += 1
        try:
            result = await asyncio.wait_for(stream_request(self.client, self.cfg.target, req, warmup),
                                            self.cfg.timeout_s)
        except asyncio.TimeoutError:
            result = RequestResult(start=start, input_len=req.input_len, max_tokens=req.max_tokens, warmup=warmup,
                                   end=time.perf_counter(), error=f"timeout after {self.cfg.timeout_s:g} s")
        self.bar.done += 1
        self.bar.failed += not result.ok
        return result

    async def open_loop(self) -> None:
        cfg = self.cfg
        warm = len(send_times(cfg.arrival, cfg.warmup_s)) if cfg.warmup_s > 0 else 0
        if cfg.num_requests is not None:
            times = send_times(cfg.arrival, math.inf, limit=warm + cfg.num_requests)
        else:
            times = send_times(cfg.arrival, cfg.warmup_s + cfg.duration_s)
        for offset, req in zip(times, self.requests, strict=False):
            delay = self.t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            self._start(req, self.t0 + offset)  # warm-up or not by schedule, not by a late wake-up

    async def closed_loop_worker(self) -> None:
        while self._more(time.perf_counter()):
            await self._start(next(self.requests), time.perf_counter())


def result_record(r: RequestResult, t0: float) -> dict[str, Any]:
    """One request for the saved JSON: times in seconds from the run's first send."""
    return {"start_s": r.start - t0, "warmup": r.warmup, "ok": r.ok, "error": r.error, "ttft_s": r.ttft,
            "e2e_s": r.e2e, "tpot_s": r.tpot, "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.completion_tokens, "max_tokens": r.max_tokens, "input_len": r.input_len,
            "chunks": len(r.chunk_times), "finish_reason": r.finish_reason,
            "chunk_offsets_ms": [round((t - r.start) * 1000, 2) for t in r.chunk_times], "phases_s": r.phases,
            "cached_tokens": r.cached_tokens, "conversation": r.conversation, "turn": r.turn}


def run_report(cfg: RunConfig, results: list[RequestResult]) -> dict[str, Any]:
    """The saved document: the run's settings (no API key), the summary, the server's phases (where did the time
    go), and every request."""
    settings = dataclasses.asdict(cfg)
    settings["target"].pop("api_key", None)
    t0 = min((r.start for r in results), default=0.0)
    return {"settings": settings, "summary": summarize(results, cfg.slo), "phases": phase_summary(results),
            "requests": [result_record(r, t0) for r in results]}


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
