"""Metrics: the coordinator's Prometheus text exposition (format 0.0.4), written by hand (no client library).

Owns the request-side figures as the client sees them: time to first token, inter-token latency (one observation
per backend delta after the first), end-to-end latency, requests by outcome, errors by kind, tokens; and, at each
scrape, the backend's load from `backend.stats()`: queue length, per-worker KV usage, running, queued prompt
tokens and liveness, stats["errors"] ({kind: count}) as a counter, stats["prefix_affinity_hits"], and every numeric
entry of stats["transfer"] as `pdserve_transfer_<key>` (keys ending in `_total` are counters, others gauges).
One instance per app (app.state.metrics), used from the event loop only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
OUTCOMES = ("finished", "aborted", "failed", "timeout", "rejected")


def _fmt(v: float) -> str:
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return str(int(v)) if v.is_integer() and abs(v) < 1e15 else repr(v)


def _label_value(v: object) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, object]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_label_value(v)}"' for k, v in labels.items()) + "}"


class Histogram:
    def __init__(self, name: str, help: str, buckets: Iterable[float]) -> None:
        self.name, self.help = name, help
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        i = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, n in zip((*self.buckets, math.inf), self.counts, strict=True):
            running += n
            out.append(f'{self.name}_bucket{{le="{_fmt(bound)}"}} {running}')
        out += [f"{self.name}_sum {_fmt(self.sum)}", f"{self.name}_count {self.count}"]
        return out


class Counter:
    """A counter with at most one label; `preset` label values are exported at 0 before they happen."""

    def __init__(self, name: str, help: str, label: str | None = None, preset: Iterable[str] = ()) -> None:
        self.name, self.help, self.label = name, help, label
        self.values: dict[str, float] = {v: 0.0 for v in preset}

    def inc(self, label_value: str = "", value: float = 1.0) -> None:
        self.values[label_value] = self.values.get(label_value, 0.0) + value

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for key, v in sorted(self.values.items()):
            out.append(f"{self.name}{_labels({self.label: key} if self.label else {})} {_fmt(v)}")
        if not self.values and not self.label:
            out.append(f"{self.name} 0")
        return out


class Metrics:
    def __init__(self) -> None:
        self.ttft = Histogram("pdserve_time_to_first_token_seconds",
                              "Time from request arrival to its first token", LATENCY_BUCKETS)
        self.itl = Histogram("pdserve_inter_token_latency_seconds",
                             "Time between consecutive token deliveries of a request", ITL_BUCKETS)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds",
                             "Time from request arrival to its end", LATENCY_BUCKETS)
        self.requests = Counter("pdserve_requests_total", "Requests by outcome", "outcome", OUTCOMES)
        self.errors = Counter("pdserve_errors_total", "Error responses and in-band errors by kind", "kind")
        self.prompt_tokens = Counter("pdserve_prompt_tokens_total", "Prompt tokens of admitted requests")
        self.generation_tokens = Counter("pdserve_generation_tokens_total", "Tokens generated for clients")
        self.stats_errors = 0

    def render(self, stats: dict | None, in_flight: int, draining: bool,
               tenants: dict[str, dict[str, float]] | None = None) -> str:
        lines: list[str] = []
        for metric in (self.ttft, self.itl, self.e2e, self.requests, self.errors, self.prompt_tokens,
                       self.generation_tokens):
            lines += metric.lines()
        lines += _gauge("pdserve_requests_in_flight", "Requests admitted and not yet ended", [({}, in_flight)])
        lines += _gauge("pdserve_draining", "1 while the server refuses new requests", [({}, int(draining))])
        lines += _gauge("pdserve_backend_stats_errors", "Scrapes where backend.stats() failed",
                        [({}, self.stats_errors)])
        if stats:
            lines += _backend_lines(stats)
        if tenants:
            lines += _tenant_lines(tenants)
        return "\n".join(lines) + "\n"


def _gauge(name: str, help: str, samples: list[tuple[dict[str, object], float]], kind: str = "gauge") -> list[str]:
    out = [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
    return out + [f"{name}{_labels(labels)} {_fmt(v)}" for labels, v in samples]


def _number(x: object) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


_WORKER_HELP = {
    "kv_usage_ratio": "Fraction of the worker's KV blocks in use", "running": "Requests running",
    "queued_prompt_tokens": "Prompt tokens queued", "free_blocks": "Free KV blocks", "total_blocks": "KV blocks",
    "requests_routed": "Requests the router sent to the worker", "alive": "1 while the worker is alive",
    "restarts_total": "Times the worker's slot was replaced after a death",
    "booked_kv_blocks": "KV blocks booked by admitted requests (prompt and output budget)",
    "booked_prompt_tokens": "Prompt tokens booked on the worker and not yet prefilled"}


def _backend_lines(stats: dict) -> list[str]:
    lines: list[str] = []
    queue = _number(stats.get("queue_length"))
    if queue is not None:
        lines += _gauge("pdserve_queue_length", "Requests waiting for admission in the backend", [({}, queue)])
    by_priority = stats.get("waiting_by_priority")
    if isinstance(by_priority, dict) and by_priority:
        lines += _gauge("pdserve_queue_length_by_priority", "Requests waiting for admission, by priority (0 first)",
                        [({"priority": k}, v) for k, v in sorted(by_priority.items())])
    in_flight = _number(stats.get("in_flight"))
    if in_flight is not None:
        lines += _gauge("pdserve_backend_requests_in_flight", "Requests placed on workers", [({}, in_flight)])
    workers = [w for w in stats.get("workers") or [] if isinstance(w, dict)]
    per_worker: dict[str, list] = {key: [] for key in _WORKER_HELP}
    engine: dict[str, list] = {}
    for w in workers:
        labels = {"worker": w.get("name", "?"), "role": w.get("role", "?")}
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
    for key, samples in per_worker.items():
        if samples:
            lines += _gauge(f"pdserve_worker_{key}", _WORKER_HELP.get(key, "1 for the worker's life-cycle state"),
                            samples, "counter" if key.endswith("_total") else "gauge")
    for key, samples in sorted(engine.items()):
        name = _name("pdserve_worker_engine_", key)
        lines += _gauge(name, f"The worker engine's {key}", samples, "counter" if name.endswith("_total") else "gauge")
    for key, metric, help in (("migrations", "pdserve_migrations_total", "Request moves after a worker or transfer "
                               "failure: attempted, and outcome_completed / outcome_failed of moved requests"),
                              ("pool_down_seconds", "pdserve_pool_down_seconds_total",
                               "Seconds each pool spent with no live worker")):
        table = stats.get(key)
        if isinstance(table, dict):
            label = "event" if key == "migrations" else "pool"
            samples = [({label: k}, _number(v)) for k, v in sorted(table.items()) if _number(v) is not None]
            lines += _gauge(metric, help, samples, "counter")
    hits = _number(stats.get("prefix_affinity_hits"))
    if hits is not None:
        lines += _gauge("pdserve_prefix_affinity_hits_total", "Prefill routings that followed a cached prefix",
                        [({}, hits)], "counter")
    backend_errors = stats.get("errors")
    if isinstance(backend_errors, dict):
        samples = [({"kind": k}, v) for k, v in sorted(backend_errors.items()) if _number(v) is not None]
        lines += _gauge("pdserve_backend_errors_total", "Backend failures by kind", samples, "counter")
    transfer = stats.get("transfer")
    if isinstance(transfer, dict):
        for key, value in sorted(transfer.items()):
            v = _number(value)
            if v is not None:
                name = _name("pdserve_transfer_", key)
                lines += _gauge(name, f"KV transfer: {key}", [({}, v)],
                                "counter" if name.endswith("_total") else "gauge")
    return lines


def _tenant_lines(usage: dict[str, dict[str, float]]) -> list[str]:
    """Per tenant (coordinator.tenants usage()): requests by outcome, tokens, refusals by its limits, in flight."""
    requests = [({"tenant": t, "outcome": k.removeprefix("requests_")}, v) for t, c in sorted(usage.items())
                for k, v in sorted(c.items()) if k.startswith("requests_")]
    lines = _gauge("pdserve_tenant_requests_total", "Ended requests per tenant and outcome", requests, "counter")
    for key, kind, help in (("prompt_tokens", "counter", "Prompt tokens processed per tenant"),
                            ("completion_tokens", "counter", "Tokens generated per tenant"),
                            ("rate_limited", "counter", "Requests refused by the tenant's rate limits"),
                            ("in_flight", "gauge", "Requests in flight per tenant")):
        name = f"pdserve_tenant_{key}" + ("_total" if kind == "counter" else "")
        lines += _gauge(name, help, [({"tenant": t}, c.get(key, 0)) for t, c in sorted(usage.items())], kind)
    return lines


def _name(prefix: str, key: object) -> str:
    return prefix + re.sub(r"[^a-zA-Z0-9_]", "_", str(key))
