"""BackendCollector: the scrape-time half of /metrics, a prometheus_client custom Collector.

Owns the families built afresh from the backend's figures at every scrape (nothing of them is stored between
scrapes, so a dead or removed worker's gauges disappear instead of freezing at their last value; backend_stats
leaves a dead worker's engine load out): `backend.stats()` as coordinator.backend.stats shapes it (queue length,
per-worker KV usage, running, queued prompt tokens, liveness, state, bookings, the seconds of each phase of its start
(`pdserve_worker_start_seconds{worker, role, phase}`, pool_worker.start_phases), every numeric engine-load field as
`pdserve_worker_engine_<key>`, preemptions by cause (`pdserve_worker_preemptions_total{cause}`), errors, migrations,
pool downtime, prefix-affinity hits, growing bookings, the KV tiers below each worker's device cache
(`pdserve_kv_tier_*{worker, role, tier}`: hits, misses, bytes in and out, evictions, occupancy), the coordinator's
event-loop lag and stalls (`pdserve_coordinator_loop_*`) and garbage-collector pauses (`pdserve_coordinator_gc_*`),
every numeric transfer total as `pdserve_transfer_<key>`; keys ending in `_total` are counters, others gauges), the
lifecycle's requests in flight and draining flag, a count of scrapes where backend.stats() failed (the scrape itself
never fails for it), tenants' usage, and vLLM's scheduler and engine families
(coordinator.observability.vllm_engine).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from coordinator.observability.vllm_engine import vllm_families

Samples = list[tuple[dict[str, object], float]]
_WORKER_HELP = {
    "kv_usage_ratio": "Fraction of the worker's KV blocks in use", "running": "Requests running",
    "queued_prompt_tokens": "Prompt tokens queued", "free_blocks": "Free KV blocks", "total_blocks": "KV blocks",
    "requests_routed": "Requests the router sent to the worker", "alive": "1 while the worker is alive",
    "restarts_total": "Times the worker's slot was replaced after a death",
    "booked_kv_blocks": "KV blocks booked by admitted requests (prompt and output budget, grown as they decode)",
    "used_kv_blocks": "KV blocks the worker's engine holds (not free or evictable): compare booked_kv_blocks",
    "booked_prompt_tokens": "Prompt tokens booked on the worker and not yet prefilled",
    "busy_ratio": "Mode adaptive, or pools that scale: share of the planner's (the scaler's) last interval the "
                  "worker's engine spent stepping",
    "draining": "1 while an operator's drain waits for the worker's running requests (no new work routed to it)",
    "drained": "1 while the worker is drained: nothing runs there and no new work is routed to it until undrained",
    "step_time_ratio": "The worker's mean engine step time over its same-role peers' median at a similar batch, over "
                       "stragglers.window_s (0 until there is enough to compare)",
    "straggler": "1 while the worker's step_time_ratio is over stragglers.factor"}

_LOOP_HELP = {"loop_lag_seconds": "How late the coordinator's event loop runs (weighted mean lateness of a 5 ms "
                                  "timer): near 0 idle, milliseconds when every stream's work queues behind others'",
              "loop_stalls_total": "Ticks of that timer at least 10 ms late: stalls of every request on the loop",
              "loop_lag_max_seconds": "The worst lateness of that timer's ticks since start, seconds",
              "gc_pauses_total": "Garbage collections in the coordinator's process (each pauses its event loop)",
              "gc_full_collections_total": "Of those, full (generation 2) collections",
              "gc_pause_seconds_total": "Seconds the coordinator's process spent in garbage collections",
              "gc_pause_max_s": "The longest garbage-collection pause of the coordinator's process, seconds"}


class BackendCollector:
    def __init__(self, backend: Any, lifecycle: Any, tenants: Any, model_name: str) -> None:
        self.backend, self.lifecycle, self.tenants, self.model_name = backend, lifecycle, tenants, model_name
        self.stats_errors = 0

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.backend.stats()
        except Exception:  # noqa: BLE001 - a scrape must not fail because the backend's figures did
            stats, self.stats_errors = None, self.stats_errors + 1
        families = lifecycle_families(self.lifecycle) + [
            _family("pdserve_backend_stats_errors", "Scrapes where backend.stats() failed", [({}, self.stats_errors)])]
        if isinstance(stats, dict):
            families += backend_families(stats) + vllm_families(stats, self.model_name)
        usage = self.tenants.usage() if self.tenants is not None else None
        if usage:
            families += tenant_families(usage)
        seen: set[str] = set()
        for family in families:  # two stats keys that sanitize to one name: the first wins, the output stays valid
            if family.name not in seen:
                seen.add(family.name)
                yield family


def lifecycle_families(lifecycle: Any) -> list[Metric]:
    """The HTTP process's requests in flight and its draining flag."""
    return [_family("pdserve_requests_in_flight", "Requests admitted and not yet ended", [({}, lifecycle.in_flight)]),
            _family("pdserve_draining", "1 while the server refuses new requests", [({}, int(lifecycle.draining))])]


def backend_families(stats: dict) -> list[Metric]:
    out: list[Metric] = []
    queue = _number(stats.get("queue_length"))
    if queue is not None:
        out.append(_family("pdserve_queue_length", "Requests waiting for admission in the backend", [({}, queue)]))
    by_priority = stats.get("waiting_by_priority")
    if isinstance(by_priority, dict) and by_priority:
        out.append(_family("pdserve_queue_length_by_priority", "Requests waiting for admission, by priority (0 first)",
                           [({"priority": k}, v) for k, v in sorted(by_priority.items())]))
    in_flight = _number(stats.get("in_flight"))
    if in_flight is not None:
        out.append(_family("pdserve_backend_requests_in_flight", "Requests placed on workers", [({}, in_flight)]))
    per_worker: dict[str, Samples] = {key: [] for key in _WORKER_HELP}
    engine: dict[str, Samples] = {}
    preemptions: Samples = []
    start: Samples = []
    for w in (w for w in stats.get("workers") or [] if isinstance(w, dict)):
        labels = {"worker": w.get("name", "?"), "role": w.get("role", "?")}
        start += [({**labels, "phase": phase}, _number(s)) for phase, s in (w.get("start_phases_s") or {}).items()
                  if _number(s) is not None]
        free, total = _number(w.get("free_blocks")), _number(w.get("total_blocks"))
        if free is not None and total:
            per_worker["kv_usage_ratio"].append((labels, 1.0 - free / total))
        for key in _WORKER_HELP:
            value = w.get("served" if key == "requests_routed" else key)
            if _number(value) is not None or isinstance(value, bool):
                per_worker[key].append((labels, float(value)))
        if isinstance(w.get("state"), str):
            per_worker.setdefault("state", []).append(({**labels, "state": w["state"]}, 1.0))
        for key, value in (w.get("engine") or {}).items():
            if _number(value) is not None:
                engine.setdefault(key, []).append((labels, _number(value)))
            cause = re.fullmatch(r"preemptions_(\w+)_total", key)
            if cause and _number(value) is not None:
                preemptions.append(({**labels, "cause": cause.group(1)}, _number(value)))
    for key, samples in per_worker.items():
        if samples:
            out.append(_family(f"pdserve_worker_{key}", _WORKER_HELP.get(key, "1 for the worker's life-cycle state"),
                               samples))
    out += [_family(_name("pdserve_worker_engine_", key), f"The worker engine's {key}", samples)
            for key, samples in sorted(engine.items())]
    if start:
        out.append(_family("pdserve_worker_start_seconds", "Seconds each phase of the worker's last start took "
                           "(schedule, process, imports, engine_*, agent; then grammar, built once it was routable)",
                           start))
    out += tier_families(stats.get("workers") or [])
    if preemptions:
        out.append(_family("pdserve_worker_preemptions_total", "Running requests sent back to the engine's queue for "
                           "lack of KV blocks (recomputed later, or swapped to host memory and back), by cause: a "
                           "decode row or a prompt chunk needed the blocks", preemptions))
    for key, name, label, help in (
            ("migrations", "pdserve_migrations_total", "event", "Request moves after a worker, transfer or prefill "
             "failure: attempted (off a lost worker), prefill_retried (a failed prefill run whole on a decode "
             "worker: recovery.prefill_retry), and outcome_completed / outcome_failed of moved requests"),
            ("pool_down_seconds", "pdserve_pool_down_seconds_total", "pool", "Seconds each pool spent with no live "
             "worker"),
            ("fallbacks", "pdserve_fallback_placements_total", "missing", "Requests (new or moving off a dead "
             "worker) run whole on the other pool's worker while this pool (missing) had no live worker"),
            ("spare_takeovers", "pdserve_spare_takeovers_total", "pool", "Dead worker slots taken over by a warm "
             "spare of their pool (recovery.spares)"),
            ("spares_ready", "pdserve_spares_ready", "pool", "Warm spare workers ready to take over a dead slot, per "
             "pool (recovery.spares; fewer while one is being started)"),
            ("stragglers", "pdserve_stragglers_total", "event", "Workers found much slower than their peers "
             "(detected) and of those, replaced (stragglers.replace)")):
        table = stats.get(key)
        if isinstance(table, dict):
            out.append(_family(name, help, [({label: k}, _number(v)) for k, v in sorted(table.items())
                                            if _number(v) is not None]))
    loop = stats.get("coordinator")
    if isinstance(loop, dict):
        out += [_family(_name("pdserve_coordinator_", key), _LOOP_HELP.get(key, key), [({}, v)])
                for key, value in sorted(loop.items()) if (v := _number(value)) is not None]
    placements = stats.get("placements")
    if isinstance(placements, dict) and placements:
        out.append(_family("pdserve_prefill_placement_total", "Prompts prefilled remotely (on another worker, the KV "
                           "handed over) or locally (on the worker that decodes them)",
                           [({"placement": k}, v) for k, v in sorted(placements.items()) if _number(v) is not None]))
    factors = stats.get("placement_calibration")
    if isinstance(factors, dict) and factors:
        out.append(_family("pdserve_placement_estimate_factor", "Mode adaptive: what the placement model multiplies a "
                           "worker's first-token estimates by, learnt from its placements' measured first tokens",
                           [({"worker": k.rsplit("/", 1)[0], "placement": k.rsplit("/", 1)[1]}, v)
                            for k, v in sorted(factors.items()) if _number(v) is not None and "/" in k]))
    changes = stats.get("role_changes")
    if isinstance(changes, dict):
        out.append(_family("pdserve_role_changes_total", "Workers' role changes (mode adaptive), by old and new role",
                           [({"from": k.split(">")[0], "to": k.split(">")[1]}, v) for k, v in sorted(changes.items())
                            if _number(v) is not None and ">" in k]))
    scaled = stats.get("scale_events")
    if isinstance(scaled, dict):
        out.append(_family("pdserve_pool_scale_events_total", "Pools grown or shrunk by one worker (pools that scale: "
                           "min_workers / max_workers), by pool and direction: out, in, out_failed (no room or a "
                           "failed start), in_cancelled", [({"pool": k.split("/")[0], "direction": k.split("/")[1]}, v)
                                                          for k, v in sorted(scaled.items())
                                                          if _number(v) is not None and "/" in k]))
    grown = _number(stats.get("booking_grown_blocks"))
    if grown is not None:
        out.append(_family("pdserve_admission_booking_grown_blocks_total", "KV blocks added to decode bookings as "
                           "their requests decoded (growing bookings: admission.reserve_output null)", [({}, grown)]))
    bypassed = _number(stats.get("admission_bypassed"))
    if bypassed is not None:
        out.append(_family("pdserve_admission_bypassed_total", "Requests admitted ahead of a waiting request that did "
                           "not fit (admission.bypass_s)", [({}, bypassed)]))
    host_index = stats.get("prefix_index_host_blocks")
    if isinstance(host_index, dict):
        out.append(_family("pdserve_prefix_index_host_blocks", "Blocks the coordinator's prefix index says each "
                           "worker's host tier holds (from the workers' reports of what it added and evicted)",
                           [({"worker": k}, v) for k, v in sorted(host_index.items()) if _number(v) is not None]))
    hits = _number(stats.get("prefix_affinity_hits"))
    if hits is not None:
        out.append(_family("pdserve_prefix_affinity_hits_total", "Prefill routings that followed a cached prefix",
                           [({}, hits)]))
    fetches = stats.get("prefix_fetches")
    if isinstance(fetches, dict):
        out.append(_family("pdserve_prefix_fetches_total", "Prompt prefixes asked of another worker for a prefill "
                           "worker to fetch (outcome: lent, nothing held, failed; coordinator.backend.prefix_fetch)",
                           [({"outcome": k}, v) for k, v in sorted(fetches.items()) if _number(v) is not None]))
    errors = stats.get("errors")
    if isinstance(errors, dict):
        out.append(_family("pdserve_backend_errors_total", "Backend failures by kind",
                           [({"kind": k}, v) for k, v in sorted(errors.items()) if _number(v) is not None]))
    transfer = stats.get("transfer")
    if isinstance(transfer, dict):
        out += [_family(_name("pdserve_transfer_", key), f"KV transfer: {key}", [({}, v)])
                for key, value in sorted(transfer.items()) if (v := _number(value)) is not None]
    return out


_TIER_HELP = {
    "hit_blocks_total": "KV blocks of admitted prompts found in the tier (copied back, not recomputed)",
    "miss_blocks_total": "KV blocks of admitted prompts looked up in the tier and not found (recomputed)",
    "hit_tokens_total": "Tokens admitted with their KV copied back from the tier (its share of "
                        "vllm:prefix_cache_queries; a decode booking's restores count in hit_blocks only)",
    "in_bytes_total": "Bytes copied into the tier (full blocks evicted from the tier above)",
    "out_bytes_total": "Bytes copied out of the tier (prefixes restored to the device)",
    "evictions_total": "Entries the tier dropped to make room (least recently used first)",
    "dropped_total": "Blocks evicted from the tier above that the tier could not take",
    "recompute_blocks_total": "KV blocks found in the tier at admission attempts but computed: the copy would have "
                              "cost more (engine.core.copy_cost)",
    "used_bytes": "Bytes of KV the tier holds now", "capacity_bytes": "The tier's size in bytes",
    "used_blocks": "KV blocks the tier holds now", "total_blocks": "KV blocks the tier can hold"}


def tier_families(workers: list) -> list[Metric]:
    """Per worker and tier below its device cache (now: `host`, engine.core.host_tier), from its engine load's
    `host_tier_*` figures; a worker without a tier has none."""
    samples: dict[str, Samples] = {}
    for w in (w for w in workers if isinstance(w, dict)):
        engine = w.get("engine") or {}
        if not _number(engine.get("host_tier_total_blocks")):
            continue
        labels = {"worker": w.get("name", "?"), "role": w.get("role", "?"), "tier": "host"}
        for key in _TIER_HELP:
            value = _number(engine.get(f"host_tier_{key}"))
            if value is not None:
                samples.setdefault(key, []).append((labels, value))
    return [_family(f"pdserve_kv_tier_{key}", _TIER_HELP[key], samples[key]) for key in _TIER_HELP if key in samples]


def tenant_families(usage: dict[str, dict[str, float]]) -> list[Metric]:
    """Per tenant (coordinator.admission.tenants usage()): requests by outcome, tokens, refusals by its limits, in
    flight."""
    requests = [({"tenant": t, "outcome": k.removeprefix("requests_")}, v) for t, c in sorted(usage.items())
                for k, v in sorted(c.items()) if k.startswith("requests_")]
    out = [_family("pdserve_tenant_requests_total", "Ended requests per tenant and outcome", requests)]
    for key, suffix, help in (("prompt_tokens", "_total", "Prompt tokens processed per tenant"),
                              ("completion_tokens", "_total", "Tokens generated per tenant"),
                              ("rate_limited", "_total", "Requests refused by the tenant's rate limits"),
                              ("in_flight", "", "Requests in flight per tenant")):
        out.append(_family(f"pdserve_tenant_{key}{suffix}", help,
                           [({"tenant": t}, c.get(key, 0)) for t, c in sorted(usage.items())]))
    return out


def _family(name: str, help: str, samples: Samples) -> Metric:
    """A counter when the name ends in `_total` (prometheus_client keeps the suffix on its samples), else a gauge;
    the label names are the first sample's (every sample of a family has the same)."""
    names = list(samples[0][0]) if samples else []
    cls = CounterMetricFamily if name.endswith("_total") else GaugeMetricFamily
    family = cls(name, help, labels=names)
    for labels, value in samples:
        family.add_metric([str(labels[n]) for n in names], float(value))
    return family


def _number(x: object) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _name(prefix: str, key: object) -> str:
    return prefix + re.sub(r"[^a-zA-Z0-9_]", "_", str(key))
