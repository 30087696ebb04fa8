"""RayBackend: the ServingBackend made of Ray actor pools (disaggregated: prefill + decode; collocated: one pool).

Owns each request's path between workers, as a sequence of attempts. An attempt is placed by Admission (which
books its capacity in the request's Reservation), then: prefill (the first token streams at once), the handoff
(the decode worker pulls the KV; a failed transfer makes it recompute the prompt instead, per
`transfer.on_failure`), and the token stream, which arrives from each decode worker in batches on its stream
(decode_pool.worker_stream; a worker started without one is long-polled) into the attempt's queue
(coordinator.backend.output_intake). A request run whole on one worker
(collocated) starts and ends there by commands on that stream, not Ray calls: one write each, and its abort can
never overtake its start. When a worker dies under an attempt
(WorkerLost), the request moves: the next attempt prefills the prompt plus every token already streamed and
continues from there, so the client sees one stream with no token missing or repeated (seeded sampling is keyed
by output index, so the continuation equals an uninterrupted run). At most `recovery.max_migrations` moves, then
an in-band error.

Each request's phases (coordinator.observability.phases) are marked on its PhaseTrace as it goes: admission at its
placement, the prefill worker's durations inside the prefill call, the decode worker's (sent with the request's
first output) inside the interval up to its first decode token, decode up to its last; the interval a dead attempt
lost is `migration`. In mode adaptive a placement may prefill locally (the collocated path on the decode worker),
and each ended request tells the AdaptiveLayout (coordinator.backend.adaptive) its latencies, handoff and cache.

Every exit path (finish, abort, disconnect, timeout, worker death, exception) runs the same `finally`: the
attempt's work is cancelled on live workers and the Reservation is released, exactly once. With growing bookings
(coordinator.admission.growth) each attempt's decode booking grows in its Reservation as its tokens arrive
(OutputIntake.on_tokens), so that release gives back the grown booking too. Dead workers are the Supervisor's: it
replaces them, and this backend starts polling the replacement. Workers an operator drained get no new work
(coordinator.backend.drains: admission and the adaptive planner see the pools through it). Every STATS_PERIOD_S it
collects the workers' transfer figures and their host tiers' added and evicted blocks, for the router's prefix index
(coordinator.admission.router); a dead worker's host entries are forgotten at once.

Parts live in their own modules and are inherited: one attempt, from its placement to its cleanup, and the
worker calls under it (coordinator.backend.attempts), the remote prefill and its handoff
(coordinator.backend.remote_prefill), the prefix fetch (coordinator.backend.prefix_fetch), what the admin routes and
/health call (coordinator.backend.operator_calls), and the workers' life events with the periodic stats
(coordinator.backend.worker_events). This class owns the request across its attempts (generate: moves, counts, the
in-flight record) and the backend's state those parts work on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from contextlib import aclosing

from coordinator.admission.admission import Admission
from coordinator.admission.growth import BookingGrowth
from coordinator.admission.reservation import Ledger
from coordinator.admission.router import Router, WorkerState
from coordinator.backend.adaptive import AdaptiveLayout
from coordinator.backend.attempts import Attempts
from coordinator.backend.block_audit import BlockAudit
from coordinator.backend.cycling import Cycler, RollingRestart
from coordinator.backend.drains import Drains
from coordinator.backend.drills import Drills
from coordinator.backend.inflight import InFlight
from coordinator.backend.operator_calls import OperatorCalls
from coordinator.backend.output_intake import OutputIntake
from coordinator.backend.pools import Pools
from coordinator.backend.prefix_fetch import PrefixFetch
from coordinator.backend.ray_group import GroupRun
from coordinator.backend.remote_prefill import RemotePrefill
from coordinator.backend.scaler import Scaler
from coordinator.backend.spares import Spares
from coordinator.backend.stats import backend_stats
from coordinator.backend.stragglers import StragglerWatch
from coordinator.backend.supervisor import Supervisor
from coordinator.backend.worker_events import WorkerEvents
from coordinator.config.serve_config import ServeConfig
from coordinator.contract import BackendError, GenerateRequest, Overloaded, PrefillFailed, TokenDelta, WorkerLost
from coordinator.observability.loop_lag import LoopLag
from coordinator.observability.phases import PhaseTrace
from engine.core.request_timing import Durations
from engine.gc_pauses import GcPauses

log = logging.getLogger("pdserve")


class RayBackend(Attempts, RemotePrefill, PrefixFetch, OperatorCalls, WorkerEvents):
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.pools = Pools(config)
        self.model_name = config.model
        self.model_path = ""
        self.max_model_len = 0
        self.vocab_size = 0
        self.ledger = Ledger(on_release=self._capacity_freed)
        self.supervisor = Supervisor(self.pools, config.recovery, self._worker_dead, self._worker_live,
                                     on_gave_up=self._capacity_freed)  # waiting requests learn it at once
        self.spares = Spares(self.pools, config.recovery.spares)  # warm workers that take over a dead slot
        self.supervisor.spares = self.spares if config.recovery.spares else None
        self.drains = Drains(self.pools, self.supervisor, self.ledger, self._capacity_freed)  # routing skips drained
        self.cycler = Cycler(self.pools, self.supervisor, self.drains)  # one worker replaced on purpose at a time
        self.rolling = RollingRestart(self.cycler)
        self.scaler: Scaler | None = None  # pools that grow and shrink with the load (min_workers / max_workers)
        if config.scaling_pools:
            self.scaler = Scaler(config, self.pools, self.drains, self.cycler, self.rolling, self._worker_live,
                                 self._worker_removed, lambda: config.recovery.spares)
        self.stragglers = StragglerWatch(config.stragglers)  # workers much slower than their peers
        self.audit = BlockAudit(config.transfer.pin_lease_s, self.ledger, lambda: len(self._ids))  # for integrity
        self.admission: Admission | None = None
        self.growth: BookingGrowth | None = None  # growing decode bookings (admission.reserve_output null)
        self.adaptive: AdaptiveLayout | None = None  # mode adaptive: roles that move, and what placement learns
        self.intake = OutputIntake(self.supervisor, lambda: self._count(self.errors, "worker_error"))
        self._push_waits: dict[str, Durations] = {}  # attempt id -> the prefill side's wait for its pushed KV
        self._ids: set[str] = set()                   # request ids in flight (the ids on the workers)
        self.inflight: dict[str, InFlight] = {}       # single-choice requests in flight, for /admin/requests
        self._block_size = 0
        self._tasks: set[asyncio.Task] = set()
        self.transfer_totals: dict[str, float] = {}
        self.errors: dict[str, int] = {}
        self.prefix_fetches = dict.fromkeys(("lent", "nothing", "failed"), 0)  # prefix_fetch's lend outcomes
        self.migrations: dict[str, int] = {}          # "attempted", "outcome_<completed|failed>"
        self.drills = Drills(self.pools, self.supervisor, config.faults)
        self.loop_lag = LoopLag()  # how late the coordinator's event loop runs, for /metrics
        self.gc_pauses = GcPauses()  # the coordinator process's collector pauses (each stalls the loop), likewise

    async def start(self) -> None:
        await self.pools.start()
        if self.pools.adopted:  # a dead coordinator's workers (coordinator.backend.adoption)
            checks = await asyncio.gather(*[w.handle.check_integrity.remote() for w in self.pools.all_workers])
            for w, check in zip(self.pools.all_workers, checks, strict=True):
                self.audit.baseline(w, check.get("expired_pins", 0))
        await self.spares.start()  # places their bundles; they start in the background
        infos = [w.info for w in self.pools.all_workers]
        self.model_path = self.pools.model_path
        # a request must fit one worker's whole KV cache (decode also books one block ahead): larger ones are
        # refused at the HTTP edge as not fitting the context, instead of waiting for room that never comes
        capacity = min(i.num_kv_blocks * i.block_size - i.block_size for i in infos)
        self.max_model_len = min(min(i.max_model_len for i in infos), capacity)
        self.vocab_size = min(i.vocab_size for i in infos)
        self._block_size = infos[0].block_size
        self.admission = Admission(self.config, self.drains, Router(infos[0].block_size), self.ledger)
        if self.config.admission.reserve_output is None:
            self.growth = BookingGrowth(infos[0].block_size, self.config.admission.reserve_ahead_tokens)
            self.intake.on_tokens = self.growth.advance  # its booking covers what it holds, and more
        if self.config.adaptive:  # the planner neither routes to nor changes a drained worker
            self.adaptive = AdaptiveLayout(self.config, self.admission, self.drains.undrained,
                                           self._booked_prompt_tokens, self._capacity_freed)
            self._spawn(self.adaptive.planner.run())
        if self.scaler is not None:
            self._spawn(self.scaler.run())
        self.loop_lag.start()
        self.gc_pauses.install()
        for w in self.pools.all_workers:  # any worker may decode (adaptive roles), and every one reports its load
            self._spawn(self.intake.loop(w))
        if self.drills.injecting:
            await self.drills.set_faults(self.drills.faults)
        self._spawn(self._stats_loop())

    async def shutdown(self) -> None:
        self.loop_lag.stop()
        self.gc_pauses.remove()
        for task in list(self._tasks):
            task.cancel()
        await self.rolling.shutdown()
        await self.supervisor.shutdown()
        await self.spares.shutdown()
        await self.drains.shutdown()
        self.intake.fail_all(BackendError("the server is shutting down"))
        await self.pools.shutdown()

    # ---- one request
    async def generate(self, request: GenerateRequest, moved_after: Sequence[int] | None = None
                       ) -> AsyncIterator[TokenDelta]:
        """The request's new tokens. `moved_after`: it was moved here after streaming these tokens elsewhere (a
        choice of a group whose worker died, coordinator.backend.ray_group): it resumes after them and counts as
        moved."""
        if len(self._ids) >= self.config.admission.max_queue and moved_after is None:
            raise Overloaded(f"{len(self._ids)} requests in flight (admission.max_queue)", retry_after_s=1.0)
        rid = request.request_id
        while rid in self._ids:  # the id on the workers; a client reusing one in flight gets a suffix
            rid = f"{request.request_id}-{len(self._ids)}"
        self._ids.add(rid)
        reservation = self.ledger.open(rid)
        trace = request.trace or PhaseTrace.now()
        sent: list[int] = list(moved_after or ())  # every token streamed so far: where a moved request resumes
        moves = 0 if moved_after is None else 1
        started_at, first_at = time.monotonic(), None
        whole = False  # after a failed prefill: on one decode worker, prompt included (recovery.prefill_retry)
        record = self.inflight[rid] = InFlight(rid, len(request.prompt_token_ids), request.params.max_tokens,
                                               request.priority, self._block_size, trace, reservation, started_at,
                                               moves=moves)
        try:
            while True:
                try:
                    async with aclosing(self._attempt(rid, moves, request, sent, reservation, trace, whole)) as deltas:
                        async for delta in deltas:
                            sent.extend(delta.token_ids)
                            record.output_tokens = len(sent)
                            first_at = first_at or time.monotonic()
                            if delta.finish_reason is not None and moves:  # before the yield: the consumer
                                self._count(self.migrations, "outcome_completed")  # closes us at the last one
                            if delta.finish_reason is not None:
                                self._ended(started_at, first_at, len(sent) - len(moved_after or ()))
                            yield delta
                            if delta.finish_reason is not None:
                                return
                    raise BackendError("the worker's token stream ended without a finish reason")
                except (WorkerLost, PrefillFailed) as e:  # a worker died, or its prefill failed: move the request
                    failed_prefill = isinstance(e, PrefillFailed)  # then it runs whole on a decode worker, once
                    out_of_moves = moves >= self.config.recovery.max_migrations
                    if failed_prefill and (whole or not self.config.recovery.prefill_retry or out_of_moves):
                        raise
                    trace.mark("migration")
                    self._count(self.migrations, "prefill_retried" if failed_prefill else "attempted")
                    if out_of_moves:
                        raise BackendError(f"{e}; the request was moved {moves} times already "
                                           "(recovery.max_migrations)") from None
                    moves, whole = moves + 1, whole or failed_prefill
                    record.moves, record.state = moves, "migrating"
                    reservation.clear()
                    log.warning("request %s: %s; %s", rid, e, "running it whole on a decode worker" if failed_prefill
                                else f"resuming after {len(sent)} tokens")
        except BackendError:
            if moves:  # a moved request that still failed: out of moves, no room, or an error elsewhere
                self._count(self.migrations, "outcome_failed")
            raise
        finally:
            reservation.release()
            self._ids.discard(rid)
            self.inflight.pop(rid, None)

    def _ended(self, started_at: float, first_at: float | None, tokens: int) -> None:
        """A request ended: its latencies for the adaptive planner's and the scaler's windows."""
        if self.adaptive is not None:
            self.adaptive.request_ended(started_at, first_at, tokens)
        if self.scaler is not None:
            self.scaler.request_ended(started_at, first_at, tokens)

    def generate_group(self, request: GenerateRequest) -> GroupRun:
        """request.n choices of one prompt, prefilled once (coordinator.backend.ray_group)."""
        return GroupRun(self, request)

    def _booked_prompt_tokens(self, worker: WorkerState) -> float:
        return self.ledger.booked(worker.key, "prompt_tokens")

    def stats(self) -> dict:
        return backend_stats(self)

    def _count(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1

    def _spawn(self, coro: Coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
