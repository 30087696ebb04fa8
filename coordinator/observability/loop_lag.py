"""LoopLag: how far behind the coordinator's event loop runs, for /metrics.

The coordinator is one event loop: every stream's parsing, admission, Ray calls, tokens and socket writes run on it
in arrival order, whatever the request's priority. When it saturates, each of a request's loop hops waits behind
the others' work, and that shows here before it shows in latencies: a timer asks to fire every `period_s`, and each
tick's lateness (the loop was busy past its due time) goes into an exponentially weighted mean (weight `alpha`: a
time constant of period / alpha), exported as `pdserve_coordinator_loop_lag_seconds`. The mean hides a single long
stall (a full garbage collection, one slow callback) that delays every request arriving meanwhile, so the ticks at
least STALL_S late are also counted (`pdserve_coordinator_loop_stalls_total`) and the worst tick's lateness since
start kept (`pdserve_coordinator_loop_lag_max_seconds`). Runs on the loop's thread.
"""

from __future__ import annotations

import asyncio

PERIOD_S = 0.005
ALPHA = 0.1  # time constant ~50 ms at the default period: one slow callback barely moves it, a saturated loop does
STALL_S = 0.01


class LoopLag:
    def __init__(self, period_s: float = PERIOD_S, alpha: float = ALPHA) -> None:
        self.period_s = period_s
        self.alpha = alpha
        self.mean_s = 0.0  # weighted mean lateness of the ticks
        self.stalls = 0    # ticks at least STALL_S late
        self.max_s = 0.0   # the worst tick's lateness since start
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

    def observe(self, lateness_s: float) -> None:
        """Fold one tick's lateness into the mean (the timer calls it; tests may too)."""
        self.mean_s += self.alpha * (lateness_s - self.mean_s)
        self.stalls += lateness_s >= STALL_S
        self.max_s = max(self.max_s, lateness_s)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        self.observe(max(0.0, now - self._due))
        self._due = now + self.period_s
        self._handle = loop.call_at(self._due, self._tick, loop)

    def stats(self) -> dict[str, float]:
        return {"loop_lag_seconds": self.mean_s, "loop_stalls_total": self.stalls, "loop_lag_max_seconds": self.max_s}
