"""The adaptive layout's settings (`mode: adaptive`): the service-level targets it serves (`slo`) and the planner
that moves workers' roles (`planner`). Both sections belong to the adaptive mode only; a static mode refuses them
(coordinator.config.config_checks checks it), since nothing there would read them.

    mode: adaptive
    slo: {ttft_ms: 500, tpot_ms: 40}     # time to first token; time per output token after it
    planner: {interval_s: 2, cooldown_s: 10, window_s: 10, min_requests: 8}
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# a decode step's share of the time-per-token target: the rest is the coordinator's and the stream's part of a
# token's time, and the step times' spread around their running average
DECODE_STEP_SHARE = 0.85


def _positive(name: str, value: object, most: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not 0 < value <= most:
        raise ValueError(f"{name} must be a number in (0, {most:g}], got {value!r}")


@dataclass(frozen=True)
class SLOConfig:
    """The targets a request must meet to count towards goodput: what placement and the planner serve. Both are
    required: a target left out would be a guess the planner then serves (it once was a silent 40 ms)."""

    ttft_ms: float
    tpot_ms: float

    def __post_init__(self) -> None:
        _positive("ttft_ms", self.ttft_ms, 600_000)
        _positive("tpot_ms", self.tpot_ms, 60_000)

    @property
    def ttft_s(self) -> float:
        return self.ttft_ms / 1000

    @property
    def tpot_s(self) -> float:
        return self.tpot_ms / 1000

    @property
    def decode_step_target_s(self) -> float:
        """What a decode step may take (EngineConfig.decode_step_target_s of every adaptive worker)."""
        return self.tpot_s * DECODE_STEP_SHARE


@dataclass(frozen=True)
class PlannerConfig:
    """How the planner (coordinator.backend.planner) watches the measured latencies and moves roles."""

    # false: roles stay as started (but for one: with no live worker decoding, another becomes mixed at once);
    # placement still chooses per request
    enabled: bool = True
    interval_s: float = 2.0    # how often it looks
    cooldown_s: float = 10.0   # after a role change, how long before the next (its effect must show first)
    window_s: float = 10.0     # the requests it judges by: those that ended within this many seconds
    min_requests: int = 8      # fewer requests in the window: no judgement

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"enabled must be true or false, got {self.enabled!r}")
        _positive("interval_s", self.interval_s, 3600)
        _positive("window_s", self.window_s, 3600)
        if isinstance(self.cooldown_s, bool) or not isinstance(self.cooldown_s, int | float) \
                or not 0 <= self.cooldown_s <= 3600:
            raise ValueError(f"cooldown_s must be a number in [0, 3600], got {self.cooldown_s!r}")
        if isinstance(self.min_requests, bool) or not isinstance(self.min_requests, int) or self.min_requests < 1:
            raise ValueError(f"min_requests must be an integer >= 1, got {self.min_requests!r}")
