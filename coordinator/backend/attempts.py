"""Attempts: the part of RayBackend (coordinator.backend.ray_backend) that runs one attempt of a request, i.e. one
placement of it: Admission places it (booking its capacity in the request's Reservation), then either the whole
request starts on the decode worker (by a command on its stream, else a Ray call) or the prompt is prefilled on a
prefill worker (coordinator.backend.remote_prefill: `_prefill`, whose first token streams at once), and the decode
worker's tokens come out of the attempt's queue (coordinator.backend.output_intake) until the request ends. Its
`finally` ends the attempt on every worker it touched, whatever the exit. Also here: `_call`, a Ray call to a
worker with its failures turned into the contract's errors (WorkerLost, TransferFailed, BackendError), which the
remote prefill and n-choice groups (coordinator.backend.ray_group) use too, and what an attempt reports as it goes
(its first token to adaptive placement, a handoff to the straggler watch and adaptive placement).

It holds no state of its own: the backend's admission, intake, pools, supervisor, growth, adaptive layout,
straggler watch and counters are what it works on. RayBackend inherits it; `generate` runs `_attempt` once per
move of the request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from coordinator.admission.admission import Placement
from coordinator.admission.reservation import Reservation
from coordinator.admission.router import WorkerState
from coordinator.backend.output_intake import coalesced
from coordinator.backend.ray_calls import in_order, quietly
from coordinator.contract import BackendError, GenerateRequest, TokenDelta, TransferFailed, WorkerLost
from coordinator.observability.phases import PhaseTrace
from engine.core.request_timing import Durations
from kvtransfer.errors import TransferError


class Attempts:
    def _first_token(self, placement: Placement, placed_at: float) -> None:
        """Adaptive placement learns how far its estimate was from this first token (admission.calibration)."""
        if self.adaptive is not None and placement.choice is not None:
            self.adaptive.first_token(placement.choice, time.monotonic() - placed_at)

    def _handed_over(self, decode: WorkerState, tokens: int, durations: Durations, attempt: str) -> None:
        """A remote prefill's KV reached `decode`: the straggler watch compares its handoffs with its peers', and
        adaptive placement learns the handoff's seconds per token (the push's wait on the prefill side included)."""
        if self.config.stragglers.enabled:  # (its observe() keeps the window: only while it runs)
            own = sum(s for p, s in durations if p in ("kv_transfer", "decode_join"))
            self.stragglers.handoff(decode, tokens, own, time.monotonic())
        if self.adaptive is not None:
            self.adaptive.handed_over(tokens, sum(
                s for p, s in (*durations, *self._push_waits.pop(attempt, ())) if p == "kv_transfer"))

    async def _attempt(self, rid: str, move: int, request: GenerateRequest, prior: list[int],
                       reservation: Reservation, trace: PhaseTrace, whole: bool = False) -> AsyncIterator[TokenDelta]:
        """One placement of the request (`whole`: on one decode worker, prompt included): deltas until its end;
        WorkerLost if a worker under it died, PrefillFailed if its prefill worker's prefill failed. `prior`: the
        tokens streamed so far, which generate() extends. With request.sink, once its first decode token is out,
        the intake hands the middle of the stream to the sink (OutputIntake.go_direct)."""
        record = self.inflight.get(rid)
        if record is not None:
            record.state = "queued"
        placement = await self.admission.place(request, len(prior), reservation, migrating=move > 0,
                                               run_whole=whole)
        trace.mark("admission")
        placed_at = time.monotonic()
        trace.attributes = _span_attributes(placement)  # the latest placement's, for the request's trace
        if record is not None:
            record.placed(placement.prefill, placement.decode)
        attempt = rid if move == 0 else f"{rid}~{move}"
        queue = self.intake.open(attempt, request.stream_interval)
        cleanup: list[tuple[WorkerState, str]] = []  # (worker, how to end the attempt there)
        finished = joined = False  # joined: a token came from the decode stream
        decode, streamed, prior = placement.decode, prior, list(prior)
        try:
            if self.growth is not None:
                self.growth.track(attempt, reservation, decode.key, len(request.prompt_token_ids) + len(prior),
                                  request.params.max_tokens - len(prior), placement.kv_blocks)
            if placement.prefill is None and _connected(decode):
                cleanup.append((decode, "abort_on_stream"))  # after the generate, on the same stream
                decode.requests.add(attempt)
                decode.link.send(("generate", attempt, request.prompt_token_ids, request.params, prior,
                                  placement.priority))
            elif placement.prefill is None:
                cleanup.append((decode, "abort"))
                decode.requests.add(attempt)
                await self._call(decode, decode.handle.generate.remote(
                    attempt, request.prompt_token_ids, request.params, prior_output_ids=prior,
                    priority=placement.priority))
            else:
                first = await self._prefill(attempt, request, prior, placement, reservation, cleanup, trace)
                self._first_token(placement, placed_at)
                if record is not None:
                    record.state = "decode"  # its first token is out; the handoff brings the rest
                finished = first.finish_reason is not None
                yield first
                if finished:
                    return
            while True:
                delta, error = coalesced(await queue.get(), queue)
                if delta is not None:
                    if joined:
                        trace.mark("decode")
                    else:  # the worker's durations up to its first token, inside the interval since the last mark
                        if placement.prefill is None:
                            self._first_token(placement, placed_at)
                        if record is not None:
                            record.state = "decode"
                        durations = self.intake.take_phases(attempt)
                        trace.split(durations)
                        if placement.prefill is not None:
                            self._handed_over(decode, len(request.prompt_token_ids) + len(prior), durations, attempt)
                        joined = True
                        reservation.unbook(decode.key, "prompt_tokens")  # collocated: its prefill is done
                        if request.sink is not None and type(queue) is asyncio.Queue:  # not held back in chunks
                            self.intake.go_direct(attempt, trace, streamed, request.sink)
                    finished = delta.finish_reason is not None
                    yield delta
                    if finished:
                        return
                if error is not None:
                    raise error
        finally:
            if finished and self.admission is not None:  # its prefix cache holds prompt and reply: the next turn's
                self.admission.router.remember(request.prompt_token_ids + streamed, decode.name)
            self.intake.close(attempt)
            if self.growth is not None:
                self.growth.drop(attempt)
            self._push_waits.pop(attempt, None)
            ends = []
            for worker, action in cleanup:
                worker.requests.discard(attempt)
                if action == "abort_on_stream":
                    if worker.alive and not finished and _connected(worker):
                        worker.link.send(("abort", attempt))  # (a broken stream: the worker is lost already)
                elif worker.alive and (action == "release" or not finished):
                    ends.append(getattr(worker.handle, action))
            if self.pools.pushes and len(ends) > 1:  # the prefill's abort first: the decode worker's blocks are
                self._spawn(in_order(attempt, ends))  # freed only once no push writes into them
            else:
                for end in ends:
                    self._spawn(quietly(end.remote(attempt)))

    async def _call(self, worker: WorkerState, ref: Any) -> Any:
        try:
            return await ref
        except RayActorError as e:
            self.supervisor.worker_died(worker, str(e))
            raise WorkerLost(f"{worker.info.role} worker {worker.name} died") from None
        except RayTaskError as e:
            if isinstance(e.cause, TransferError):
                raise TransferFailed(f"KV transfer to {worker.name} failed: {type(e.cause).__name__}: "
                                     f"{e.cause}") from None
            self._count(self.errors, "worker_error")
            raise BackendError(f"worker {worker.name} failed: {e.cause!r}") from None


def _connected(worker: WorkerState) -> bool:
    """Whether the worker's stream takes commands now (decode_pool.worker_stream)."""
    return worker.link is not None and worker.link.connected


def _span_attributes(placement: Placement) -> dict[str, str]:
    """Where a placement runs the request, as its OpenTelemetry span says (coordinator.observability.tracing)."""
    out = {"pdserve.decode_worker": placement.decode.name,
           "pdserve.placement": "local" if placement.prefill is None else "remote"}
    if placement.prefill is not None:
        out["pdserve.prefill_worker"] = placement.prefill.name
    return out
