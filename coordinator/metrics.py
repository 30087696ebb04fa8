"""Metrics: the coordinator's Prometheus figures through prometheus-client, one CollectorRegistry per app.

Owns the request-side figures as the client sees them, as prometheus_client objects on the app's own registry (no
process-wide default registry: tests run several apps in one process): time to first token, inter-token latency
(one observation per backend delta after the first), end-to-end latency, each request's phases
(`pdserve_request_phase_seconds{phase}`, coordinator.phases: every label preset, so a phase no request had yet
shows a count of 0), requests by outcome, errors by kind, prompt and generated tokens. `watch()` adds
coordinator.metrics_backend's collector, which builds the backend's load, per-worker gauges, tenants' usage and the
lifecycle gauges from fresh figures at each scrape.

`exposition()` is prometheus_client's `generate_latest` (text format 0.0.4) over the registry, with two changes made
here rather than through process-wide switches: no `_created` series (prometheus_client.disable_created_metrics()
flips a global for every registry in the process), and vLLM-compatible aliases (VLLM_ALIASES, labelled
`model_name` as vLLM labels them) of the histograms and token counters, so a dashboard built for vLLM reads
pdserve. Label names print in sorted order (generate_latest sorts them); Prometheus compares label sets, not order.

Multiprocess mode (PROMETHEUS_MULTIPROC_DIR) is not needed and not used: it exists for servers that fork several
processes each holding a copy of the metrics. The coordinator is one process with one event loop; the workers'
figures reach it over Ray as backend.stats(), which the collector reads at scrape time, so there is nothing to
merge across processes. prometheus_client's metric objects lock internally, so a thread may observe too.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import Metric

from coordinator.metrics_backend import BackendCollector
from coordinator.phases import PHASES

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
# phases range from tens of microseconds (ingress, a decode join) to minutes (decode of a long output)
PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                 5.0, 10.0, 20.0, 40.0, 80.0)
OUTCOMES = ("finished", "aborted", "failed", "timeout", "rejected")
# family -> vLLM's name for the same figure (the gauges vllm:num_requests_* and vllm:kv_cache_usage_perc come
# from coordinator.metrics_backend)
VLLM_ALIASES = {
    "pdserve_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "pdserve_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "pdserve_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "pdserve_prompt_tokens": "vllm:prompt_tokens",          # counters: exported with `_total`
    "pdserve_generation_tokens": "vllm:generation_tokens",
}


class LabeledCounter:
    """A Counter with one label, counted as `inc(label_value)`; `preset` values are exported at 0 beforehand."""

    def __init__(self, name: str, documentation: str, label: str, registry: CollectorRegistry,
                 preset: Iterable[str] = ()) -> None:
        self._counter = Counter(name, documentation, [label], registry=registry)
        for value in preset:
            self._counter.labels(value)

    def inc(self, label_value: str, amount: float = 1.0) -> None:
        self._counter.labels(label_value).inc(amount)


class Metrics:
    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        reg = self.registry
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Time from request arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram("pdserve_inter_token_latency_seconds",
                             "Time between consecutive token deliveries of a request", buckets=ITL_BUCKETS,
                             registry=reg)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Time from request arrival to its end",
                             buckets=LATENCY_BUCKETS, registry=reg)
        self.phases = Histogram("pdserve_request_phase_seconds", "Seconds of each phase of a request (they sum to its "
                                "end-to-end latency)", ["phase"], buckets=PHASE_BUCKETS, registry=reg)
        for phase in PHASES:
            self.phases.labels(phase)
        self.requests = LabeledCounter("pdserve_requests", "Requests by outcome", "outcome", reg, OUTCOMES)
        self.errors = LabeledCounter("pdserve_errors", "Error responses and in-band errors by kind", "kind", reg)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of admitted requests", registry=reg)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Tokens generated for clients", registry=reg)

    def watch(self, backend: Any, lifecycle: Any, tenants: Any = None) -> BackendCollector:
        """Export, at each scrape, `backend.stats()`, `lifecycle.in_flight` / `.draining` and `tenants.usage()`."""
        collector = BackendCollector(backend, lifecycle, tenants, self.model_name)
        self.registry.register(collector)
        return collector

    def exposition(self) -> bytes:
        """The Prometheus text exposition of everything on the registry, without `_created`, with vLLM aliases."""
        return generate_latest(_Exported(self.registry, self.model_name))  # type: ignore[arg-type]


class _Exported:
    """What /metrics prints: the registry's families, `_created` samples dropped, VLLM_ALIASES added."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry, self.model_name = registry, model_name

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            samples = [s for s in family.samples if s.name != family.name + "_created"]
            yield _family(family, family.name, samples)
            alias = VLLM_ALIASES.get(family.name)
            if alias is not None:
                yield _family(family, alias, [s._replace(name=alias + s.name[len(family.name):],
                                                         labels={**s.labels, "model_name": self.model_name})
                                              for s in samples])


def _family(like: Metric, name: str, samples: list) -> Metric:
    out = Metric(name, like.documentation, like.type, like.unit)
    out.samples = samples
    return out
