"""Handoffs: the decode side of a KV handoff, from the request's booked blocks to the request started.

Owns the requests whose KV is in flight (`transferring`: request id -> aborted meanwhile), their pulls and their
joins; the engine owns the blocks (decode_pool.reservations booked them). Every rank pulls its KV heads into the
booked blocks after the booking's fence (WorkerAgents.read). At TP=1 over cuda_ipc the copies run on this worker's
GPU, so the request joins the batch as soon as they are queued, with the engine's stream ordered after them
(LLMEngine.order_after): its first step runs on the device right behind the copies, no host round trip between.
Otherwise it starts once the pull has landed. Either way `take_over` returns only once the KV has landed (the
prefill worker then frees its copy). An abort while the KV is in flight is applied when the transfer has ended;
anything that frees the blocks of a request joined early waits for its copies on the device.
A pushed handoff (`pushed`: the prefill worker wrote the KV into the booked blocks already, prefill_pool.kv_push)
skips the pull: the request only joins. Blocks this worker's prefix cache held at the booking (Booking.skip: the
leading ones, shared) are neither pulled nor pushed: the request's table is those, then the ones moved.
With PDSERVE_TRACE_HANDOFF=1 in the environment every take_over prints its stages (blocks booked, pull launched,
the join's engine call taken by the engine thread, the request added, joined as the event loop sees it, KV seen
landed, the request's first step scheduled: ms since the call) as one JSON line on stderr, for
benchmarks/handoff_serving.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.async_engine import AsyncEngine, exit_process
from engine.core.request import TokenLogprob
from engine.core.request_timing import RequestTiming
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import StepOutput
from engine.runner.rank_service import RankCallError
from kvtransfer.errors import TransferTimeout

if TYPE_CHECKING:
    from decode_pool.reservations import Booking, Reservations
    from engine.llm_engine import LLMEngine
    from kvtransfer.worker_agents import GroupRead, WorkerAgents


class Handoffs:
    def __init__(self, worker: str, loop: AsyncEngine, agents: WorkerAgents | None, reservations: Reservations,
                 timing: RequestTiming) -> None:
        self.worker, self.loop, self.agents, self.reservations, self.timing = worker, loop, agents, reservations, timing
        self.transferring: dict[str, bool] = {}  # request id -> aborted while its KV was in flight
        self._trace = os.environ.get("PDSERVE_TRACE_HANDOFF") == "1"
        self._expected: dict[str, tuple[list[int], SamplingParams, list[int], int]] = {}  # pushes announced
        self._joins: dict[str, asyncio.Task] = {}  # joins started by the prefill worker's notification

    def expect_push(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prior: list[int], priority: int = 0) -> None:
        """A prefill worker will push this request's KV into its booking: its notification may start the join."""
        self._expected[request_id] = (prompt_token_ids, params, prior, priority)

    def pushed(self, request_id: str, first_token_id: int, first_logprob: TokenLogprob | None,
               heard_at: float) -> None:
        """The prefill worker's notification: the request's KV has landed in its booking and this is its first
        token. Start the join now, without waiting for the coordinator's decode() call (two Ray calls later),
        which then takes its outcome."""
        expected = self._expected.pop(request_id, None)
        if expected is None or request_id in self._joins:
            return  # ended (aborted), or decode() came first
        prompt, params, prior, priority = expected
        task = asyncio.ensure_future(self._take_over(request_id, prompt, params, first_token_id, first_logprob, "",
                                                     [], prior, pushed=True, heard_at=heard_at, priority=priority))

        def ended(t: asyncio.Task) -> None:  # a failed join (aborted meanwhile) is not kept for a decode() to come
            if t.cancelled() or t.exception() is not None:
                self._joins.pop(request_id, None)
        task.add_done_callback(ended)
        self._joins[request_id] = task

    def forget(self, request_id: str) -> None:
        """The request ended here (abort): no notification starts it any more. A join under way ends through the
        abort's flag (`abort`), and is dropped once it has."""
        self._expected.pop(request_id, None)
        task = self._joins.get(request_id)
        if task is not None and task.done():
            del self._joins[request_id]

    async def take_over(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                        first_token_id: int, first_logprob: TokenLogprob | None, peer: str,
                        peer_block_ids: list[int], prior: list[int], pushed: bool = False,
                        priority: int = 0) -> StepOutput | None:
        """Pull the request's KV (prompt, then prior outputs) from `peer`'s blocks into its booked blocks and start
        it from its first token; its StepOutput if that token already ends it. Raises if the pull failed or the
        request was aborted meanwhile (asyncio.CancelledError); either way its blocks are given back. `pushed`: the
        KV is in the booked blocks already (written by the prefill worker): no pull, the request only joins (or
        has joined already, started by the prefill worker's notification: then this returns that join's outcome).
        `priority`: its order in the engine's queue and as a preemption victim (engine.core.waiting)."""
        self._expected.pop(request_id, None)
        started = self._joins.pop(request_id, None)
        if started is not None:
            return await asyncio.shield(started)
        return await self._take_over(request_id, prompt_token_ids, params, first_token_id, first_logprob, peer,
                                     peer_block_ids, prior, pushed, priority=priority)

    async def _take_over(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                         first_token_id: int, first_logprob: TokenLogprob | None, peer: str,
                         peer_block_ids: list[int], prior: list[int], pushed: bool,
                         heard_at: float | None = None, priority: int = 0) -> StepOutput | None:
        """take_over's work; `heard_at`: when the notification that started it reached this worker (None: its
        decode() call started it)."""
        self.timing.received(request_id)
        stages = [("received", time.monotonic())] if self._trace else None
        self.transferring[request_id] = False  # from here an abort is applied when the transfer has ended
        pull: GroupRead | None = None
        landing: tuple = ()  # the pull's copy events, once the request has joined before they ended
        done = None
        try:
            booking = await self.reservations.take(request_id, [*prompt_token_ids, *prior])
            _stage(stages, "booked")
            n = len(booking.blocks)
            if len(peer_block_ids) < n and not pushed:
                raise ValueError(f"request {request_id!r}: the peer sent {len(peer_block_ids)} blocks, but "
                                 f"{len(prompt_token_ids) + len(prior)} tokens of KV take {n}")
            if not pushed:
                pull = self._pull(peer, peer_block_ids[:n], booking)
                _stage(stages, "launched")
                if pull.gpu_done is not None:
                    landing = pull.gpu_done  # from here every abort waits (on the device) for the copies
                    self.timing.kv_ready(request_id)  # provisional (the copies are queued); moved to their end below
                    done = await self.loop.call(self._starter(request_id, prompt_token_ids, first_token_id, params,
                                                              first_logprob, prior, landing, stages, priority))
                    _stage(stages, "joined")
                await self._landed(pull)
            self.timing.kv_ready(request_id)
            _stage(stages, "landed")
        except BaseException:
            self.transferring.pop(request_id, None)
            self.timing.drop(request_id)
            await _queued(self.loop.submit(lambda e: _abort_after(e, request_id, landing)))
            if landing:  # the peer frees its copy once this call ends: not while ours still reads it
                await self._settle(pull)
            raise
        if self.transferring.pop(request_id):
            self.timing.drop(request_id)
            await _queued(self.loop.submit(lambda e: _abort_after(e, request_id, landing)))
            raise asyncio.CancelledError(f"request {request_id} aborted during its KV transfer")
        if pull is None or pull.gpu_done is None:  # not joined yet: it starts now
            done = await self.loop.call(self._starter(request_id, prompt_token_ids, first_token_id, params,
                                                      first_logprob, prior, (), stages, priority))
            _stage(stages, "joined")
        if stages is not None:  # once its first step is scheduled (the engine thread answers the join's call first)
            asyncio.get_running_loop().call_later(TRACE_DELAY_S, _print_stages, request_id, pushed, heard_at, stages)
        return done

    async def pull_into(self, peer: str, remote_ids: list[int], booking: Booking) -> None:
        """Pull blocks of `peer` into `booking`'s and wait until they have landed (a group's prompt: decode_group)."""
        await self._landed(self._pull(peer, remote_ids, booking))

    def abort(self, request_id: str) -> bool:
        """Flag a request whose KV is in flight (its take_over frees the blocks once the transfer has ended);
        False if it has none in flight."""
        if request_id not in self.transferring:
            return False
        self.transferring[request_id] = True
        return True

    # ---- internals
    def _starter(self, request_id: str, prompt_token_ids: list[int], first_token_id: int, params: SamplingParams,
                 first_logprob: TokenLogprob | None, prior: list[int], landing: tuple,
                 stages: list | None = None, priority: int = 0) -> Callable[[LLMEngine], StepOutput | None]:
        """The engine call that starts a handed-over request; with `landing`, its KV copies may still be running:
        everything launched after it waits for them. With `stages` (tracing), it stamps when the engine thread took
        the call and when the request was added."""
        def start(e: LLMEngine) -> StepOutput | None:
            _stage(stages, "call_taken")
            e.order_after(landing)
            try:
                done = e.add_prefilled_request(request_id, prompt_token_ids, first_token_id, params, first_logprob,
                                               prior_output_ids=prior, priority=priority)
            except Exception:
                self.timing.drop(request_id)
                e.abort(request_id)  # a refused request gives its reservation back
                raise
            self.timing.attach(request_id, e.scheduler.requests.get(request_id))
            _stage(stages, "added")
            if stages is not None and request_id in e.scheduler.requests:
                stages.append(("request", e.scheduler.requests[request_id]))  # its first step's stamp, read later
            return done
        return start

    def _pull(self, peer: str, remote_ids: list[int], booking: Booking) -> GroupRead:
        """Every rank pulls its KV heads into the booked blocks (`remote_ids`: the peer's, in the same order),
        those this worker's prefix cache held (Booking.skip) left out, after the booking's fence: rank 0 after its
        event, each follower once it has launched as much of rank 0's work as rank 0 had sent at the booking. A
        rank that cannot even answer (its process died) means this worker's TP group is broken for good: the
        process exits, so the request moves and the worker is replaced, instead of failing this request and
        waiting for the next step to notice."""
        try:
            fence = booking.fence
            k = booking.skip
            return self.agents.read(peer, remote_ids[k:], booking.blocks[k:], ready=fence.event,
                                    after_launches=fence.follower_launches)
        except RankCallError as e:
            exit_process(self.worker, str(e))
            raise

    async def _landed(self, pull: GroupRead) -> None:
        try:
            await pull.landed()
        except RankCallError as e:  # as in _pull
            exit_process(self.worker, str(e))

    async def _settle(self, pull: GroupRead) -> None:
        """After a joined request failed: wait on the host until its copies have ended, so the peer does not reuse
        the blocks they read. Copies still running at the pull's deadline have wedged this GPU's stream (every
        launch since the join waits for them): the process exits, and the pool replaces it."""
        from kvtransfer.cache import event_done  # torch: this module is imported by the torch-free coordinator

        try:
            for event in pull.gpu_done or ():
                await asyncio.shield(event_done(event, pull.deadline, spin_s=0.0))
        except TransferTimeout:
            exit_process(self.worker, "a KV pull's copies did not end by their deadline; this GPU's stream waits "
                                      "for them")


def _abort_after(e: LLMEngine, request_id: str, landing: tuple) -> bool:
    """Abort a request whose KV copies may still be running: its blocks are reused only after them."""
    e.order_after(landing)
    return e.abort(request_id)


async def _queued(call: asyncio.Future) -> None:
    """Await an engine call queued already (AsyncEngine.submit), shielded: AsyncEngine skips a call whose future was
    cancelled, and a cancellation of this task while it waits must not skip a release."""
    await asyncio.shield(call)


TRACE_DELAY_S = 0.05  # PDSERVE_TRACE_HANDOFF: a handoff's line is printed this long after its join


def _print_stages(request_id: str, pushed: bool, heard_at: float | None, stages: list) -> None:
    """One JSON line: ms since the take-over began (decode(), or the prefill worker's notification) to each stage, and
    to the request's first scheduled step."""
    t0 = stages[0][1]
    times = [(k, t) for k, t in stages[1:] if k != "request"]
    first = [r.first_scheduled_at for k, r in stages if k == "request" and r.first_scheduled_at]
    times += [("first_step", t) for t in first]
    absolute = {"first_step_at": first[0]} if first else {}  # time.monotonic(), for the prefill worker's stamps
    if heard_at is not None:  # when the agent's thread heard the notification
        absolute["heard_at"] = heard_at
    print(json.dumps({"handoff_trace": request_id, "pushed": pushed, "notified": heard_at is not None}
                     | {k: round((t - t0) * 1e3, 3) for k, t in times}
                     | absolute), file=sys.stderr, flush=True)


def _stage(stages: list | None, name: str) -> None:
    if stages is not None:
        stages.append((name, time.monotonic()))
