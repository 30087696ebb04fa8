"""GroupRun: one prompt's n choices (OpenAI `n` / `best_of`) or a prompt-logprobs request on the Ray pools,
prefilled once (RayBackend.generate_group).

Path: Admission places the group and books it once (the prompt's full blocks once, per choice its partial block,
outputs and one block ahead: Admission.kv_blocks); the prefill worker (collocated: the decode worker itself,
`prefill_group`) runs the prompt once and samples every choice's first token from the same logits, each with its
choice's params (engine.choices: seed + j); those first tokens stream at once, with the prompt logprobs; then the
decode worker pulls the KV once and forks it per choice (DecodeWorker.decode_group). Each choice then streams under
its own worker id `<group>#<j>`; `stop(j)` aborts one choice (a stop string matched), the others go on.

Every exit path runs one `finally`: every unfinished choice and the group's prefill are aborted on live workers
and the Reservation is released, exactly once. With growing bookings (coordinator.admission.growth) each choice's
share of the booking grows as its tokens arrive, in the group's Reservation.
Migration: when a worker under the group dies (or its KV transfer fails, with transfer.on_failure: recompute),
the group's own placement ends (the finally above). If nothing was streamed yet, the whole group starts again
(up to recovery.max_migrations times). Otherwise every unfinished choice goes on alone as a single request
resumed after the tokens it already streamed (RayBackend.generate(..., moved_after=...): prompt + those tokens
prefilled elsewhere, the choice's own seeded params, so the continuation is the uninterrupted one). The prompt's
KV is then no longer shared between the choices: the price of a rare failure, for code that reuses the single
requests' migration path instead of a second one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from coordinator.admission.router import WorkerState
from coordinator.backend.ray_calls import quietly
from coordinator.contract import BackendError, GenerateRequest, TokenDelta, TransferFailed, WorkerLost
from engine.core.choices import choice_params

log = logging.getLogger(__name__)


class GroupRun:
    def __init__(self, backend: Any, request: GenerateRequest) -> None:
        # backend: the RayBackend that runs the group (its books, streams and calls); typed loosely because
        # ray_backend imports this module
        self._backend = backend
        self._request = request
        self._params = choice_params(request.params, request.n)
        self._stopped: set[int] = set()
        self._done: set[int] = set()
        self._decode: WorkerState | None = None
        self._ids: list[str] = []
        self._sent: list[list[int]] = [[] for _ in range(request.n)]  # per choice: every token streamed
        self._resumed: dict[int, asyncio.Task] = {}  # choice -> its task after a migration
        self._gen = self._run()

    def __aiter__(self) -> GroupRun:
        return self

    async def __anext__(self) -> tuple[int, TokenDelta]:
        return await self._gen.__anext__()

    def stop(self, index: int) -> None:
        if index in self._stopped or index in self._done:
            return
        self._stopped.add(index)
        if index in self._resumed:
            self._resumed[index].cancel()  # closing its stream aborts it on its worker
        elif self._decode is not None and self._decode.alive and self._ids:
            self._backend._spawn(quietly(self._decode.handle.abort.remote(self._ids[index])))

    async def aclose(self) -> None:
        await self._gen.aclose()

    async def _run(self) -> AsyncIterator[tuple[int, TokenDelta]]:
        b, restarts = self._backend, 0
        while True:
            try:  # aclosing: a consumer that stops early runs each stage's cleanup now, not at garbage collection
                async with aclosing(self._grouped()) as grouped:
                    async for j, delta in grouped:
                        yield self._record(j, delta)
                if restarts:
                    b._count(b.migrations, "outcome_completed")
                return
            except WorkerLost as e:
                lost: BackendError = e
            except TransferFailed as e:
                if b.config.transfer.on_failure == "fail":
                    raise BackendError(f"{e} (transfer.on_failure: fail)") from None
                lost = e
            if any(self._sent):
                break
            # nothing streamed yet: the whole group starts again (prefilled once, prompt logprobs included)
            b._count(b.migrations, "attempted")
            if restarts >= b.config.recovery.max_migrations:
                b._count(b.migrations, "outcome_failed")
                raise BackendError(f"{lost}; the group was moved {restarts} times already "
                                   "(recovery.max_migrations)") from None
            restarts += 1
            log.warning("group %s: %s; starting it again", self._request.request_id, lost)
        async with aclosing(self._resume(lost)) as resumed:
            async for j, delta in resumed:
                yield self._record(j, delta)

    def _record(self, j: int, delta: TokenDelta) -> tuple[int, TokenDelta]:
        self._sent[j].extend(delta.token_ids)
        return j, delta

    async def _resume(self, lost: BackendError) -> AsyncIterator[tuple[int, TokenDelta]]:
        """Every unfinished choice as its own resumed single request; their deltas merged in arrival order."""
        b, request = self._backend, self._request
        merged: asyncio.Queue = asyncio.Queue()

        async def run(j: int) -> None:
            params = replace(self._params[j], prompt_logprobs=None)  # they went out with the first tokens
            alone = replace(request, request_id=f"{request.request_id}#{j}", params=params, n=1, trace=None)
            try:
                async with aclosing(b.generate(alone, moved_after=self._sent[j])) as deltas:
                    async for delta in deltas:
                        merged.put_nowait((j, delta))
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # noqa: BLE001 - it ends the group's stream
                merged.put_nowait((j, e))
        pending = [j for j in range(request.n) if j not in self._done and j not in self._stopped]
        log.warning("group %s: %s; resuming %d choices alone", request.request_id, lost, len(pending))
        for j in pending:
            b._count(b.migrations, "attempted")
            self._resumed[j] = asyncio.get_running_loop().create_task(run(j))
        try:
            while len(self._done | self._stopped) < request.n:
                j, item = await merged.get()
                if isinstance(item, BaseException):
                    raise item
                if j in self._stopped or j in self._done:
                    continue
                if item.finish_reason is not None:
                    self._done.add(j)
                yield j, item
        finally:
            for task in self._resumed.values():
                task.cancel()
            await asyncio.gather(*self._resumed.values(), return_exceptions=True)

    async def _grouped(self) -> AsyncIterator[tuple[int, TokenDelta]]:
        """The group's own placement: prefilled once, forked on one decode worker. WorkerLost or TransferFailed
        out of it (after its cleanup) means: resume the unfinished choices alone."""
        b, request = self._backend, self._request
        rid = request.request_id
        while rid in b._ids:
            rid = f"{request.request_id}-{len(b._ids)}"
        b._ids.add(rid)
        reservation = b.ledger.open(rid)
        self._ids = ids = [f"{rid}#{j}" for j in range(request.n)]
        index = {cid: j for j, cid in enumerate(ids)}
        queue: asyncio.Queue = asyncio.Queue()
        cleanup: list[tuple[WorkerState, str]] = []
        try:
            placement = await b.admission.place(request, 0, reservation)
            prefill, decode = placement.prefill, placement.decode
            self._decode = decode
            if b.growth is not None:  # each choice: its copy of the partial block and its outputs, grown as they come
                partial = len(request.prompt_token_ids) % b.growth.block_size
                share = b.growth.blocks_for(partial, b.admission.output_budget(request, 0))
                for cid in ids:
                    b.growth.track(cid, reservation, decode.key, partial, request.params.max_tokens, share)
            for cid in ids:
                b.intake.queues[cid] = queue
            source = prefill or decode
            cleanup.append((source, "abort_group"))
            if prefill is not None:
                try:
                    out = await b._call(prefill, prefill.handle.prefill.remote(
                        rid, request.prompt_token_ids, self._params[0], priority=placement.priority,
                        fork_params=self._params[1:]))
                    prefill.report(out.load)
                    firsts = [(out.first_token_id, out.first_logprob), *(out.fork_first or [])]
                    prompt_lps, peer, blocks = out.prompt_logprobs, prefill.name, out.block_ids
                    cached = out.num_cached_tokens
                except WorkerLost:
                    raise
                except BackendError as e:  # an error there, not its death: prefilled on its decode worker instead
                    if not b.config.recovery.prefill_retry:
                        raise
                    log.warning("group %s: %s; prefilling it on decode worker %s", rid, e, decode.name)
                    b._count(b.migrations, "prefill_retried")
                    prefill = None
                    cleanup.append((decode, "abort_group"))
            if prefill is None:
                out = await b._call(decode, decode.handle.prefill_group.remote(
                    rid, request.prompt_token_ids, self._params, priority=placement.priority))
                firsts = [(out.new_token_ids[0], out.new_logprobs[0] if out.new_logprobs else None),
                          *(out.fork_first or [])]
                prompt_lps, peer, blocks, cached = out.prompt_logprobs, None, [], out.num_cached_tokens
            reservation.unbook(source.key, "prompt_tokens")
            for j, (token, lp) in enumerate(firsts):
                yield j, TokenDelta([token], [lp] if lp else [], None, prompt_lps, cached)
            cleanup.append((decode, "abort"))
            for cid in ids:
                decode.requests.add(cid)
            b._spawn(self._handoff(rid, decode, prefill, firsts, peer, blocks, queue, placement.priority))
            while len(self._done | self._stopped) < request.n:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                j = index[out.request_id]
                if j in self._stopped or j in self._done:
                    continue
                if out.finish_reason is not None:
                    self._done.add(j)
                yield j, TokenDelta(out.new_token_ids, out.new_logprobs, out.finish_reason)
        finally:
            for cid in ids:
                b.intake.queues.pop(cid, None)
                if b.growth is not None:
                    b.growth.drop(cid)
            for worker, action in cleanup:
                if action == "abort_group":
                    if worker.alive:
                        b._spawn(quietly(worker.handle.abort.remote(rid)))
                    continue
                for j, cid in enumerate(ids):
                    worker.requests.discard(cid)
                    if worker.alive and j not in self._done:
                        b._spawn(quietly(worker.handle.abort.remote(cid)))
            reservation.release()
            b._ids.discard(rid)

    async def _handoff(self, rid: str, decode: WorkerState, prefill: WorkerState | None,
                       firsts: list[tuple[int, Any]], peer: str | None, blocks: list[int],
                       queue: asyncio.Queue, priority: int) -> None:
        """The decode worker pulls the KV once (or takes the group pinned on itself) and starts every choice (at
        the group's priority); the prefill worker then frees its pinned copy. Errors go into the group's stream."""
        b = self._backend
        try:
            decode.report(await b._call(decode, decode.handle.decode_group.remote(
                rid, self._ids, self._request.prompt_token_ids, self._params, firsts, peer, blocks, priority)))
        except BackendError as e:
            queue.put_nowait(e)
        finally:
            if prefill is not None and prefill.alive:
                b._spawn(quietly(prefill.handle.release.remote(rid)))
        ended = self._ids[0] not in b.intake.queues  # the group's stream closed while the choices were starting
        for j, cid in enumerate(self._ids):  # an abort sent before a choice existed there found nothing
            if decode.alive and (j in self._stopped or (ended and j not in self._done)):
                b._spawn(quietly(decode.handle.abort.remote(cid)))

