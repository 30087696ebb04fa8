"""BusyMeter: each worker's share of time its engine spent stepping, from its load reports (EngineLoad's
step_time_total_s: with overlapped steps, about the device's busy time), as the adaptive planner
(coordinator.backend.planner) and the pools' scaler (coordinator.backend.scaler) judge how loaded a worker is.

Timed by the reports' own clock where they carry one: a report can be seconds old when a look reads it (a prefill
worker's comes with its replies), and the look's clock would count that staleness as idle time. A worker with no newer
report keeps its last figure; a worker never measured has none (its caller decides what unknown means).
"""

from __future__ import annotations

from coordinator.admission.router import WorkerState


class BusyMeter:
    def __init__(self) -> None:
        self._stepped: dict[str, tuple[float, float]] = {}  # worker key -> (report's time, step seconds then)
        self.busy: dict[str, float] = {}  # worker name -> share of the time between its last two reports it stepped

    def measure(self, workers: list[WorkerState], now: float) -> None:
        """Take each live worker's newest report into its figure."""
        for w in workers:
            if not w.alive or w.load is None:
                continue
            stepped, at = w.load.step_time_total_s, w.load.taken_at_s or now
            last = self._stepped.get(w.key)
            if last is not None and at <= last[0]:
                continue  # no newer report since the last look
            self._stepped[w.key] = (at, stepped)
            if last is not None and stepped >= last[1]:  # (a warm-up's reset moves it back: no figure then)
                self.busy[w.name] = min(1.0, (stepped - last[1]) / (at - last[0]))

    def forget(self, worker: WorkerState) -> None:
        """A worker removed from its pool: no figure of it is kept."""
        self._stepped.pop(worker.key, None)
        self.busy.pop(worker.name, None)
