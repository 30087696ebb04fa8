"""Counters an agent keeps about its transfers, for the pools' /metrics endpoint.

`TransferMetrics` is owned by one agent, written from its event-loop thread and read from any thread
(`snapshot()` returns a plain dict copy). Injected faults (kvtransfer.faults) are counted like real failures,
and also by kind in `injected_faults`, so a drill can tell them apart from real ones. Latencies are kept as
a sum and a count per operation plus the maximum, which is what a Prometheus summary needs; no unbounded lists.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class _OpStats:
    count: int = 0
    bytes: int = 0
    seconds_sum: float = 0.0
    seconds_max: float = 0.0
    failures: int = 0


@dataclass
class TransferMetrics:
    """Thread-safe counters: per operation ("read", "write", "serve_read", "serve_write", "notify")."""

    _ops: dict[str, _OpStats] = field(default_factory=dict)
    _failures_by_kind: dict[str, int] = field(default_factory=dict)
    _injected: dict[str, int] = field(default_factory=dict)
    _injected_failures: int = 0
    _handshakes: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record_ok(self, op: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            s = self._ops.setdefault(op, _OpStats())
            s.count += 1
            s.bytes += nbytes
            s.seconds_sum += seconds
            s.seconds_max = max(s.seconds_max, seconds)

    def record_failure(self, op: str, error: BaseException, injected: bool = False) -> None:
        """A failed operation; `injected`: the failure was caused by fault injection."""
        with self._lock:
            self._ops.setdefault(op, _OpStats()).failures += 1
            kind = type(error).__name__
            self._failures_by_kind[kind] = self._failures_by_kind.get(kind, 0) + 1
            self._injected_failures += injected

    def record_injected(self, kind: str) -> None:
        """A transfer got an injected fault: "fail", "stall" (however it ended) or "drop" (it failed because
        its peer was dropped by injection)."""
        with self._lock:
            self._injected[kind] = self._injected.get(kind, 0) + 1

    def record_handshake(self, outcome: str) -> None:
        """A connection attempt's outcome (kvtransfer.backends.ucx_handshake.with_retries): "connected",
        "retried" (timed out or broke, tried again), "refused" (nothing listens) or "failed" (retries used up)."""
        with self._lock:
            self._handshakes[outcome] = self._handshakes.get(outcome, 0) + 1

    def snapshot(self) -> dict:
        """{"ops": {op: {count, bytes, seconds_sum, seconds_max, failures}}, "failures": {kind: n},
        "bytes_total": int, "failures_total": int, "injected_faults": {"fail"|"stall"|"drop": n},
        "injected_faults_total": int, "injected_failures_total": int (the failures injection caused; real
        failures = failures_total - injected_failures_total), "handshakes": {"connected"|"retried"|"refused"|
        "failed": n}, "handshake_retries_total": int}."""
        with self._lock:
            ops = {k: dict(vars(v)) for k, v in self._ops.items()}
            fails = dict(self._failures_by_kind)
            injected = dict(self._injected)
            injected_failures = self._injected_failures
            handshakes = {k: self._handshakes.get(k, 0) for k in ("connected", "retried", "refused", "failed")}
        return {
            "ops": ops,
            "failures": fails,
            "bytes_total": sum(o["bytes"] for o in ops.values()),
            "failures_total": sum(fails.values()),
            "injected_faults": injected,
            "injected_faults_total": sum(injected.values()),
            "injected_failures_total": injected_failures,
            "handshakes": handshakes,
            "handshake_retries_total": handshakes["retried"],
        }
