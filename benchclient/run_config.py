"""RunConfig: one load run's settings, frozen and checked when made (benchclient.run runs it, benchclient.sender
sends it)."""

from __future__ import annotations

from dataclasses import dataclass

from benchclient.arrivals import ArrivalSpec
from benchclient.client import Target
from benchclient.stats import SLO
from benchclient.workload_spec import WorkloadSpec

MAX_CLIENT_PROCESSES = 64


@dataclass(frozen=True)
class RunConfig:
    target: Target
    workload: WorkloadSpec = WorkloadSpec()
    arrival: ArrivalSpec = ArrivalSpec(rate=1.0)
    slo: SLO = SLO()
    duration_s: float = 60.0
    warmup_s: float = 5.0
    num_requests: int | None = None   # measured requests; when set, the run sends this many instead of a duration
    timeout_s: float = 600.0          # per request, from send to [DONE]
    client_processes: int = 1         # OS processes sending the load (module docstring)

    def __post_init__(self) -> None:
        if not self.duration_s > 0 or self.warmup_s < 0 or not self.timeout_s > 0:
            raise ValueError("duration_s and timeout_s must be positive and warmup_s not negative")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be positive, got {self.num_requests}")
        n = self.client_processes
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CLIENT_PROCESSES:
            raise ValueError(f"client_processes must be an integer in [1, {MAX_CLIENT_PROCESSES}], got {n!r}")
        if not self.arrival.open_loop and n > self.arrival.concurrency:
            raise ValueError(f"client_processes ({n}) must not exceed the concurrency ({self.arrival.concurrency}): "
                             "each process keeps at least one request in flight")
