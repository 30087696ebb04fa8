"""EstimateCalibration: how far each placement estimate has been from the first tokens it predicted.

The placement model (coordinator.admission.placement) estimates each side's time to a prompt's first token from
measured rates (seconds per prompt token, decode step time) and the tokens queued there. Those rates come from the
engine's own steps, so they miss what a request meets around them: a saturated prefill worker's queue of Ray calls,
the scheduler's order, a transfer's waits, the stream back. Measured on 2 H200s (docs/benchmark-log.md, adaptive
500 ms / 15 ms at 16 req/s), remote first tokens came 3-5x later than estimated, and placement kept sending prompts
remote.

This class learns, per worker and per side ("local": the decode worker prefills it; "remote": a prefill worker does),
the ratio of each placement's measured time to its first token over the model's raw estimate, as an exponentially
weighted mean of its logarithm (a ratio of 4 and one of 1/4 weigh alike), and scales later estimates for that
worker and side by it. A ratio is learnt only from estimates large enough to carry signal (MIN_ESTIMATE_S, so a
fixed few milliseconds of overhead on an empty queue do not turn into a factor) and is clamped to [1/MAX_RATIO,
MAX_RATIO] so one outlier (a worker's death, a pause) cannot lock a side out. Only numbers go in.
"""

from __future__ import annotations

import math

MIN_ESTIMATE_S = 0.02  # raw estimates below this teach nothing: fixed overheads dominate them
MAX_RATIO = 8.0        # one observation's ratio is clamped to [1/MAX_RATIO, MAX_RATIO]
WEIGHT = 0.2           # the newest observation's weight in the mean


class EstimateCalibration:
    def __init__(self) -> None:
        self._log_ratio: dict[tuple[str, str], float] = {}  # (worker, "local" | "remote") -> mean log(actual/raw)
        self.observations: dict[tuple[str, str], int] = {}

    def observe(self, worker: str, side: str, raw_s: float, actual_s: float) -> None:
        """A placement on `worker`'s `side` whose raw estimate was `raw_s` had its first token after `actual_s`."""
        if not (MIN_ESTIMATE_S <= raw_s < math.inf) or not (actual_s >= 0):
            return
        ratio = min(max(actual_s / raw_s, 1 / MAX_RATIO), MAX_RATIO)
        key = (worker, side)
        old = self._log_ratio.get(key)
        self._log_ratio[key] = math.log(ratio) if old is None else (1 - WEIGHT) * old + WEIGHT * math.log(ratio)
        self.observations[key] = self.observations.get(key, 0) + 1

    def factor(self, worker: str, side: str) -> float:
        """What `worker`'s raw estimates on `side` are multiplied by (1.0 before any observation)."""
        return math.exp(self._log_ratio.get((worker, side), 0.0))

    def scaled(self, worker: str, side: str, raw_s: float) -> float:
        return raw_s * self.factor(worker, side)

    def factors(self) -> dict[str, float]:
        """Every learnt factor, keyed "worker/side" (for /metrics)."""
        return {f"{w}/{s}": round(math.exp(v), 4) for (w, s), v in sorted(self._log_ratio.items())}
