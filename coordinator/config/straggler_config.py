"""The straggler watch's settings (`stragglers:`; coordinator.backend.stragglers): how a worker that steps much
slower than its peers on the same shape of work is found, and whether it is replaced.

    stragglers: {enabled: true, replace: true, factor: 3.0, window_s: 30, min_steps: 20, drain_timeout_s: 60}
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _in_range(name: str, value: object, least: float, most: float, open_low: bool = True) -> None:
    low_ok = (lambda v: v > least) if open_low else (lambda v: v >= least)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not low_ok(value) or value > most:
        raise ValueError(f"{name} must be a number in {'(' if open_low else '['}{least:g}, {most:g}], got {value!r}")


@dataclass(frozen=True)
class StragglerConfig:
    """A worker whose mean step time over the last `window_s`, at a similar batch (tokens per step within a
    power of two), is over `factor` times its same-role peers' median, each side with at least `min_steps` steps
    there, is a straggler: logged and exported (pdserve_worker_straggler, pdserve_worker_step_time_ratio,
    pdserve_stragglers_total); with `replace`, drained (its requests get `drain_timeout_s` to finish, then move)
    and replaced. `enabled: false` turns the watch off."""

    enabled: bool = True
    replace: bool = False  # off by default: turn it on where workers do not share their CPUs or GPUs
    factor: float = 3.0
    window_s: float = 30.0
    min_steps: int = 20
    drain_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("enabled", "replace"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        _in_range("factor", self.factor, 1.0, 1000.0)
        _in_range("window_s", self.window_s, 0.0, 3600.0)
        _in_range("drain_timeout_s", self.drain_timeout_s, 0.0, 3600.0)
        if isinstance(self.min_steps, bool) or not isinstance(self.min_steps, int) or not 1 <= self.min_steps <= 10**6:
            raise ValueError(f"min_steps must be an integer in [1, 1000000], got {self.min_steps!r}")
