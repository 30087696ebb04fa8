"""Sending one share of a load: the arrival schedule, closed-loop lanes or conversations, each request streamed.

Owns `send_share` and `Sender`, benchclient.run's sending half: requests sent in the first `warmup_s` seconds (by
the schedule, not by a late wake-up) are marked warm-up; sending stops at the run's end or after its
`num_requests`, then every request in flight is waited for (each bounded by `timeout_s`). A `Share` (benchclient.
client_processes) selects every count-th request, conversation or closed-loop lane of the one seeded load, so that
several processes together send exactly what one would.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time

import httpx

from benchclient.arrivals import send_times
from benchclient.client import RequestResult, stream_request
from benchclient.client_processes import Share
from benchclient.conversations import Conversation, build_conversations, turn_prompt
from benchclient.progress import Progress
from benchclient.run_config import RunConfig
from benchclient.workload import BenchRequest, iter_requests

KEEPALIVE_EXPIRY_S = 2.0


async def send_share(cfg: RunConfig, share: Share, t0: float, bar: Progress) -> list[RequestResult]:
    """Send `share` of cfg's load from t0 (time.perf_counter) and wait for every request it sent: their results."""
    # an idle pooled connection is dropped after KEEPALIVE_EXPIRY_S, before a server with a 5 s keep-alive (pdserve's
    # and vLLM's default) closes it: at equal timeouts a request sent as the server closes fails with a ReadError
    # (seen once in 852 requests of the multi-turn agents load, whose turns come 10 s apart)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=KEEPALIVE_EXPIRY_S)
    timeout = httpx.Timeout(cfg.timeout_s, connect=min(30.0, cfg.timeout_s))
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        send = Sender(client, cfg, bar, t0, share)
        if cfg.workload.kind == "multiturn":
            await send.conversations()
        elif cfg.arrival.open_loop:
            await send.open_loop()
        else:
            await asyncio.gather(*[send.closed_loop_worker() for _ in range(share.of(cfg.arrival.concurrency))])
        bar.draining = True
        return list(await asyncio.gather(*send.tasks))


class Sender:
    """Sends one share of a load (all of it with Share()): every share.count-th request from share.index on."""

    def __init__(self, client: httpx.AsyncClient, cfg: RunConfig, bar: Progress, t0: float, share: Share) -> None:
        self.client, self.cfg, self.bar, self.t0, self.share = client, cfg, bar, t0, share
        self.requests = itertools.islice(iter_requests(cfg.workload), share.index, None, share.count)
        self.tasks: list[asyncio.Task] = []
        self.measured_sent = 0

    def _more(self, now: float) -> bool:
        if self.cfg.num_requests is not None:
            return self.measured_sent < self.share.of(self.cfg.num_requests)
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
        every = build_conversations(cfg.workload)
        pending = [conv for i, conv in enumerate(every) if self.share.mine(i)]
        if cfg.arrival.open_loop:
            runs = []
            times = send_times(cfg.arrival, math.inf, limit=len(every))
            for offset, conv in zip([t for i, t in enumerate(times) if self.share.mine(i)], pending, strict=False):
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
        await asyncio.gather(*[lane() for _ in range(self.share.of(cfg.arrival.concurrency))])

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
        for i, (offset, req) in enumerate(zip(times, iter_requests(cfg.workload), strict=False)):
            if not self.share.mine(i):
                continue
            delay = self.t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            self._start(req, self.t0 + offset)  # warm-up or not by schedule, not by a late wake-up

    async def closed_loop_worker(self) -> None:
        while self._more(time.perf_counter()):
            await self._start(next(self.requests), time.perf_counter())
