"""Decodes: a worker's decode duty, requests it generates: handed over from a prefill elsewhere (their KV pulled or
pushed here), or run here whole (prefilled locally: collocated mode, a local placement, a recompute).

Owns the handoffs in flight (decode_pool.handoff: the pull and the join of a request prefilled elsewhere), the
early bookings (decode_pool.reservations) and the requests' timing here; how their tokens leave is
decode_pool.decode_outputs' (a mixin); the worker (pool_worker.worker.Worker) owns the engine, its loop, the agents
and the stream. Tokens leave in batches, one per step, never one call per token: with a stream (as the coordinator
starts its workers) the engine thread writes each step's deltas to the coordinator's stream (decode_pool.worker_stream,
`stream_step`); without one they wait in an outbox that poll() drains. The same stream brings the coordinator's
commands ("generate" and "abort" for requests run here whole: `command`), which reach the engine's queue straight
from the stream's reading thread; a command that fails comes back on the stream under its request id, as a Ray
call's error would.
Block ownership: reserve (booked early, while the prompt is prefilled elsewhere) -> (transfer in flight: nobody
else may touch them) -> running request -> freed on finish or abort; an abort during a transfer is applied once the
transfer has ended.
Every entry point takes `prior_output_ids` for a request resumed after its worker died: the outputs it already
delivered, whose KV comes (transferred or recomputed) with the prompt's; only new tokens come out.
Groups (n choices of one prompt, engine.core.choices): `decode_group` pulls the prompt's KV ONCE into a reservation
under the group id (or takes the group prefilled and pinned here by `prefill_group`), forks it copy-on-write into
one reservation per choice (LLMEngine.fork_reservation), drops the group's own blocks and starts every choice from
its first token; each choice is then an ordinary request under its own id (abort one, the others go on).
Pushed handoffs (prefill_pool.kv_push): `reserve_for_push` books the blocks and learns the request; the prefill
worker's notification that the KV has landed starts the join at once (decode_pool.handoff), and `decode(...,
pushed=True)` returns that join's outcome.
Requests started here are timed (engine.core.request_timing): beside a request's first output go its phase
durations on this worker, for the coordinator's per-request phase tracing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import pickle
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from decode_pool.decode_outputs import DecodeOutputs
from decode_pool.handoff import Handoffs
from decode_pool.reservations import RESERVE_RETRY_S, NoCapacity, RequestEnded, Reservations
from decode_pool.worker_stream import WorkerStream
from engine.async_engine import AsyncEngine
from engine.core.request import TokenLogprob
from engine.core.request_timing import Durations, RequestTiming
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import StepOutput
from engine.load import EngineLoad

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from kvtransfer.worker_agents import WorkerAgents

log = logging.getLogger(__name__)


class Decodes(DecodeOutputs):
    def __init__(self, name: str, loop: AsyncEngine, agents: WorkerAgents | None, stream: WorkerStream | None,
                 admission_timeout_s: float, load: Callable[[], asyncio.Future],
                 reported: Callable[[EngineLoad], EngineLoad]) -> None:
        self.name = name
        self.loop = loop
        self.agents = agents
        self.stream = stream
        self._load = load            # the worker's load now (an engine call)
        self._reported = reported    # the engine's load with the process's figures
        self._admission_timeout_s = admission_timeout_s
        self._event_loop = asyncio.get_running_loop()
        self._stream_sent_at = 0.0
        self._outbox: list[StepOutput] = []
        self._outbox_ready = asyncio.Event()
        self._timing = RequestTiming()
        self._phases: dict[str, Durations] = {}  # request id -> its durations here, sent with its first output
        self.step_load: EngineLoad | None = None  # the load right after the last step that had outputs
        self._group_prefills: dict[str, asyncio.Future] = {}  # local group prefills awaiting their first tokens
        self.reservations = Reservations(loop, name, admission_timeout_s)
        self.handoffs = Handoffs(name, loop, agents, self.reservations, self._timing)
        if agents is not None:  # prefill workers' notifications (pushed KV landed), onto this event loop
            agents.local.agent.on_notification(
                lambda sender, msg: self._event_loop.call_soon_threadsafe(self._notified, msg, time.monotonic()))

    # ---- requests handed over from a prefill elsewhere
    def reserve(self, request_id: str, token_ids: list[int]) -> None:
        """Book the blocks of a request's KV (of `token_ids`: its prompt, then prior outputs) while its prompt is
        still prefilled elsewhere (decode_pool.reservations: those this worker's prefix cache holds are shared, and
        the pull skips them); its decode() takes them, its abort() gives them back."""
        self.reservations.book_early(request_id, token_ids)

    async def reserve_for_push(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                               prior_output_ids: Sequence[int] = (), priority: int = 0
                               ) -> tuple[str, list[int], int]:
        """Book the blocks of a request's KV for its prefill worker to write into (prefill_pool.kv_push): (this
        worker's agent, the block ids, how many leading ones this worker's prefix cache holds already: nothing is
        written into those), once nothing launched here before the booking can touch them. The request joins as
        soon as the prefill worker's notification says its KV has landed (decode_pool.handoff). TP=1."""
        if self.agents is None or self.agents.tp_size != 1:
            raise ValueError(f"worker {self.name}: pushed handoffs need a tensor_parallel_size 1 worker")
        prior = list(prior_output_ids)
        self.handoffs.expect_push(request_id, prompt_token_ids, params, prior, priority)
        try:
            booking = await self.reservations.settled(request_id, [*prompt_token_ids, *prior])
        except RequestEnded:  # it came after the request's abort or handoff: nothing is pushed for it
            self.handoffs.forget(request_id)
            raise
        return self.agents.local.agent.name, booking.blocks, booking.skip

    async def decode(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     first_token_id: int, first_logprob: TokenLogprob | None, peer: str, peer_block_ids: list[int],
                     prior_output_ids: Sequence[int] = (), pushed: bool = False, priority: int = 0) -> None:
        """Pull the KV of the prompt (then the prior outputs) from `peer`'s blocks into reserved blocks, then
        decode from the first token (output len(prior_output_ids)); returns once the KV has landed
        (decode_pool.handoff). `pushed`: the prefill worker wrote it into the blocks booked by reserve_for_push
        already, so the request only joins."""
        done = await self.handoffs.take_over(request_id, prompt_token_ids, params, first_token_id, first_logprob,
                                             peer, peer_block_ids, list(prior_output_ids), pushed, priority)
        if done is not None:
            self._push([done])

    # ---- requests run here whole
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prior_output_ids: Sequence[int] = (), priority: int = 0) -> None:
        """Run the request here, its KV computed over prompt + prior outputs; its new tokens leave on the stream
        (or poll()). The stream's "generate" command does the same without a call: `command`. RequestEnded if an
        abort of it overtook this call."""
        if self.reservations.ended(request_id):
            raise RequestEnded(f"request {request_id} was aborted before it arrived")
        prior = list(prior_output_ids)
        self._timing.received(request_id)
        try:
            await self.loop.call(lambda e: self._add(e, request_id, prompt_token_ids, params, prior, priority))
        except BaseException:
            self._timing.drop(request_id)
            raise

    async def prefill_group(self, group_id: str, prompt_token_ids: list[int], params: list[SamplingParams],
                            priority: int = 0) -> StepOutput:
        """Prefill a group here once (choice j samples its first token with params[j]) and keep it pinned for
        decode_group(..., peer=None); returns its StepOutput (first tokens, prompt logprobs). RequestEnded if an
        abort of the group overtook this call (it would be pinned for nobody until its lease)."""
        if self.reservations.ended(group_id):
            raise RequestEnded(f"group {group_id} was aborted before its prefill arrived")
        future = asyncio.get_running_loop().create_future()
        self._group_prefills[group_id] = future
        try:
            await self.loop.call(lambda e: e.add_request(group_id, prompt_token_ids, params[0], prefill_only=True,
                                                         priority=priority, fork_params=params[1:]))
            return await future
        except BaseException:
            self._group_prefills.pop(group_id, None)
            await self.loop.call(lambda e: e.abort(group_id))
            raise

    async def decode_group(self, group_id: str, choice_ids: list[str], prompt_token_ids: list[int],
                           params: list[SamplingParams], firsts: list[tuple[int, TokenLogprob | None]],
                           peer: str | None, peer_block_ids: list[int], priority: int = 0) -> None:
        """Start every choice of a group from its first token: the prompt's KV pulled once from `peer` (or, with
        peer None, the group pinned here), forked per choice. A choice aborted meanwhile is not started."""
        n_tok = len(prompt_token_ids)
        transferring = self.handoffs.transferring
        for cid in choice_ids:
            transferring[cid] = False
        try:
            if peer is not None:
                booking = await self.reservations.book(group_id, prompt_token_ids)
                await self.handoffs.pull_into(peer, peer_block_ids[:len(booking.blocks)], booking)
            deadline = time.monotonic() + self._admission_timeout_s
            for cid in choice_ids:
                while not await self.loop.call(lambda e, c=cid: e.fork_reservation(group_id, c, n_tok)):
                    if time.monotonic() > deadline:
                        raise NoCapacity(f"worker {self.name}: no block to fork choice {cid} into")
                    await asyncio.sleep(RESERVE_RETRY_S)
        except BaseException:
            await self.loop.call(lambda e: [e.abort(i) for i in [group_id, *choice_ids]])
            raise
        finally:  # aborted while the KV moved, or before this call arrived
            aborted = {cid for cid in choice_ids if transferring.pop(cid, False) or self.reservations.ended(cid)}

        def start(e: LLMEngine) -> list[StepOutput]:
            e.abort(group_id)  # its blocks live on in the choices' tables
            done = []
            for cid, p, (token, lp) in zip(choice_ids, params, firsts, strict=True):
                if cid in aborted:
                    e.abort(cid)
                    continue
                try:
                    out = e.add_prefilled_request(cid, prompt_token_ids, token, p, lp, priority=priority)
                except Exception:
                    for c in choice_ids:
                        e.abort(c)
                    raise
                if out is not None:
                    done.append(out)
            return done
        done = await self.loop.call(start)
        if done:
            self._push(done)

    async def abort(self, request_id: str) -> bool:
        self._timing.drop(request_id)
        self.handoffs.forget(request_id)
        if await self.reservations.cancel(request_id):  # booked early, never handed off
            await self.report_load()
            return True
        if self.handoffs.abort(request_id):  # its KV in flight: freed once the transfer has ended
            return True
        freed = await self.loop.call(lambda e: e.abort(request_id))
        if freed:
            await self.report_load()
        return freed

    # ---- the stream's commands
    def command(self, command: tuple) -> None:
        """A command from the coordinator's stream, on the stream's reading thread (in the coordinator's order):
        ("generate", request id, prompt ids, params, prior output ids, priority) queues the request for the engine
        thread at once; ("abort", request id) runs the worker's abort on the event loop, whose engine call queues
        behind any generate read before it. A generate that fails comes back on the stream."""
        kind, request_id = command[0], command[1]
        if kind == "generate":
            self._timing.received(request_id)
            args = command[2:]

            def add(e: LLMEngine) -> None:
                try:
                    self._add(e, request_id, *args)
                except Exception as error:  # noqa: BLE001 - the coordinator fails the request with it
                    self._refuse(request_id, error)
            try:
                self.loop.post(add)
            except RuntimeError as error:  # the engine loop has stopped (this process is exiting)
                self._refuse(request_id, error)
        elif kind == "abort":
            asyncio.run_coroutine_threadsafe(self.abort(request_id), self._event_loop).add_done_callback(
                functools.partial(_log_failed_abort, request_id))
        else:
            raise ValueError(f"unknown command {kind!r}")

    # ---- internals
    def _add(self, e: LLMEngine, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
             prior: list[int], priority: int) -> None:
        """On the engine thread: start a request run here whole, timed from its arrival."""
        e.add_request(request_id, prompt_token_ids, params, prior_output_ids=prior, priority=priority)
        self._timing.attach(request_id, e.scheduler.requests.get(request_id))

    def _refuse(self, request_id: str, error: BaseException) -> None:
        self._timing.drop(request_id)
        self.stream.send(([], self.step_load, {}, {request_id: repr(error)}))

    def _notified(self, msg: bytes, heard_at: float) -> None:
        """A prefill worker's notification (prefill_pool.prefills): ("pushed", request id, first token, logprob);
        `heard_at`: when the agent's thread received it."""
        try:
            kind, request_id, token, logprob = pickle.loads(msg)  # from the cluster's own workers
        except Exception:  # noqa: BLE001 - a malformed message starts nothing; decode() still comes
            return
        if kind == "pushed":
            self.handoffs.pushed(request_id, token, logprob, heard_at)


def _log_failed_abort(request_id: str, done: concurrent.futures.Future) -> None:
    """A streamed abort that raised (e.g. the engine loop has stopped: this process is exiting) is logged, not lost."""
    if not done.cancelled() and done.exception() is not None:
        log.warning("abort of request %s failed: %r", request_id, done.exception())
