"""backend_stats: the RayBackend's figures as the plain dict that /metrics renders (coordinator.observability.metrics).

Per worker: its state, restarts, bookings, drain (coordinator.backend.drains) and step-time ratio to its peers
(coordinator.backend.stragglers) always; its last reported engine load (every numeric EngineLoad field, its
tokens-per-step histogram's counts, and the KV blocks its requests use, to compare with those booked) only while it
is live, so a dead worker's gauges disappear instead of freezing at their last value. Backend-wide: the admission
queue's length (requests waiting for room, not those running), requests in flight, errors and migrations by kind,
blocks added to growing bookings, seconds each pool spent with no live worker, scale events by pool and direction,
transfer totals of the live agents, and the coordinator's event-loop lag and stalls (coordinator.observability.loop_lag)
and its process's garbage-collector pauses. `start_phases` is each worker's start, phase by phase (also in /health).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any


def backend_stats(backend: Any) -> dict:
    supervisor, ledger = backend.supervisor, backend.ledger
    workers = []
    for w in backend.pools.all_workers:
        entry = {"name": w.name, "role": w.role, "state": w.state, "alive": w.alive,
                 "restarts_total": supervisor.restarts.get(w.name, 0), "served": w.served,
                 "booked_kv_blocks": ledger.booked(w.key, "kv_blocks"),
                 "booked_prompt_tokens": ledger.booked(w.key, "prompt_tokens"), "total_blocks": w.info.num_kv_blocks,
                 "draining": int(backend.drains.state(w.name) == "draining"),
                 "drained": int(backend.drains.state(w.name) == "drained"),
                 "step_time_ratio": backend.stragglers.ratios.get(w.name, 0.0) if w.alive else 0.0,
                 "straggler": int(w.alive and backend.stragglers.slow_now(w.name))}
        if backend.adaptive is not None and w.name in backend.adaptive.planner.busy:
            entry["busy_ratio"] = backend.adaptive.planner.busy[w.name]  # the planner's last look
        elif backend.scaler is not None and w.name in backend.scaler.meter.busy:
            entry["busy_ratio"] = backend.scaler.meter.busy[w.name]  # the scaler's (pools that scale)
        entry["start_phases_s"] = start_phases(w)
        if w.alive and w.load is not None:
            load = asdict(w.load)
            load.pop("taken_at_s")  # a time on the worker's own clock: nothing to export
            entry |= {"queued_prompt_tokens": load.pop("queued_prompt_tokens"), "running": load.pop("num_running"),
                      "free_blocks": load.pop("free_blocks"), "total_blocks": load.pop("total_blocks")}
            entry["used_kv_blocks"] = entry["total_blocks"] - entry["free_blocks"]
            entry["iteration_token_counts"] = list(load.pop("iteration_token_counts"))  # a histogram's (vllm_engine)
            entry["engine"] = {k: v for k, v in load.items() if isinstance(v, int | float)}
        workers.append(entry)
    admission = backend.admission
    return {"workers": workers, "transfer": dict(backend.transfer_totals),
            "queue_length": len(admission.queue) if admission else 0, "in_flight": len(backend._ids),
            "waiting_by_priority": admission.queue.waiting_by_priority() if admission else {},
            "admission_bypassed": admission.queue.bypassed if admission else 0,
            "booking_grown_blocks": backend.growth.grown_blocks if backend.growth is not None else 0,
            "errors": dict(backend.errors), "migrations": dict(backend.migrations),
            "pool_down_seconds": supervisor.downtime_s(),
            "stragglers": {"detected": backend.stragglers.detected, "replaced": backend.stragglers.replaced},
            "prefix_affinity_hits": admission.router.affinity_hits if admission else 0,
            "prefix_fetches": dict(backend.prefix_fetches),
            "prefix_index_host_blocks": admission.router.host_blocks() if admission else {},
            "placements": dict(admission.placements) if admission else {},
            "fallbacks": dict(admission.fallbacks) if admission else {},
            "spare_takeovers": dict(backend.spares.taken),
            "spares_ready": {pool: len(ready) for pool, ready in backend.spares.ready.items()},
            "placement_calibration": admission.placement.calibration.factors()
            if admission and admission.placement else {},
            "role_changes": {f"{a}>{b}": n for (a, b), n in backend.adaptive.role_changes.items()}
            if backend.adaptive else {},
            "scale_events": {f"{pool}/{direction}": n for (pool, direction), n in backend.scaler.counts.items()}
            if backend.scaler else {},
            "coordinator": backend.loop_lag.stats() | backend.gc_pauses.figures()}


def start_phases(worker: Any) -> dict[str, float]:
    """Seconds per phase of the worker's start (pool_worker.start_phases), in order: those it reported when it
    started, then `grammar` and `graphs` once their background work has ended (from its load reports: the
    structured-output tables, the CUDA graphs captured while serving)."""
    phases = dict(worker.info.startup_s)
    if worker.load is not None and worker.load.grammar_load_s:
        phases["grammar"] = round(worker.load.grammar_load_s, 3)
    if worker.load is not None and worker.load.graph_capture_s:
        phases["graphs"] = round(worker.load.graph_capture_s, 3)
    return phases


def transfer_totals(snapshots: list[dict]) -> dict[str, float]:
    """Add the agents' snapshots into pool-wide figures: top-level numbers, and per operation
    `<op>_<count|bytes|seconds_sum|failures>` (summed) and `<op>_seconds_max` (max)."""
    totals: dict[str, float] = {}
    for metrics in snapshots:
        flat = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
        for op, fields in (metrics.get("ops") or {}).items():
            flat |= {f"{op}_{k}": v for k, v in fields.items() if isinstance(v, int | float)}
        for key, value in flat.items():
            totals[key] = max(totals.get(key, 0), value) if key.endswith("_max") else totals.get(key, 0) + value
    return totals
