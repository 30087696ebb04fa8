"""Metrics: the coordinator's Prometheus figures through prometheus-client, one CollectorRegistry per app.

Owns the request-side figures as the client sees them, as prometheus_client objects on the app's own registry (no
process-wide default registry: tests run several apps in one process): time to first token, inter-token latency
(per token, as vLLM observes it: a backend delta of k tokens after the first observes k samples of its gap / k),
end-to-end latency, each request's phases
(`pdserve_request_phase_seconds{phase}`, coordinator.observability.phases: every label preset, so a phase no request
had yet
shows a count of 0), requests by outcome, errors by kind, prompt and generated tokens, streams cut for a stalled
client (`pdserve_stalled_clients_total`, coordinator.api.stall_watch), and each sequence's shape and finish in
pdserve's and vLLM's names (coordinator.observability.request_metrics). `watch()` adds
coordinator.observability.metrics_backend's collector, which builds the backend's load, per-worker gauges, tenants'
usage and the
lifecycle gauges from fresh figures at each scrape.

`exposition()` is prometheus_client's `generate_latest` (text format 0.0.4) over the registry (`/metrics` renders it
with `exposition_async`, a family at a time, giving the event loop back every millisecond), with two changes made
here rather than through process-wide switches: no `_created` series (prometheus_client.disable_created_metrics()
flips a global for every registry in the process), and vLLM-compatible aliases (VLLM_ALIASES, labelled
`model_name` as vLLM labels them) of the histograms and token counters, so a dashboard built for vLLM reads
pdserve. Label names print in sorted order (generate_latest sorts them); Prometheus compares label sets, not order.

Several HTTP processes (`server.api_processes` > 1, coordinator.frontends): each frontend counts its own requests;
the one a scrape reaches asks the core for every other frontend's `local_families()` (its request figures and
lifecycle gauges) and `exposition(others)` adds them in, sample by sample (counters, histograms and in-flight
gauges sum; the draining flag takes the maximum), so /metrics reads the same whichever process answers. The
backend's and tenants' figures come from the core once (CoreBackend.refresh). prometheus_client's multiprocess
mode (PROMETHEUS_MULTIPROC_DIR, a process-wide switch over shared files) is not used. Its metric objects lock
internally, so a thread may observe too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import Metric

from coordinator.observability.metrics_backend import BackendCollector, lifecycle_families
from coordinator.observability.phases import PHASES
from coordinator.observability.request_metrics import RequestFigures

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
# phases range from tens of microseconds (ingress, a decode join) to minutes (decode of a long output)
PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                 5.0, 10.0, 20.0, 40.0, 80.0)
YIELD_EVERY_S = 0.001  # a scrape being rendered gives its event loop back this often
TENANT_FAMILIES = "pdserve_tenant_"  # their `tenant` labels name the tenants: only for the operator's or metrics key
MAX_GAUGES = {"pdserve_draining"}  # merged across HTTP processes by their maximum, not their sum
OUTCOMES = ("finished", "aborted", "failed", "timeout", "rejected")
# family -> vLLM's name for the same figure (the gauges vllm:num_requests_* and vllm:kv_cache_usage_perc come
# from coordinator.observability.metrics_backend)
VLLM_ALIASES = {
    "pdserve_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "pdserve_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "pdserve_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "pdserve_prompt_tokens": "vllm:prompt_tokens",          # counters: exported with `_total`
    "pdserve_generation_tokens": "vllm:generation_tokens",
    "pdserve_request_prompt_tokens": "vllm:request_prompt_tokens",
    "pdserve_request_generation_tokens": "vllm:request_generation_tokens",
}
DEFAULT_MAX_MODEL_LEN = 1 << 20  # token histograms' last bucket when the app's max_model_len is not given


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
    def __init__(self, model_name: str = "", max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        reg = self.registry
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Time from request arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "Time between consecutive tokens of a request (a "
                             "delivery of k tokens: k samples of its gap / k)", buckets=ITL_BUCKETS, registry=reg)
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
        self.stalled_clients = Counter("pdserve_stalled_clients", "Streams cut because their client took none of "
                                       "their bytes for server.stall_timeout_s (request aborted, KV freed)",
                                       registry=reg)
        self.sequences = RequestFigures(reg, model_name, max_model_len)  # each sequence's shape and finish

        self._local = [self.ttft, self.itl, self.e2e, self.phases, self.requests._counter, self.errors._counter,
                       self.prompt_tokens, self.generation_tokens, self.stalled_clients, *self.sequences.local]
        self._lifecycle: Any = None

    def watch(self, backend: Any, lifecycle: Any, tenants: Any = None) -> BackendCollector:
        """Export, at each scrape, `backend.stats()`, `lifecycle.in_flight` / `.draining` and `tenants.usage()`."""
        collector = BackendCollector(backend, lifecycle, tenants, self.model_name)
        self.registry.register(collector)
        self._lifecycle = lifecycle
        return collector

    def add_local(self, collector: Any) -> None:
        """Export `collector` here and count it among this process's own figures (an HTTP process's loop lag)."""
        self.registry.register(collector)
        self._local.append(collector)

    def local_families(self) -> list[Metric]:
        """This process's own request figures and lifecycle gauges: what another HTTP process adds to its scrape."""
        families = [f for metric in self._local for f in metric.collect()]
        if self._lifecycle is not None:
            families += lifecycle_families(self._lifecycle)
        return families

    def exposition(self, others: Iterable[list[Metric]] = (), tenants: bool = True) -> bytes:
        """The Prometheus text exposition of everything on the registry, without `_created`, with vLLM aliases;
        `others`: other HTTP processes' local_families(), added in; `tenants` False: without the tenant-labelled
        families (TENANT_FAMILIES: what a scrape without the operator's or the metrics key gets)."""
        exported = _Exported(self.registry, self.model_name, list(others), tenants)
        return generate_latest(exported)  # type: ignore[arg-type]

    async def exposition_async(self, others: Iterable[list[Metric]] = (), tenants: bool = True) -> bytes:
        """exposition(), rendered a family at a time with the event loop given back about every millisecond: a
        whole scrape of a busy server is 5-15 ms of Python, which would otherwise delay every request and stream
        this process serves at that moment (measured on the GPU machine: each scrape stalled an HTTP process's
        loop by 10-16 ms)."""
        parts, due = [], time.perf_counter() + YIELD_EVERY_S
        for family in _Exported(self.registry, self.model_name, list(others), tenants).collect():
            parts.append(generate_latest(_One(family)))  # type: ignore[arg-type]
            if time.perf_counter() >= due:
                await asyncio.sleep(0)
                due = time.perf_counter() + YIELD_EVERY_S
        return b"".join(parts)


class _One:
    """A registry of one family, for generate_latest."""

    def __init__(self, family: Metric) -> None:
        self.family = family

    def collect(self) -> Iterator[Metric]:
        yield self.family


class _Exported:
    """What /metrics prints: the registry's families (plus other processes' shares), `_created` samples dropped,
    VLLM_ALIASES added."""

    def __init__(self, registry: CollectorRegistry, model_name: str, others: list[list[Metric]],
                 tenants: bool = True) -> None:
        self.registry, self.model_name, self.others, self.tenants = registry, model_name, others, tenants

    def collect(self) -> Iterator[Metric]:
        for family in merged(self.registry.collect(), self.others):
            if not self.tenants and family.name.startswith(TENANT_FAMILIES):
                continue
            samples = [s for s in family.samples if s.name != family.name + "_created"]
            yield _family(family, family.name, samples)
            alias = VLLM_ALIASES.get(family.name)
            if alias is not None:
                yield _family(family, alias, [s._replace(name=alias + s.name[len(family.name):],
                                                         labels={**s.labels, "model_name": self.model_name})
                                              for s in samples])


def merged(own: Iterable[Metric], others: list[list[Metric]]) -> Iterator[Metric]:
    """`own` families with the samples of the same names in `others` added (MAX_GAUGES take the largest)."""
    extra: dict[str, list[Metric]] = {}
    for families in others:
        for family in families:
            extra.setdefault(family.name, []).append(family)
    for family in own:
        if family.name not in extra:
            yield family
            continue
        values: dict[tuple, Any] = {}
        for f in (family, *extra[family.name]):
            for sample in f.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                old = values.get(key)
                if old is None:
                    values[key] = sample
                else:
                    value = max(old.value, sample.value) if family.name in MAX_GAUGES else old.value + sample.value
                    values[key] = old._replace(value=value)
        yield _family(family, family.name, list(values.values()))


def _family(like: Metric, name: str, samples: list) -> Metric:
    out = Metric(name, like.documentation, like.type, like.unit)
    out.samples = samples
    return out
