"""AdaptiveLayout: what the Ray backend adds in `mode: adaptive`: workers' roles that change while serving, and
the measurements placement and the planner decide by.

Owns the roles' changes (by the planner, coordinator.backend.planner, or an operator: `set_role`), each logged
and counted (`role_changes`, /metrics `pdserve_role_changes_total{from,to}`), the window of recent requests'
latencies the planner judges by, and what each ended request teaches placement: the handoff's measured seconds
per token (PlacementModel.observe_transfer), how far each placement's estimate was from its first token
(PlacementModel.observe_first_token) and which worker's prefix cache now holds the request's tokens
(Router.remember). A role change is routing only: the worker keeps running what it runs (every worker can prefill
and decode), so it loses nothing; it races nothing either, since a role belongs to the slot and a replacement
comes back in it (Supervisor).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from coordinator.admission.admission import Admission
from coordinator.admission.placement import Choice
from coordinator.admission.router import WorkerState
from coordinator.backend.planner import ROLES, Planner
from coordinator.config.serve_config import ServeConfig
from coordinator.observability.latency_window import LatencyWindow

log = logging.getLogger("pdserve")


class AdaptiveLayout:
    def __init__(self, config: ServeConfig, admission: Admission, workers: Callable[[], list[WorkerState]],
                 pressure: Callable[[WorkerState], float], on_change: Callable[[], None]) -> None:
        self.admission = admission
        self.window = LatencyWindow(config.planner.window_s)
        self.role_changes: dict[tuple[str, str], int] = {}  # (from, to) -> changes
        self._workers = workers
        self._on_change = on_change  # capacity moved: waiting requests look again
        self.planner = Planner(config.planner, config.slo, workers, self.window, self._apply, pressure)

    def set_role(self, name: str, role: str, why: str) -> bool:
        """An operator's role change for worker `name` (False: no such worker). ValueError for an unknown role or
        one that would leave no live worker decoding."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        worker = next((w for w in self._workers() if w.name == name), None)
        if worker is None:
            return False
        if role == "prefill" and worker.alive and not any(
                w.alive and w.role != "prefill" for w in self._workers() if w is not worker):
            raise ValueError(f"{name} is the last live worker that decodes: it cannot become a prefill worker")
        if worker.role != role:
            self._apply(worker, role, why)
        return True

    def request_ended(self, started_at: float, first_at: float | None, tokens: int) -> None:
        """A request that streamed `tokens` tokens, its first at `first_at` (monotonic seconds) ended now."""
        if first_at is None:
            return
        now = time.monotonic()
        self.window.add(now, first_at - started_at, (now - first_at) / (tokens - 1) if tokens > 1 else None)

    def first_token(self, choice: Choice, seconds: float) -> None:
        """A request placed by `choice` had its first token `seconds` after its placement."""
        self.admission.placement.observe_first_token(choice, seconds)

    def handed_over(self, tokens: int, seconds: float) -> None:
        """A remote prefill's KV of `tokens` prompt tokens reached its decode worker in `seconds`."""
        self.admission.placement.observe_transfer(tokens, seconds)

    def _apply(self, worker: WorkerState, role: str, why: str) -> None:
        key = (worker.role, role)
        log.warning("worker %s: role %s -> %s (%s)", worker.name, worker.role, role, why)
        worker.role = role
        self.role_changes[key] = self.role_changes.get(key, 0) + 1
        self._on_change()
