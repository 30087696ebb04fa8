"""Arrival processes: when each request is sent.

Owns `ArrivalSpec` and `send_times`. Open loop: `poisson` (exponential gaps at `rate` requests/s) or `gamma`
(gamma gaps with the same mean; `burstiness` is the shape: < 1 burstier than Poisson, > 1 more regular, 1 is
Poisson). Closed loop: `concurrency` keeps exactly `concurrency` requests in flight (the driver in run.py owns
that loop; here it only names the load). Open-loop senders never wait for replies, so a slow server sees the
offered load, not a politely reduced one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("poisson", "gamma", "concurrency")


@dataclass(frozen=True)
class ArrivalSpec:
    kind: str = "poisson"
    rate: float | None = None        # requests/s, open loop
    burstiness: float = 1.0          # gamma shape
    concurrency: int | None = None   # closed loop
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"arrival kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "concurrency":
            if not isinstance(self.concurrency, int) or self.concurrency < 1:
                raise ValueError(f"concurrency must be a positive integer, got {self.concurrency!r}")
        elif not isinstance(self.rate, (int, float)) or isinstance(self.rate, bool) or not self.rate > 0:
            raise ValueError(f"{self.kind} arrivals need a positive rate (requests/s), got {self.rate!r}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be positive, got {self.burstiness!r}")

    @property
    def open_loop(self) -> bool:
        return self.kind != "concurrency"

    @property
    def label(self) -> str:
        """Short name of the load for tables and plots."""
        if self.kind == "concurrency":
            return f"concurrency={self.concurrency}"
        return f"rate={self.rate:g}" + ("" if self.kind == "poisson" else f",gamma={self.burstiness:g}")


def send_times(spec: ArrivalSpec, horizon_s: float, limit: int | None = None) -> list[float]:
    """Offsets (s from the start) of the open-loop sends in [0, horizon_s), at most `limit` of them.
    The first request goes at 0."""
    if not spec.open_loop:
        raise ValueError("closed-loop (concurrency) arrivals have no schedule")
    rng = random.Random(spec.seed)
    shape = 1.0 if spec.kind == "poisson" else spec.burstiness
    scale = 1.0 / (shape * spec.rate)  # mean gap = shape * scale = 1 / rate
    times, t = [], 0.0
    while t < horizon_s and (limit is None or len(times) < limit):
        times.append(t)
        t += rng.gammavariate(shape, scale)
    return times
