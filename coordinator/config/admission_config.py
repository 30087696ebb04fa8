"""Admission's settings (`admission:`; coordinator.admission): how many requests may be in flight, how long one may
wait for room, how much of a request's output is booked (up front or growing), the prefill backlog, priorities'
aging and reserved share, and how long a waiting request may be passed by ones behind it.

    admission: {max_queue: 1024, timeout_s: 30, reserve_output: null, reserve_ahead_tokens: 64, bypass_s: 5}
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionConfig:
    max_queue: int = 1024          # requests in flight beyond which new ones get 503
    timeout_s: float = 30.0        # how long a request may wait for room (or for a replacement worker)
    # null (growing bookings): a decode worker books the prompt and reserve_ahead_tokens of output, and the booking
    # grows as the request decodes (coordinator.admission.growth; the engine preempts when blocks run out). A number:
    # that fraction of max_tokens booked up front and never grown; 1.0 never oversubscribes (no preemption)
    reserve_output: float | None = None
    reserve_ahead_tokens: int = 64  # growing bookings: output tokens booked beyond those a request has generated
    max_prefill_backlog_tokens: int | None = None  # per prefill worker: prompt tokens booked and not yet prefilled
    priority_aging_s: float = 10.0  # a waiting request moves up one priority class per this many seconds
    reserved_for_high: float = 0.0  # share of each worker's KV and prefill backlog only high-priority requests book
    # a waiting request that does not fit may be passed by ones behind it that do for this long after it arrived;
    # then what frees is kept for it (no head-of-line blocking, no starvation; 0: strict head of line)
    bypass_s: float = 5.0

    def __post_init__(self) -> None:
        if self.reserve_output is not None and not 0 < self.reserve_output <= 1:
            raise ValueError(f"reserve_output must be null (growing bookings) or in (0, 1], got {self.reserve_output}")
        if isinstance(self.reserve_ahead_tokens, bool) or not isinstance(self.reserve_ahead_tokens, int) \
                or self.reserve_ahead_tokens < 1:
            raise ValueError(f"reserve_ahead_tokens must be an integer >= 1, got {self.reserve_ahead_tokens!r}")
        if self.max_prefill_backlog_tokens is not None and self.max_prefill_backlog_tokens < 1:
            raise ValueError(f"max_prefill_backlog_tokens must be >= 1, got {self.max_prefill_backlog_tokens}")
        if not 0 <= self.reserved_for_high < 1:
            raise ValueError(f"reserved_for_high must be in [0, 1), got {self.reserved_for_high}")
        if not self.priority_aging_s > 0:
            raise ValueError(f"priority_aging_s must be > 0, got {self.priority_aging_s}")
        if not 0 <= self.bypass_s <= 3600:
            raise ValueError(f"bypass_s must be in [0, 3600], got {self.bypass_s}")

