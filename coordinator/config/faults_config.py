"""Injected failures' settings (`faults:`; coordinator.backend.drills): failed prefills, failed or stalled KV
transfers, throttled workers and workers' calls run out of order, for tests and operators' drills; also set at run
time through POST /admin/faults.

    faults: {transfer_fail_fraction: 0.1, seed: 7, slow_step_s: 0.02, slow_workers: [decode-0]}
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_STALL_S = 600.0  # an injected transfer stall longer than a request's default timeout tests nothing more
MAX_SLOW_STEP_S = 10.0  # an injected step sleep: slower than this is a hung worker (the liveness probe's to find)
MAX_CALL_JITTER_S = 5.0  # an injected wait before a worker's call: longer reorders nothing more


@dataclass(frozen=True)
class FaultsConfig:
    """Failures injected on purpose, for tests and operators' drills (also settable at run time through
    POST /admin/faults when server.admin_api is on). All off by default."""

    prefill_error_fraction: float = 0.0   # prefill calls that fail with an injected error
    transfer_fail_fraction: float = 0.0   # KV transfers that fail (the decode side then recomputes or fails)
    transfer_stall_fraction: float = 0.0  # KV transfers held back for transfer_stall_s before they proceed
    transfer_stall_s: float = 0.0
    seed: int = 0
    # a throttled worker: each engine step of the workers named (none named: every worker) sleeps this long; only the
    # processes live when it is set (a replacement is a fresh process, as a straggler's is: it is not slowed)
    slow_step_s: float = 0.0
    slow_workers: tuple[str, ...] = ()
    # calls run out of order: each request call a worker gets (prefill, booking, handoff, generate, release, abort,
    # ...) first waits a random time in [0, call_jitter_s]. Ray runs an async actor's calls in no guaranteed order
    # anyway (an abort can run before the prefill sent ahead of it); this makes that common
    call_jitter_s: float = 0.0

    def __post_init__(self) -> None:
        slow = self.slow_step_s
        if isinstance(slow, bool) or not isinstance(slow, int | float) or not 0 <= slow <= MAX_SLOW_STEP_S:
            raise ValueError(f"slow_step_s must be a number in [0, {MAX_SLOW_STEP_S:g}], got {slow!r}")
        names = self.slow_workers
        if not isinstance(names, list | tuple) or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"slow_workers must be a list of worker names, got {names!r}")
        object.__setattr__(self, "slow_workers", tuple(names))  # a JSON list (POST /admin/faults) too
        for name in ("prefill_error_fraction", "transfer_fail_fraction", "transfer_stall_fraction"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= 1:
                raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
        jitter = self.call_jitter_s
        if isinstance(jitter, bool) or not isinstance(jitter, int | float) or not 0 <= jitter <= MAX_CALL_JITTER_S:
            raise ValueError(f"call_jitter_s must be a number in [0, {MAX_CALL_JITTER_S:g}], got {jitter!r}")
        stall = self.transfer_stall_s
        if isinstance(stall, bool) or not isinstance(stall, int | float) or not 0 <= stall <= MAX_STALL_S:
            raise ValueError(f"transfer_stall_s must be a number in [0, {MAX_STALL_S:g}], got {stall!r}")
        seed = self.seed  # the workers' fault RNGs take an integer: NaN, inf, a string or a bool is refused here
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r:.40}")

