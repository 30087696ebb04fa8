"""LoopLag: how far behind the coordinator's event loop runs, and whether it is too busy to take bulk work.

The coordinator is one event loop: every stream's parsing, admission, Ray calls, tokens and socket writes run on it
in arrival order, and priority cannot reorder them. When a flood keeps it saturated, each of a high-priority
request's dozen loop hops waits behind the flood's work. Admission therefore treats the loop's headroom as capacity,
like KV blocks: while the loop is busy, requests below the high class wait in the priority queue
(coordinator.admission), where a waiting request costs the loop nothing per token.

Owns the estimate: a timer that asks to fire every `period_s`; each tick's lateness (the loop was busy past its due
time) goes into an exponentially weighted mean (weight `alpha`, a time constant of period / alpha). `busy` turns on
when the mean exceeds `limit_s` and off when it falls below half of that (hysteresis, so admission does not flap);
`on_idle` runs when it turns off (waiting requests look again). Runs on the event loop's thread only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

PERIOD_S = 0.005
ALPHA = 0.1  # time constant ~50 ms at the default period: one slow callback does not count, a saturated loop does


class LoopLag:
    def __init__(self, limit_s: float | None, on_idle: Callable[[], None] = lambda: None,
                 period_s: float = PERIOD_S, alpha: float = ALPHA) -> None:
        if limit_s is not None and not limit_s > 0:
            raise ValueError(f"LoopLag.limit_s must be > 0 or None, got {limit_s!r}")
        self.limit_s = limit_s  # None: measure only, never busy
        self.period_s = period_s
        self.alpha = alpha
        self.mean_s = 0.0       # weighted mean lateness of the ticks
        self.busy = False
        self.busy_s = 0.0       # seconds spent busy since start (between the ticks that saw it), for metrics
        self._on_idle = on_idle
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._due = loop.time() + self.period_s
        self._handle = loop.call_at(self._due, self._tick, loop)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def observe(self, lateness_s: float, elapsed_s: float = 0.0) -> None:
        """Fold one tick's lateness into the mean and update `busy`; `elapsed_s` since the previous tick (the timer
        calls it; tests may too)."""
        self.mean_s += self.alpha * (lateness_s - self.mean_s)
        if self.limit_s is None:
            return
        if self.busy:
            self.busy_s += elapsed_s
            if self.mean_s < self.limit_s / 2:
                self.busy = False
                self._on_idle()
        elif self.mean_s > self.limit_s:
            self.busy = True

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        self.observe(max(0.0, now - self._due), now - self._due + self.period_s)
        self._due = now + self.period_s
        self._handle = loop.call_at(self._due, self._tick, loop)

    def stats(self) -> dict[str, float]:
        return {"loop_lag_seconds": self.mean_s, "loop_busy": float(self.busy),
                "loop_busy_seconds_total": self.busy_s}
