"""ScalePolicy: when a pool should grow or shrink by one worker (the decisions of coordinator.backend.scaler, which
carries them out). It reads numbers only (the recent requests' latencies, each pool's size and how busy its workers
were) and calls nothing, so its rules are tested on their own.

A pool misses its target when the 90th percentile over the requests that ended within `scaling.window_s` (and
after the last scale event: an event is judged by what came after it) passes the target: decode's TPOT (time per
output token) and prefill's TTFT (time to the first token); in mode collocated the one pool owns both. With fewer
than `scaling.min_requests` requests nothing misses. Out: the pool that misses furthest (of those below
max_workers) on CONFIRM consecutive looks grows by one worker. In: a pool above min_workers whose load has been low
on every look for `scaling.scale_in_after_s` shrinks by one; low means its target met with room (its p90 under
MET_SHARE of the target, or too few requests to judge) and its live workers' mean busy share, spread over one
worker fewer, under `scaling.scale_in_busy` (a pool that would be busy again after the removal is not low: the
band between the two rules is the hysteresis). A pool whose workers' busy share is not measured yet is not low.
No shrinking while any pool misses, and none while a pool has a slot that is not live (being replaced, drained).
After any event (a failed scale-out included) nothing happens for `scaling.cooldown_s`, and every low streak starts
again. One event at a time for the whole fleet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from coordinator.config.adaptive_config import SLOConfig
from coordinator.config.scaling_config import ScalingConfig
from coordinator.observability.latency_window import LatencyWindow

CONFIRM = 2        # consecutive looks on which the same pool misses before it grows
MET_SHARE = 0.8    # a pool's load is low only while its p90 is under this share of its target


@dataclass(frozen=True)
class PoolView:
    """One pool as a look sees it."""

    name: str                  # "prefill" | "decode"
    slots: int                 # its worker slots, in any state
    live: int                  # live and routed to (not drained)
    fewest: int                # min_workers
    most: int                  # max_workers
    busy: list[float] = field(default_factory=list)  # each live worker's busy share (missing ones: not measured)


@dataclass(frozen=True)
class Decision:
    pool: str
    direction: str  # "out" | "in"
    why: str


class ScalePolicy:
    def __init__(self, config: ScalingConfig, slo: SLOConfig, collocated: bool) -> None:
        self.config, self.slo, self.collocated = config, slo, collocated
        self.last_event = -math.inf
        self._streak: tuple[str | None, int] = (None, 0)
        self._low_since: dict[str, float] = {}

    def look(self, now: float, window: LatencyWindow, pools: list[PoolView]) -> Decision | None:
        """The event to carry out now, if any."""
        since = max(now - self.config.window_s, self.last_event)
        count, ttft_p90, tpot_p90 = window.quantiles(since)
        judged = count >= self.config.min_requests
        ratios = {p.name: self._ratio(p.name, ttft_p90, tpot_p90) if judged else math.nan for p in pools}
        missing = {name: r for name, r in ratios.items() if r > 1}
        growable = [p for p in pools if p.name in missing and p.slots < p.most]
        short = max(growable, key=lambda p: missing[p.name]).name if growable else None
        last, n = self._streak
        self._streak = (short, n + 1 if short == last else 1)
        lows = {p.name for p in pools if self._low(p, ratios[p.name])}
        for p in pools:
            if p.name not in lows:
                self._low_since.pop(p.name, None)
            else:
                self._low_since.setdefault(p.name, now)
        if now - self.last_event < self.config.cooldown_s:
            return None
        latency = (f"TTFT p90 {ttft_p90 * 1000:.0f} ms (target {self.slo.ttft_ms:g}), TPOT p90 {tpot_p90 * 1000:.1f} "
                   f"ms (target {self.slo.tpot_ms:g}) over {count} requests")
        if short is not None and self._streak[1] >= CONFIRM:
            return Decision(short, "out", f"the {short} pool misses its target: {latency}")
        if missing:
            return None
        for p in sorted(pools, key=lambda p: -(p.slots - p.fewest)):
            since_low = self._low_since.get(p.name)
            if p.slots > p.fewest and p.live == p.slots and since_low is not None \
                    and now - since_low >= self.config.scale_in_after_s:
                busy = sum(p.busy) / len(p.busy)
                return Decision(p.name, "in", f"the {p.name} pool's load stayed low for "
                                f"{self.config.scale_in_after_s:g} s: its workers busy {busy:.0%} of the time, "
                                + (latency if judged else f"{count} requests in the window"))
        return None

    def acted(self, now: float) -> None:
        """An event happened now (or a scale-out failed): cooldown, and every streak starts again."""
        self.last_event = now
        self._streak = (None, 0)
        self._low_since.clear()

    def _ratio(self, pool: str, ttft_p90: float, tpot_p90: float) -> float:
        """How far the pool's own p90 is from its target (above 1: it misses)."""
        ttft, tpot = ttft_p90 / self.slo.ttft_s, tpot_p90 / self.slo.tpot_s
        if self.collocated:
            known = [r for r in (ttft, tpot) if not math.isnan(r)]
            return max(known) if known else math.nan
        return tpot if pool == "decode" else ttft

    def _low(self, pool: PoolView, ratio: float) -> bool:
        met = math.isnan(ratio) or ratio < MET_SHARE
        if not met or pool.live < 2 or len(pool.busy) < pool.live:
            return False
        return sum(pool.busy) / (pool.live - 1) < self.config.scale_in_busy
