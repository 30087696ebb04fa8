"""Admission: decides where a request runs and books the capacity it may need there, or says why it cannot.

What a request books (in its Reservation, see coordinator.admission.reservation):
- on the worker that will decode it: KV blocks for prompt + tokens already generated (a migrated request) + an
  output budget. By default (`admission.reserve_output: null`) the budget is `admission.reserve_ahead_tokens`, and
  the booking grows as the request decodes (coordinator.admission.growth): a worker's bookings follow what its
  requests hold, and its engine preempts (the lowest-priority, newest request; recomputed later) when they outgrow
  its blocks. With `reserve_output` a number, that share of the output still to come is booked up front and never
  grown: at 1.0 the decode engine can never run out of blocks, so it never preempts.
- on the worker that will prefill it (disaggregated; the same worker when collocated): its prompt tokens, given
  back when the prefill returns, so a prefill worker's backlog stays under `admission.max_prefill_backlog_tokens`.
Capacity is the worker's whole KV cache minus what is booked, never the load it last reported (which lags).
Requests below the high priority class may book only 1 - `admission.reserved_for_high` of each worker's KV blocks
and prefill backlog, so a flood of normal or low requests leaves room for high ones to start at once; a request
whose wait has aged it into the high class (`admission.priority_aging_s`) books as high.

Adaptive mode (`mode: adaptive`): the decode worker is picked as above among the workers that decode; where the
prompt is prefilled, remotely on a worker that takes prefills for others or locally on that decode worker, is the
PlacementModel's choice (coordinator.admission.placement), counted in `placements` and logged per request
(logger coordinator.placement).

Fallback (`mode: disaggregated`, `recovery.fallback`, on by default): while one pool has no live worker (its slot
dead and being replaced, or every worker of it drained), a request, new or moving off the dead worker, runs whole on
a live worker of the other pool (every worker can prefill and decode: the collocated path), its KV blocks and prompt
booked there, instead of waiting for the replacement. Once both pools have a live worker, placements split again
(what runs on the other pool's worker finishes there). Counted in `fallbacks` by the missing pool (/metrics
`pdserve_fallback_placements_total`).

A request whose whole length (prompt, max_tokens) cannot fit even an empty worker is refused at once
(RequestTooLarge, a 400). One that cannot fit
now waits in the priority AdmissionQueue (with aging) up to `admission.timeout_s`, also while a pool has no live
worker, then gets Overloaded (503 + Retry-After) naming the reason: the pool that is down, or the room missing.
A pool whose every slot gave up its restarts (recovery.max_restarts) comes back only when an operator revives it:
while a request would need it (with fallback, in disaggregated mode: while both pools have given up), the request,
new or waiting, gets Unavailable at once (503 + Retry-After, the pool's reason), not a wait for the timeout.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Protocol

from coordinator.admission.admission_queue import AdmissionQueue, AdmissionTimeout
from coordinator.admission.placement import Choice, PlacementModel, Side
from coordinator.admission.reservation import Ledger, Reservation
from coordinator.admission.router import Router, WorkerState
from coordinator.config.serve_config import ServeConfig
from coordinator.contract import GenerateRequest, Overloaded, RequestTooLarge, Unavailable

log = logging.getLogger("coordinator.placement")
MIGRATION_PRIORITY = 0  # a request moving off a dead worker goes before every new one
HIGH_PRIORITY = 1       # tenants' "high" class: may book the share other classes leave (admission.reserved_for_high)
GIVEN_UP_RETRY_S = 30.0  # Retry-After while a pool gave up: an operator's revive and a model load come first


class Workers(Protocol):
    """The pools as admission reads them (the backend's Supervisor owns them)."""

    roles: tuple[str, ...]  # the pools that must each have a live worker

    def live(self, role: str) -> list[WorkerState]: ...

    def workers(self, role: str) -> list[WorkerState]: ...

    def down_reason(self, role: str) -> str | None: ...

    def given_up(self, role: str) -> bool: ...  # every slot of the pool gave up: back only by an operator's revive


@dataclass(frozen=True)
class Placement:
    decode: WorkerState            # decodes it (collocated: runs all of it)
    prefill: WorkerState | None    # prefills it (disaggregated)
    kv_blocks: int
    priority: int                  # the order it waited in, passed on to the engines' waiting queues
    choice: Choice | None = None   # adaptive mode: the placement model's estimates behind `prefill`
    # the prompt's leading tokens the router's indexes said `prefill` held before this request was routed there
    # (routing remembers the prompt as its own): what a prefix fetch would not need (coordinator.backend.prefix_fetch)
    prefill_held_tokens: int = 0


class Admission:
    def __init__(self, config: ServeConfig, workers: Workers, router: Router, ledger: Ledger) -> None:
        self.config = config
        self.workers = workers
        self.router = router
        self.ledger = ledger
        self.queue = AdmissionQueue(aging_s=config.admission.priority_aging_s, bypass_s=config.admission.bypass_s)
        self.placement = PlacementModel(config.slo) if config.adaptive and config.slo else None
        self.placements: dict[str, int] = {"remote": 0, "local": 0}  # where prompts were prefilled
        # disaggregated requests run whole on the other pool's worker while this pool had no live worker
        self.fallbacks: dict[str, int] = {"decode": 0, "prefill": 0}

    def output_budget(self, request: GenerateRequest, num_prior: int) -> int:
        """Output tokens (per choice) booked at admission: reserve_ahead_tokens (growing bookings) or the
        reserve_output share of the outputs still to come."""
        remaining = request.params.max_tokens - num_prior
        a = self.config.admission
        return min(remaining, a.reserve_ahead_tokens) if a.reserve_output is None else math.ceil(
            remaining * a.reserve_output)

    def kv_blocks(self, request: GenerateRequest, num_prior: int, budget: int | None = None) -> int:
        """Blocks booked on the decode worker: prompt, prior outputs and `budget` output tokens (default the
        output_budget), plus the one block the engine keeps ahead for the next token. A group of n choices books the
        prompt's full blocks once and, per choice, its copy of the partial last block, its outputs and one block
        ahead (plus the group's own partial block while it is forked)."""
        budget = self.output_budget(request, num_prior) if budget is None else budget
        tokens = len(request.prompt_token_ids) + num_prior + budget
        bs = self.router.block_size
        if request.n == 1:
            return -(-tokens // bs) + 1
        full, partial = divmod(len(request.prompt_token_ids), bs)
        return full + 1 + request.n * (-(-(partial + budget) // bs) + 1)

    async def place(self, request: GenerateRequest, num_prior: int, reservation: Reservation,
                    migrating: bool = False, run_whole: bool = False) -> Placement:
        """Pick the workers and book the request's capacity on them (in `reservation`), waiting up to the
        admission timeout; raises RequestTooLarge or Overloaded. `run_whole`: on one decode worker, prompt included
        (its remote prefill failed: recovery.prefill_retry)."""
        blocks = self.kv_blocks(request, num_prior)
        whole = self.kv_blocks(request, num_prior, request.params.max_tokens - num_prior)
        largest = max((w.info.num_kv_blocks for w in self._pool("decode")), default=0)
        if whole > largest:
            raise RequestTooLarge(f"the request needs {whole} KV blocks of {self.router.block_size} tokens "
                                  f"(prompt, max_tokens) but a decode worker holds at most {largest}")
        tokens = len(request.prompt_token_ids) + num_prior
        if (unavailable := self._unavailable()) is not None:
            raise unavailable
        arrived = time.monotonic()
        deadline = arrived + self.config.admission.timeout_s
        priority = MIGRATION_PRIORITY if migrating else request.priority
        try:
            return await self.queue.acquire(priority, deadline, lambda: self._try_place(
                request, tokens, blocks, reservation, priority,
                self.queue.effective_priority(priority, time.monotonic() - arrived), run_whole))
        except AdmissionTimeout:
            raise self._why_not(blocks, tokens) from None

    def notify(self) -> None:
        """Capacity may have freed (a request ended, a worker came back): waiting requests look again."""
        self.queue.notify()

    # ---- internals
    def _try_place(self, request: GenerateRequest, tokens: int, blocks: int, reservation: Reservation,
                   priority: int, aged: int, run_whole: bool = False) -> Placement | None:
        """Book the request's capacity and say where it runs, or None if it must wait; raises Unavailable when no
        placement can come without an operator."""
        if run_whole:
            share = 1.0 if aged <= HIGH_PRIORITY else 1.0 - self.config.admission.reserved_for_high
            placement = self._place_whole("decode", tokens, blocks, reservation, priority, share)
        else:
            placement = self._place_now(request, tokens, blocks, reservation, priority, aged)
        if placement is None and (unavailable := self._unavailable()) is not None:
            raise unavailable  # the queue fails this waiter and asks the next
        return placement

    def _unavailable(self) -> Unavailable | None:
        """Unavailable naming the pools that gave up, while a request needs one of them (disaggregated with
        fallback: both, since either runs whole requests alone); else None."""
        gone = [role for role in self.workers.roles if self.workers.given_up(role)]
        either = self.config.mode == "disaggregated" and self.config.recovery.fallback
        if not gone or (either and len(gone) < len(self.workers.roles)):
            return None
        return Unavailable("; ".join(self.workers.down_reason(role) or f"the {role} pool gave up" for role in gone),
                           retry_after_s=GIVEN_UP_RETRY_S)

    def _place_now(self, request: GenerateRequest, tokens: int, blocks: int, reservation: Reservation,
                   priority: int, aged: int) -> Placement | None:
        """Book the request's capacity and say where it runs, or None if it must wait. `aged`: the priority its wait
        has lifted it to, which decides its share; the queue put it first by that, and a head that could never take
        what its class may book would hold up everyone behind it (strict head of line)."""
        share = 1.0 if aged <= HIGH_PRIORITY else 1.0 - self.config.admission.reserved_for_high
        if self.placement is not None:
            return self._place_adaptive(request, tokens, blocks, reservation, priority, share)
        prefill_role = "prefill" if self.config.mode == "disaggregated" else "decode"
        decode_live = self.workers.live("decode")
        if prefill_role == "prefill" and self.config.recovery.fallback and not (
                decode_live and self.workers.live("prefill")):
            return self._place_fallback(request, tokens, blocks, reservation, priority, share)
        backlog_ok = [w for w in self.workers.live(prefill_role) if self._backlog_allows(w, tokens, share)]
        if prefill_role == "decode":
            decode_live = [w for w in decode_live if w in backlog_ok]
        if not backlog_ok or not decode_live:
            return None
        if prefill_role == "decode":  # collocated: the worker holding the prompt's prefix, room allowing
            decode = self.router.pick_whole(request.prompt_token_ids, decode_live, lambda w: self._room(w, share),
                                            blocks)
        else:
            decode = self.router.pick_decode(decode_live, lambda w: self._room(w, share), blocks)
        if decode is None:
            return None
        prefill, held = None, 0
        if prefill_role == "prefill":
            prompt = request.prompt_token_ids
            prefill = self.router.pick_prefill(prompt, backlog_ok, self._pressure, remember=False)
            held = self.router.held_by(prompt, [prefill.name])[prefill.name]  # before it is remembered as its
            self.router.remember(prompt, prefill.name)
        reservation.book(decode.key, "kv_blocks", blocks)
        reservation.book((prefill or decode).key, "prompt_tokens", tokens)
        self.placements["local" if prefill is None else "remote"] += 1
        return Placement(decode, prefill, blocks, priority, prefill_held_tokens=held)

    def _place_fallback(self, request: GenerateRequest, tokens: int, blocks: int, reservation: Reservation,
                        priority: int, share: float) -> Placement | None:
        """Disaggregated, with one pool that has no live worker (a dead slot being replaced): the request runs whole
        on a live worker of the other pool (every worker can prefill and decode), booked there, instead of waiting
        for the replacement. Counted in `fallbacks` by the pool that was missing."""
        missing = "prefill" if self.workers.live("decode") else "decode"
        other = "decode" if missing == "prefill" else "prefill"
        placement = self._place_whole(other, tokens, blocks, reservation, priority, share)
        if placement is not None:
            self.fallbacks[missing] += 1
            log.info("request %s: no live %s worker; running it whole on %s worker %s", request.request_id, missing,
                     other, placement.decode.name)
        return placement

    def _place_whole(self, pool: str, tokens: int, blocks: int, reservation: Reservation, priority: int,
                     share: float) -> Placement | None:
        """The request whole (prompt and decode) on the live worker of `pool` with the most room, booked there."""
        candidates = [w for w in self.workers.live(pool) if self._backlog_allows(w, tokens, share)]
        worker = self.router.pick_decode(candidates, lambda w: self._room(w, share), blocks)
        if worker is None:
            return None
        reservation.book(worker.key, "kv_blocks", blocks)
        reservation.book(worker.key, "prompt_tokens", tokens)
        self.placements["local"] += 1
        return Placement(worker, None, blocks, priority)

    def _place_adaptive(self, request: GenerateRequest, tokens: int, blocks: int, reservation: Reservation,
                        priority: int, share: float) -> Placement | None:
        """The decode worker holding the prompt's prefix (a conversation's history: it decoded the last turn),
        room allowing, else the one with the most room; and the prompt's place by the placement model."""
        decode = self.router.pick_whole(request.prompt_token_ids, self.workers.live("decode"),
                                        lambda w: self._room(w, share), blocks, remember=False)
        if decode is None:
            return None
        prompt = request.prompt_token_ids
        remotes = [self._side(w, prompt, tokens) for w in self.workers.live("prefill")
                   if w is not decode and self._backlog_allows(w, tokens, share)]
        choice = self.placement.choose(self._side(decode, prompt, tokens), remotes)
        prefill = None if choice.remote is None else next(w for w in self.workers.live("prefill")
                                                          if w.name == choice.remote.name)
        held = self.router.held_by(prompt, [prefill.name])[prefill.name] if prefill is not None else 0
        self.router.remember(prompt, (prefill or decode).name)
        reservation.book(decode.key, "kv_blocks", blocks)
        reservation.book((prefill or decode).key, "prompt_tokens", tokens)
        self.placements[choice.placement] += 1
        log.info("request %s: prefill %s on %s, decode on %s (first token estimated %s local, %s remote)",
                 request.request_id, choice.placement, (prefill or decode).name, decode.name,
                 _seconds(choice.local_s), _seconds(choice.remote_s))
        return Placement(decode, prefill, blocks, priority, choice, held)

    def _side(self, worker: WorkerState, prompt: list[int], tokens: int) -> Side:
        """`worker` as a place to prefill a prompt of `tokens` tokens (prompt and prior outputs)."""
        cached = min(self.router.effective_cached_tokens(prompt, worker.name), tokens - 1)
        decoding = worker.decodes and worker.load is not None and worker.load.num_running > 0
        return Side(worker.name, worker.load, self.ledger.booked(worker.key, "prompt_tokens"), tokens - cached,
                    decoding)

    def _room(self, worker: WorkerState, share: float = 1.0) -> int:
        return int(worker.info.num_kv_blocks * share) - self.ledger.booked(worker.key, "kv_blocks")

    def _pressure(self, worker: WorkerState) -> int:
        return self.ledger.booked(worker.key, "prompt_tokens")

    def _backlog_allows(self, worker: WorkerState, tokens: int, share: float = 1.0) -> bool:
        cap = self.config.admission.max_prefill_backlog_tokens
        booked = self.ledger.booked(worker.key, "prompt_tokens")
        return cap is None or booked == 0 or booked + tokens <= cap * share  # an idle worker takes any prompt

    def _why_not(self, blocks: int, tokens: int) -> Overloaded:
        reasons = [r for role in self.workers.roles if (r := self.workers.down_reason(role)) is not None]
        if reasons:  # each says whether a replacement is coming
            return Overloaded("; ".join(reasons), retry_after_s=5.0)
        if self.config.mode == "disaggregated" and not any(
                self._backlog_allows(w, tokens) for w in self.workers.live("prefill")):
            return Overloaded(f"every prefill worker's backlog is full (admission.max_prefill_backlog_tokens "
                              f"{self.config.admission.max_prefill_backlog_tokens})", retry_after_s=1.0)
        return Overloaded(f"no decode worker has room for this request's KV cache ({blocks} blocks) within "
                          f"{self.config.admission.timeout_s:g} s", retry_after_s=1.0)

    def _pool(self, role: str) -> list[WorkerState]:
        return self.workers.workers(role)


def _seconds(s: float) -> str:
    return "unknown" if math.isinf(s) else f"{s:.3f} s"
