"""Prefills: a worker's prefill duty, prompts run for another worker to decode, their KV kept pinned until it has
been taken.

Owns the prefill calls in flight (`prefill()` awaits its request's first token), the pushes of their KV into the
decode worker's booked blocks (prefill_pool.kv_push, TP=1) and the injected prefill failures; the worker
(pool_worker.worker.Worker) owns the engine, its loop and the agents. Block ownership: after `prefill()` returns, the
request's
blocks are pinned here until `release()` (decode has its KV), `abort()`, or the pin lease expires; never silently
kept. A resumed request (`prior_output_ids`: outputs already delivered before its decode worker died) is prefilled
over prompt + prior outputs, and its first token is output len(prior_output_ids). A group prefill (`fork_params`, n
choices of one prompt: engine.core.choices) also returns the other choices' first tokens (`fork_first`) and stays
pinned whatever they are; requests with params.prompt_logprobs return them too. Every result carries the call's
phase durations here (`phases`: prefill_queue, prefill_compute; see engine.core.request_timing), for the
coordinator's per-request phase tracing.
Pushed handoffs (TP=1): `push_to` names the blocks the decode worker booked for a request whose prompt is under way
here; its KV is then written into them layer group by layer group during the forward. The result, and with it the
first token, comes back as soon as the token is sampled, `pushed` saying that a push is under way; the writes end
in their own task, which tells the decode worker by a kvtransfer notification once they have landed (it joins on
it), and `push_outcome` says how they ended (every block landed: decode only joins; else it pulls). Nothing frees
the request's blocks (release, abort) while a write may still read them.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from engine.async_engine import AsyncEngine
from engine.core.request import PromptLogprob, TokenLogprob
from engine.core.request_timing import Durations, RequestTiming
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import StepOutput
from engine.load import EngineLoad
from kvtransfer.errors import TransferError
from prefill_pool.kv_push import KVPushes, pushed_message

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from kvtransfer.worker_agents import WorkerAgents


class InjectedFault(RuntimeError):
    """A failure injected on purpose (FaultsConfig.prefill_error_fraction)."""


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    first_logprob: TokenLogprob | None
    finish_reason: str | None   # set if the first token already ends the request (then nothing is pinned)
    block_ids: list[int]        # pinned blocks holding the KV of the prompt (then prior outputs), in order
    load: EngineLoad
    fork_first: list[tuple[int, TokenLogprob | None]] | None = None  # a group prefill's choices 1..n-1
    prompt_logprobs: list[PromptLogprob] | None = None  # when params.prompt_logprobs is set
    phases: Durations = ()  # (phase, seconds) measured here: prefill_queue, prefill_compute (, kv_transfer)
    pushed: bool = False  # a push of the KV into the decode worker's booked blocks is under way: ask push_outcome
    num_cached_tokens: int = 0  # prompt (and prior output) tokens whose KV was not computed here (prefix hits)


class Prefills:
    def __init__(self, name: str, agents: WorkerAgents | None, block_size: int, num_layers: int,
                 timeout_s: float, reported: Callable[[EngineLoad], EngineLoad]) -> None:
        self.name = name
        self.agents = agents
        tp1 = agents is not None and agents.tp_size == 1
        self.pushes = KVPushes(agents.local.agent, block_size, num_layers, timeout_s) if tp1 else None
        self.loop: AsyncEngine | None = None  # set by the worker once its loop exists
        self._reported = reported
        self._error_fraction = 0.0               # injected prefill failures (drills and tests; set_faults)
        self._fault_rng = random.Random(0)
        self._waiting: dict[str, asyncio.Future] = {}
        self._timing = RequestTiming()
        self._finishing: dict[str, asyncio.Task] = {}  # pushed prefills whose writes are still landing
        self._outcomes: dict[str, tuple[bool, float]] = {}  # ... and how they ended, until push_outcome takes it
        self._trace = os.environ.get("PDSERVE_TRACE_HANDOFF") == "1"
        self._step_ends: dict[str, float] = {}  # traced requests: when their prefill step ended

    def owns(self, request_id: str) -> bool:
        """Whether `request_id` is a prefill of this duty still in flight here (its abort is this duty's)."""
        return request_id in self._waiting or request_id in self._finishing or request_id in self._outcomes or (
            self.pushes is not None and request_id in self.pushes)

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      prior_output_ids: Sequence[int] = (), priority: int = 0,
                      fork_params: Sequence[SamplingParams] | None = None, push: bool = False) -> PrefillResult:
        """Prefill and sample the first token; its blocks stay pinned for decode. `push`: a target for its KV may
        come (push_to) while it runs."""
        if self._error_fraction and self._fault_rng.random() < self._error_fraction:
            raise InjectedFault(f"prefill of {request_id} failed: an injected fault (faults.prefill_error_fraction)")
        future = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        self._timing.received(request_id)
        prior = list(prior_output_ids)

        def add(e: LLMEngine) -> None:
            e.add_request(request_id, prompt_token_ids, params, prefill_only=True, prior_output_ids=prior,
                          priority=priority, fork_params=fork_params)
            if push and self.pushes is not None:
                self.pushes.expect(e, request_id)
            self._timing.attach(request_id, e.scheduler.requests.get(request_id))
        try:
            await self.loop.call(add)
            return await future
        except BaseException:
            self._waiting.pop(request_id, None)
            self._timing.drop(request_id)
            await self.abort(request_id)
            raise

    def push_to(self, request_id: str, remote: str, remote_block_ids: list[int], skip: int = 0) -> bool:
        """Write `request_id`'s KV into `remote_block_ids` of decode agent `remote` as its prefill runs (from the
        next layer group on: not a step boundary), but for its first `skip` blocks (the decode worker's prefix
        cache holds them); False if it expects no push. Too late for its last layer, it is pulled: the prefill's
        result says which (`pushed`)."""
        return self.pushes is not None and self.pushes.target(request_id, remote, remote_block_ids, skip)

    async def push_outcome(self, request_id: str) -> tuple[bool, float]:
        """How a pushed request's writes ended, once they have: (every block landed in the decode worker's booking,
        seconds they took after the first token). (False, 0.0) for a request with no push."""
        task = self._finishing.get(request_id)
        if task is not None:
            await asyncio.shield(task)
        return self._outcomes.pop(request_id, (False, 0.0))

    async def release(self, request_id: str) -> bool:
        """Decode has the KV: free the pinned blocks (once no write of a push reads them)."""
        await self._settled(request_id)
        self._outcomes.pop(request_id, None)
        return await self.loop.call(lambda e: e.release(request_id))

    async def abort(self, request_id: str) -> bool:
        future = self._waiting.pop(request_id, None)
        self._timing.drop(request_id)
        if future is not None and not future.done():
            future.set_exception(asyncio.CancelledError(f"request {request_id} aborted"))
        await self._settled(request_id)
        self._outcomes.pop(request_id, None)
        return await self.loop.call(lambda e: e.abort(request_id))

    def set_faults(self, prefill_error_fraction: float, seed: int) -> None:
        self._error_fraction = prefill_error_fraction
        self._fault_rng = random.Random(seed)

    def counters(self) -> dict[str, Any]:
        return self.pushes.counters() if self.pushes is not None else {}

    def on_outputs(self, outputs: list[StepOutput], load: EngineLoad) -> None:
        """The outputs of this duty's prefills (event loop): each resolves its prefill() with its first token."""
        load = self._reported(load)  # taken on the engine thread right after the step
        for out in outputs:
            future = self._waiting.pop(out.request_id, None)
            if future is None or future.done():
                continue  # an expired pin, or an aborted request
            if not out.new_token_ids:  # ended before its first token: a held structured request whose grammar
                future.set_exception(ValueError(  # could not be made (LLMEngine._admit_held), as add_request raises
                    f"request {out.request_id!r}: its structured output could not start ({out.finish_reason})"))
                continue
            result = PrefillResult(out.new_token_ids[0], out.new_logprobs[0] if out.new_logprobs else None,
                                   out.finish_reason, out.pinned_block_ids or [], load, out.fork_first,
                                   out.prompt_logprobs, self._timing.first_output(out.request_id) or (),
                                   num_cached_tokens=out.num_cached_tokens or 0)
            if self._trace:
                self._step_ends[out.request_id] = self.loop.outputs_at
            if self.pushes is not None and out.request_id in self.pushes:
                # the first token goes now; the writes end in their own task (the decode worker joins on the
                # notification sent after them, or pulls if they failed: push_outcome)
                task = asyncio.ensure_future(self._after_push(out.request_id, result))
                self._finishing[out.request_id] = task
                task.add_done_callback(lambda _, rid=out.request_id: self._finishing.pop(rid, None))
                result = replace(result, pushed=result.finish_reason is None)
            else:
                if self.pushes is not None:
                    self.pushes.forget(out.request_id)
                self._print_trace(out.request_id, False)
            future.set_result(result)

    # ---- internals
    async def _settled(self, request_id: str) -> None:
        """Wait until no write of the request's push reads its blocks (stopping those not yet queued)."""
        if self.pushes is not None:
            await self.pushes.settle(self.loop.call, request_id)
        task = self._finishing.get(request_id)
        if task is not None:
            await asyncio.gather(asyncio.shield(task), return_exceptions=True)

    async def _after_push(self, request_id: str, result: PrefillResult) -> None:
        """A pushed request's writes after its first token went out: wait for them, tell the decode worker if the
        step's end did not already (KVPushes.sampled), and keep the outcome for push_outcome. An abort meanwhile
        waits for the same writes (KVPushes.settle) before it frees the blocks."""
        pushed, waited, remote = await self.pushes.finish(request_id)
        if pushed and remote is not None and result.finish_reason is None:
            self._notify_pushed(remote, request_id, result)  # the decode worker joins on it, ahead of decode()
        self._print_trace(request_id, pushed)
        self._outcomes[request_id] = (pushed, waited)

    def _notify_pushed(self, remote: str, request_id: str, result: PrefillResult) -> None:
        """Tell decode agent `remote` that `request_id`'s KV has landed, with its first token (a message after the
        writes: decode_pool.handoff starts the join on it). Lost, it costs only time: decode() starts it then."""
        msg = pushed_message(request_id, result.first_token_id, result.first_logprob)
        try:
            self.agents.local.agent.notify(remote, msg)
        except TransferError:  # the peer is gone: decode() fails over as for any handoff
            pass

    def _print_trace(self, request_id: str, pushed: bool) -> None:
        """With PDSERVE_TRACE_HANDOFF=1: one JSON line on stderr with the request's prefill step end and its result's
        hand-back (time.monotonic(), comparable with the decode worker's stamps on the same host), for
        benchmarks/handoff_serving.py."""
        step_end = self._step_ends.pop(request_id, None)
        if step_end is not None:
            print(json.dumps({"prefill_trace": request_id, "pushed": pushed, "step_end": step_end,
                              "result_at": time.monotonic()}), file=sys.stderr, flush=True)
