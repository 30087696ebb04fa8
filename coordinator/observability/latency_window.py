"""LatencyWindow: the time to first token and time per output token of the requests that ended recently, as the
adaptive layout's planner judges the pools by (coordinator.backend.planner). Kept for `horizon_s` seconds of
requests, at most `max_samples` of them; only the event loop uses it.
"""

from __future__ import annotations

import math
from collections import deque


class LatencyWindow:
    def __init__(self, horizon_s: float, max_samples: int = 10_000) -> None:
        self.horizon_s = horizon_s
        self._samples: deque[tuple[float, float, float | None]] = deque(maxlen=max_samples)  # (ended, ttft, tpot)

    def add(self, ended_at: float, ttft_s: float, tpot_s: float | None) -> None:
        """A request that ended at `ended_at` (monotonic seconds); tpot_s None: it had one output token."""
        self._samples.append((ended_at, ttft_s, tpot_s))
        while self._samples and self._samples[0][0] < ended_at - self.horizon_s:
            self._samples.popleft()

    def quantiles(self, since: float, q: float = 0.9) -> tuple[int, float, float]:
        """(requests that ended since `since`, their TTFT's and their TPOT's q-quantile; nan where none)."""
        ttfts = sorted(t for at, t, _ in self._samples if at >= since)
        tpots = sorted(p for at, _, p in self._samples if at >= since and p is not None)
        return len(ttfts), _quantile(ttfts, q), _quantile(tpots, q)


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    return values[min(len(values) - 1, int(q * len(values)))]
