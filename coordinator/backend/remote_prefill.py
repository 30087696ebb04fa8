"""RemotePrefill: the part of RayBackend (coordinator.backend.ray_backend) that runs an attempt's prompt on a prefill
worker and hands its KV to the decode worker: the prefill call (the first token streams at once), the decode
worker's booking of the KV's blocks (pushed during the forward: prefill_pool.kv_push, else pulled), the handoff
task, and the recompute of a prompt whose transfer failed (`transfer.on_failure`); a prefix another worker lends
is fetched first (coordinator.backend.prefix_fetch). It holds no state of its own: the attempt's cleanup list and
the backend's intake, pools and counters are what it works on. RayBackend inherits it; `_attempt`
(coordinator.backend.attempts) calls `_prefill`. The decode worker's booking gets the KV's tokens (prompt, then prior
outputs): what its prefix cache holds of them is not moved (decode_pool.reservations).
"""

from __future__ import annotations

import logging
from typing import Any

from coordinator.admission.admission import Placement
from coordinator.admission.reservation import Reservation
from coordinator.admission.router import WorkerState
from coordinator.backend.ray_calls import in_order, quietly
from coordinator.contract import BackendError, GenerateRequest, PrefillFailed, TokenDelta, TransferFailed, WorkerLost
from coordinator.observability.phases import PhaseTrace

log = logging.getLogger("pdserve")


class RemotePrefill:
    async def _prefill(self, attempt: str, request: GenerateRequest, prior: list[int], placement: Placement,
                       reservation: Reservation, cleanup: list, trace: PhaseTrace) -> TokenDelta:
        """Prefill on the prefill worker and return the first new token; unless it ends the request, the handoff
        to the decode worker is under way (in its own task, which owns the prefill side from then on)."""
        prefill, decode = placement.prefill, placement.decode
        cleanup.append((prefill, "abort"))
        # the decode worker books the KV's blocks while the prompt is prefilled, so the handoff starts with the
        # pull (decode_pool.reservations); its abort gives them back if no handoff comes
        cleanup.append((decode, "abort"))
        decode.requests.add(attempt)
        if self.pools.pushes:
            self._spawn(self._push_target(attempt, request, prior, prefill, decode, placement.priority))
        else:
            self._spawn(quietly(decode.handle.reserve.remote(attempt, [*request.prompt_token_ids, *prior])))
        lent = None
        try:  # the prompt's leading blocks fetched from another worker first, where one holds more of them
            lent = await self._lend_prefix(attempt, [*request.prompt_token_ids, *prior], prefill,
                                           placement.prefill_held_tokens)
            result = await self._call(prefill, prefill.handle.prefill.remote(
                attempt, request.prompt_token_ids, request.params, prior_output_ids=prior,
                priority=placement.priority, push=self.pools.pushes, fetch=lent[1] if lent else None))
        except WorkerLost:
            raise
        except BackendError as e:  # an error there, not its death: generate() may run the request whole instead
            raise PrefillFailed(str(e)) from None
        finally:
            self._end_lease(lent)
        trace.split(result.phases)
        reservation.unbook(prefill.key, "prompt_tokens")
        if not result.pushed:  # nothing pinned (it ended), or the handoff releases it; while a push is under way
            cleanup.remove((prefill, "abort"))  # the prefill's abort stays first in line (in_order): it waits out
        prefill.report(result.load)           # the writes before the decode worker frees their blocks
        first = TokenDelta([result.first_token_id], [result.first_logprob] if result.first_logprob else [],
                           result.finish_reason, cached_tokens=result.num_cached_tokens)
        if result.finish_reason is None:
            self._spawn(self._handoff(attempt, request, prior, result, placement, cleanup))
        else:  # the first token ended it: no handoff takes the early booking, freed after any write into it ended
            cleanup.remove((decode, "abort"))
            decode.requests.discard(attempt)
            ends = [w.handle.abort for w in (prefill, decode) if w.alive] if self.pools.pushes else (
                [decode.handle.abort] if decode.alive else [])
            self._spawn(in_order(attempt, ends))
        return first

    @staticmethod
    async def _push_target(attempt: str, request: GenerateRequest, prior: list[int], prefill: WorkerState,
                           decode: WorkerState, priority: int) -> None:
        """Book the KV's blocks on the decode worker and name them to the prefill worker, which then writes the KV
        into them during its forward (prefill_pool.kv_push) and tells the decode worker, which joins the request
        at once (decode_pool.handoff). A failure here leaves the handoff to a pull."""
        try:
            agent, blocks, skip = await decode.handle.reserve_for_push.remote(attempt, request.prompt_token_ids,
                                                                             request.params, prior, priority)
            await prefill.handle.push_to.remote(attempt, agent, blocks, skip)
        except Exception as e:  # noqa: BLE001 - e.g. the request ended first, or no room: decode() says what counts
            log.debug("request %s: no push target: %s", attempt, e)

    async def _handoff(self, attempt: str, request: GenerateRequest, prior: list[int], result: Any,
                       placement: Placement, cleanup: list) -> None:
        """The decode worker takes the KV: joins once a push under way has landed (push_outcome), else pulls it
        (or recomputes it, per transfer.on_failure); then the prefill worker frees its pinned copy: only after the
        pull or the writes ended, so no block is reused while it may still be read. Errors go into the attempt's
        stream."""
        prefill, decode = placement.prefill, placement.decode
        try:
            if attempt not in self.intake.queues:  # the request ended before this task ran: its abort is already sent,
                return                        # and a decode() behind it would run a request nobody reads
            pushed = False
            if result.pushed:  # the first token went out before the writes ended: how did they?
                pushed, waited = await self._call(prefill, prefill.handle.push_outcome.remote(attempt))
                if (prefill, "abort") in cleanup:
                    cleanup.remove((prefill, "abort"))  # no write is in flight now: the decode side may free
                if attempt not in self.intake.queues:
                    return
                if self.adaptive is not None:
                    self._push_waits[attempt] = (("kv_transfer", waited),)
            decode.report(await self._call(decode, decode.handle.decode.remote(
                attempt, request.prompt_token_ids, request.params, result.first_token_id, result.first_logprob,
                prefill.name, result.block_ids, prior_output_ids=prior, pushed=pushed, priority=placement.priority)))
        except TransferFailed as e:
            self._count(self.errors, "transfer_failed")
            if self.config.transfer.on_failure == "fail":
                self.intake.fail(attempt, BackendError(f"{e} (transfer.on_failure: fail)"))
            elif attempt in self.intake.queues:
                log.warning("request %s: %s; the decode worker recomputes its prompt", attempt, e)
                await self._recompute(attempt, request, prior + [result.first_token_id], placement)
        except BackendError as e:
            self.intake.fail(attempt, e)
        finally:
            if prefill.alive:
                self._spawn(quietly(prefill.handle.release.remote(attempt)))

    async def _recompute(self, attempt: str, request: GenerateRequest, prior: list[int],
                         placement: Placement) -> None:
        decode = placement.decode
        try:
            await self._call(decode, decode.handle.generate.remote(
                attempt, request.prompt_token_ids, request.params, prior_output_ids=prior,
                priority=placement.priority))
        except BackendError as e:
            self.intake.fail(attempt, e)
            return
        if attempt not in self.intake.queues and decode.alive:  # the request ended meanwhile: its abort may have
            self._spawn(quietly(decode.handle.abort.remote(attempt)))  # arrived first
