"""Planner: moves workers' roles while serving (`mode: adaptive`), one worker at a time, toward the pool the measured
load says is short.

Roles: "prefill" (takes prompts for other workers, decodes nothing new), "decode" (decodes, prefilling its own
requests locally when placement says so) and "mixed" (both). A role is routing only (every worker can do both:
pool_worker.worker.Worker), so a change takes effect at the next request and loses nothing: what runs on the worker
goes on.

What it judges by: the requests that ended within `planner.window_s` (and after the last change), their TTFT and
TPOT 90th percentiles against the SLO targets (coordinator.observability.latency_window), and how busy each engine
was since the last look (its step time over the wall time: coordinator.backend.busy_meter). Decode is short
when the TPOT p90 passes DECODE_SHORT of its target while the TTFT p90 is within HEADROOM of its own; prefill is
short when the TTFT p90 passes DECODE_SHORT of its target while decode is not short. Short decode moves a worker one
step toward decoding: a prefill worker busy less than SPARE of the time becomes mixed (a busier one would lose the
prefill rate its pool lives on: its prompts would share decoding steps within their budget), else a mixed worker
becomes decode. Short prefill moves one step toward prefilling (mixed -> prefill, else decode -> mixed), always
keeping a worker that decodes. A worker with a prefill lane (EngineConfig.sm_split_decode_sms: prompts run on SMs
of their own beside its decode steps, at its measured EngineLoad.lane_token_s) changes the ladder twice: short
prefill moves such a decode worker to mixed first (its streams go on decoding, its prompts do not share their
steps), before a mixed one stops decoding; and short decode may move such a prefill worker to mixed however busy, as
long as its lane alone would carry the prompt work it has (busy share over the lane's share of the full prefill
rate, `lane_share`, under LANE_FULL). Hysteresis: the same verdict on CONFIRM consecutive looks, then
`planner.cooldown_s` without changes, and a change is judged only by requests that ended after it. Both short, or
neither: no change. One exception needs no verdict: when no live worker decodes but another lives, one becomes mixed at
once, the moment the last decoding worker dies (`ensure_decoder`: a dead decode worker's replacement takes seconds; its
streams should not wait for it).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.admission.router import WorkerState
from coordinator.backend.busy_meter import BusyMeter
from coordinator.config.adaptive_config import PlannerConfig, SLOConfig
from coordinator.observability.latency_window import LatencyWindow

log = logging.getLogger("pdserve")
ROLES = ("prefill", "mixed", "decode")  # the ladder: one change moves one step along it
DECODE_SHORT = 0.9   # a p90 past this share of its target: that pool is short
HEADROOM = 0.6       # decode is short only while the TTFT p90 is within this share of its target
SPARE = 0.5          # a prefill worker busy less than this share of the time may take decodes too
CONFIRM = 2          # consecutive looks with the same verdict before a change
LANE_FULL = 0.9      # a prefill worker's prompt work on its lane alone must fit this share of the time


@dataclass(frozen=True)
class RoleChange:
    worker: str
    old: str
    new: str
    why: str


def verdict(ttft_p90: float, tpot_p90: float, slo: SLOConfig) -> str | None:
    """Which pool is short ("decode" | "prefill"), or None."""
    if math.isnan(ttft_p90) or math.isnan(tpot_p90):
        return None
    ttft, tpot = ttft_p90 / slo.ttft_s, tpot_p90 / slo.tpot_s
    if tpot > DECODE_SHORT and ttft < HEADROOM:
        return "decode"
    if ttft > DECODE_SHORT and tpot <= DECODE_SHORT:
        return "prefill"
    return None


def step_toward(short: str, workers: list[WorkerState], pressure: Callable[[WorkerState], float],
                busy: dict[str, float]) -> tuple[WorkerState, str] | None:
    """The live worker to move one step toward the short pool, and its new role (least pressed first). `busy`:
    each worker's share of time its engine stepped (unknown: fully busy)."""
    live = [w for w in workers if w.alive]
    decoders = [w for w in live if w.role != "prefill"]
    if short == "decode":
        order = [("prefill", "mixed"), ("mixed", "decode")]
    else:  # a decode worker with a lane takes prompts beside its steps: before any worker stops decoding
        order = [("decode+lane", "mixed"), ("mixed", "prefill"), ("decode", "mixed")]
    for old, new in order:
        movable = [w for w in live if w.role == old.removesuffix("+lane")]
        if old.endswith("+lane"):
            movable = [w for w in movable if lane_share(w) > 0]
        if new == "prefill":  # it stops decoding: another must go on
            movable = [w for w in movable if len(decoders) > 1]
        if old == "prefill":  # only a prefill worker with time to spare (or a lane that carries its prompts)
            movable = [w for w in movable if _may_take_decodes(w, busy.get(w.name, 1.0))]
        if movable:
            return min(movable, key=pressure), new
    return None


def lane_share(worker: WorkerState) -> float:
    """The share of the worker's full prefill rate its prefill lane keeps beside decode steps (its measured seconds
    per prompt token, whole GPU over lane); 0 without a lane, before both are measured, or while its split table
    chunks prompts beside the worker's decode batch (EngineLoad.lane_token_s)."""
    load = worker.load
    if load is None or load.lane_token_s <= 0 or load.prefill_token_s <= 0:
        return 0.0
    return min(1.0, load.prefill_token_s / load.lane_token_s)


def _may_take_decodes(worker: WorkerState, busy: float) -> bool:
    """Whether a prefill worker busy this share of the time may become mixed: with time to spare, its prompts may
    share decoding steps; with a lane, they move to the lane, which must carry them."""
    if busy < SPARE:
        return True
    share = lane_share(worker)
    return share > 0 and busy / share < LANE_FULL


class Planner:
    def __init__(self, config: PlannerConfig, slo: SLOConfig, workers: Callable[[], list[WorkerState]],
                 window: LatencyWindow, apply: Callable[[WorkerState, str, str], None],
                 pressure: Callable[[WorkerState], float], clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.slo, self.window = config, slo, window
        self._workers, self._apply, self._pressure, self._clock = workers, apply, pressure, clock
        self._last_change = -math.inf
        self._streak: tuple[str | None, int] = (None, 0)
        self.meter = BusyMeter()  # each worker's share of the last look's time its engine stepped

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a failed look is logged; the next one comes
                log.exception("planner: a look at the pools failed")

    def tick(self) -> RoleChange | None:
        """One look: the change it made, if any."""
        now = self._clock()
        workers = self._workers()
        self.meter.measure(workers, now)
        change = self.ensure_decoder()
        if change is not None:
            return change
        if not self.config.enabled or now - self._last_change < self.config.cooldown_s:
            return None
        since = max(now - self.config.window_s, self._last_change)
        count, ttft_p90, tpot_p90 = self.window.quantiles(since)
        short = verdict(ttft_p90, tpot_p90, self.slo) if count >= self.config.min_requests else None
        last, n = self._streak
        self._streak = (short, n + 1 if short == last else 1)
        if short is None or self._streak[1] < CONFIRM:
            return None
        move = step_toward(short, workers, self._pressure, self.busy)
        if move is None:
            return None
        busy = ", ".join(f"{name} busy {share:.0%}" for name, share in sorted(self.busy.items()))
        why = (f"{short} is short: TTFT p90 {ttft_p90 * 1000:.0f} ms (target {self.slo.ttft_ms:g}), TPOT p90 "
               f"{tpot_p90 * 1000:.1f} ms (target {self.slo.tpot_ms:g}) over {count} requests; {busy}")
        return self._change(*move, why, now)

    @property
    def busy(self) -> dict[str, float]:
        """Each worker's share of time its engine stepped, as of the last look (unknown: not there)."""
        return self.meter.busy

    def ensure_decoder(self) -> RoleChange | None:
        """The exception to the verdicts: when no live worker decodes but another lives, the least pressed one
        becomes mixed now (called by each look, and by the backend the moment a worker dies)."""
        live = [w for w in self._workers() if w.alive]
        if live and not any(w.role != "prefill" for w in live):
            return self._change(min(live, key=self._pressure), "mixed", "no live worker decodes", self._clock())
        return None

    def _change(self, worker: WorkerState, new: str, why: str, now: float) -> RoleChange:
        change = RoleChange(worker.name, worker.role, new, why)
        self._apply(worker, new, why)
        self._last_change = now
        self._streak = (None, 0)
        return change
