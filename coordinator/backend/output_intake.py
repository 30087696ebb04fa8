"""OutputIntake: where the workers' token outputs meet the attempts that wait for them.

Owns, per attempt id: its queue of step outputs (what RayBackend's attempt reads; a request with a stream interval
gets a HeldQueue), the direct sink of a running stream whose middle tokens may skip the queue, and the decode
worker's phase durations until the attempt takes them. Owns the loop that takes each worker's outputs: its output
stream (decode_pool.worker_stream) where it has one, else the long-poll. A worker whose stream or poll fails is
reported to the Supervisor as dead; what its attempts then do is the backend's (they get WorkerLost there).

Order is kept per attempt: an output that cannot go straight to a sink waits in the queue, and nothing skips a
queue that holds anything.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import Callable, Coroutine
from contextlib import aclosing
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from coordinator.admission.router import WorkerState
from coordinator.backend.held_queue import HeldQueue
from coordinator.backend.supervisor import Supervisor
from coordinator.contract import BackendError, TokenDelta
from coordinator.observability.phases import PhaseTrace
from decode_pool.step_delta import StepDelta
from decode_pool.worker_stream import StreamLink
from engine.core.request_timing import Durations
from engine.load import EngineLoad

log = logging.getLogger("pdserve")
POLL_TIMEOUT_S = 0.5


class OutputIntake:
    def __init__(self, supervisor: Supervisor, on_worker_error: Callable[[], None]) -> None:
        self.supervisor = supervisor
        self._on_worker_error = on_worker_error  # a command a worker refused: counted by the backend
        self.queues: dict[str, asyncio.Queue] = {}  # attempt id -> its step outputs (or the error that ended it)
        self._direct: dict[str, Callable[[list[int]], None]] = {}  # attempt id -> its running stream's sink
        self._phases: dict[str, Durations] = {}  # attempt id -> the decode worker's durations, until taken
        # told of every live attempt's new tokens (attempt id, count): growing bookings (coordinator.admission.growth)
        self.on_tokens: Callable[[str, int], None] | None = None

    # ---- an attempt's side
    def open(self, attempt: str, stream_interval: int) -> asyncio.Queue:
        queue = HeldQueue(stream_interval) if stream_interval > 1 else asyncio.Queue()
        self.queues[attempt] = queue
        return queue

    def close(self, attempt: str) -> None:
        """The attempt ended: whatever still comes for it is dropped (its workers were told to end it)."""
        self.queues.pop(attempt, None)
        self._direct.pop(attempt, None)
        self._phases.pop(attempt, None)

    def fail(self, attempt: str, error: BaseException) -> None:
        """End the attempt's stream with `error` (after the outputs queued before it)."""
        queue = self.queues.get(attempt)
        if queue is not None:
            queue.put_nowait(error)

    def fail_all(self, error: BaseException) -> None:
        for queue in self.queues.values():
            queue.put_nowait(error)

    def take_phases(self, attempt: str) -> Durations:
        """The decode worker's durations up to the attempt's first output (empty if it sent none)."""
        return self._phases.pop(attempt, ())

    def go_direct(self, attempt: str, trace: PhaseTrace, streamed: list[int],
                  sink: Callable[[list[int]], None]) -> None:
        """From now on the attempt's plain middle tokens may go straight to `sink` when its queue is empty: what
        the attempt does for a delta it yields (the decode mark, the record of what was streamed, where a moved
        request resumes), then the sink."""
        def deliver(token_ids: list[int]) -> None:
            trace.mark("decode")
            sink(token_ids)
            streamed.extend(token_ids)  # after: a sink that raised has not streamed them (they go the reader's way)
        self._direct[attempt] = deliver

    # ---- a worker's side
    def loop(self, worker: WorkerState) -> Coroutine[Any, Any, None]:
        """What takes a worker's outputs until it dies: its output stream where it has one, else the long-poll."""
        return self._poll_loop(worker) if worker.info.outputs_at is None else self._stream_loop(worker)

    async def _poll_loop(self, worker: WorkerState) -> None:
        while worker.alive:
            try:
                outputs, load, phases = await worker.handle.poll.remote(POLL_TIMEOUT_S)
            except (RayActorError, RayTaskError) as e:
                self.supervisor.worker_died(worker, f"poll failed: {type(e).__name__}: {e}")
                return
            self.take(worker, outputs, load, phases)

    async def _stream_loop(self, worker: WorkerState) -> None:
        """A worker's outputs from its stream until it ends: the worker died. While it runs, the worker's `link`
        takes commands."""
        link = worker.link = StreamLink(*worker.info.outputs_at)
        try:
            async with aclosing(link.batches()) as batches:
                async for outputs, load, phases, failed in batches:
                    if not worker.alive:
                        return
                    self.take(worker, outputs, load, phases)
                    for attempt, error in failed.items():  # a command refused (e.g. add_request's ValueError)
                        self._on_worker_error()
                        self.fail(attempt, BackendError(f"worker {worker.name} failed: {error}"))
            why = "its output stream ended"
        except (OSError, ValueError, EOFError, pickle.UnpicklingError) as e:
            why = f"its output stream failed: {type(e).__name__}: {e}"
        finally:
            if worker.link is link:
                worker.link = None
        if worker.alive:
            self.supervisor.worker_died(worker, why)

    def take(self, worker: WorkerState, outputs: list[tuple], load: EngineLoad | None,
             phases: dict[str, Durations]) -> None:
        """One batch of a worker's deltas (poll() or its stream) to their attempts; `load`: the worker's after
        them."""
        if load is not None:
            worker.report(load)
        for attempt, durations in phases.items():  # before its output: the attempt takes them with it
            if attempt in self.queues:
                self._phases[attempt] = durations
        for fields in outputs:
            queue = self.queues.get(fields[0])
            if queue is None:  # the attempt ended already; the worker was told to abort it
                continue
            if self.on_tokens is not None:
                self.on_tokens(fields[0], len(fields[1]))
            direct = self._direct.get(fields[0])
            # plain tokens in the middle of a stream whose reader has nothing pending: straight to its sink
            # (order kept: an undelivered delta stays in the queue until its reader has sent it on)
            if (direct is not None and queue.empty() and fields[3] is None and not fields[2] and fields[4] is None
                    and fields[5] is None):
                try:
                    direct(fields[1])
                    continue
                except Exception:  # never the loop's end: this stream goes back to its reader's path
                    log.exception("request %s: its stream's sink failed", fields[0])
                    self._direct.pop(fields[0], None)
            queue.put_nowait(StepDelta(*fields))


def coalesced(first: Any, queue: asyncio.Queue) -> tuple[TokenDelta | None, BaseException | None]:
    """`first` and every step output already queued behind it, as one delta (a consumer that fell behind, e.g. a
    coordinator busy with many streams, then pays its per-chunk costs once per batch, not once per token), and the
    error that ended the run, if any (raised after the tokens before it are delivered)."""
    if isinstance(first, BaseException):
        return None, first
    tokens, logprobs, finish = list(first.new_token_ids), list(first.new_logprobs), first.finish_reason
    cached = first.num_cached_tokens
    while finish is None and not queue.empty():
        out = queue.get_nowait()
        if isinstance(out, BaseException):
            return TokenDelta(tokens, logprobs, None, cached_tokens=cached), out
        tokens += out.new_token_ids
        logprobs += out.new_logprobs
        finish = out.finish_reason
        cached = out.num_cached_tokens if cached is None else cached
    return TokenDelta(tokens, logprobs, finish, cached_tokens=cached), None
