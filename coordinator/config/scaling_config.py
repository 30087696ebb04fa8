"""The pools' scaling settings (`scaling`): how the scaler (coordinator.backend.scaler) judges when to add a worker to
a pool or remove one. A pool scales when its `min_workers` or `max_workers` (PoolConfig) differs from its `workers`
(the starting size); the section applies only then, and then `slo` is required (the targets a pool is grown for):
coordinator.config.config_checks checks both.

    decode: {workers: 1, min_workers: 1, max_workers: 4}
    slo: {ttft_ms: 500, tpot_ms: 40}
    scaling: {window_s: 30, cooldown_s: 30, scale_in_after_s: 120, scale_in_busy: 0.3, placement_timeout_s: 300}
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_POOL_WORKERS = 256  # per pool: a bound on max_workers (a typo of 10000 would ask a cluster for 10000 GPUs)


def _number(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not (low < value if low_open else low <= value) or not value <= high:
        raise ValueError(f"{name} must be a number in {'(' if low_open else '['}{low:g}, {high:g}], got {value!r}")


@dataclass(frozen=True)
class ScalingConfig:
    """When a pool grows or shrinks (one worker at a time, the whole fleet one event at a time)."""

    window_s: float = 30.0        # the requests judged: those that ended within this many seconds (and after the
    #                               last scale event)
    min_requests: int = 8         # fewer requests in the window: no pool misses its target
    cooldown_s: float = 30.0      # after a scale event, how long before the next (its effect must show first)
    scale_in_after_s: float = 120.0  # a pool's load low for this long, look after look, before one worker is removed
    # low: its requests meet their target and its workers would stay busy under this share of the time with one fewer
    scale_in_busy: float = 0.3
    placement_timeout_s: float = 300.0  # how long a new worker may wait for room (a node the autoscaler adds)

    def __post_init__(self) -> None:
        _number("window_s", self.window_s, 0, 3600, low_open=True)
        if isinstance(self.min_requests, bool) or not isinstance(self.min_requests, int) or self.min_requests < 1:
            raise ValueError(f"min_requests must be an integer >= 1, got {self.min_requests!r}")
        _number("cooldown_s", self.cooldown_s, 0, 3600)
        _number("scale_in_after_s", self.scale_in_after_s, 0, 86400)
        _number("scale_in_busy", self.scale_in_busy, 0, 1, low_open=True)
        _number("placement_timeout_s", self.placement_timeout_s, 0, 3600, low_open=True)
