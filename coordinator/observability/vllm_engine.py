"""vLLM's scheduler and engine families, built at each scrape from the backend's figures (coordinator.backend.stats):
what a dashboard built for vLLM reads about the engines, in vLLM's names, types and labels (`model_name`, and
`engine`, one series per engine core in vLLM: here one per live worker, named as pdserve names it, in name order).

Owns, per worker, from its last EngineLoad:
- `vllm:num_requests_running`: requests in its engine's running batch (vLLM's "in model execution batches"; not
  those admitted or booked, which pdserve_backend_requests_in_flight counts);
- `vllm:num_requests_waiting` and `vllm:num_requests_waiting_by_reason{reason}` (vLLM's two reasons, both always
  present, summing to the former): `capacity`, requests in its engine's waiting queue (new, or preempted), and
  `deferred`, requests whose KV is being handed over into blocks it reserved (vLLM defers a request waiting for
  remote KV the same way). The coordinator's admission queue (requests not yet placed on any worker, waiting for
  room) is one more series, `engine="admission"`, all `capacity`: without it a vLLM dashboard's sum of waiting
  requests would miss the queue that grows when pdserve is short of KV;
- `vllm:kv_cache_usage_perc` (its KV blocks in use), `vllm:num_preemptions_total`, `vllm:prefix_cache_queries_total`
  and `vllm:prefix_cache_hits_total` (prompt tokens looked up in and supplied by its prefix cache), from the
  worker's EngineLoad counters since its engine started (a restarted worker starts again from 0, which Prometheus
  reads as a counter reset);
- `vllm:iteration_tokens_total`, vLLM's histogram of tokens per engine step, with vLLM's buckets
  (engine.load.ITERATION_TOKEN_BUCKETS) and its count: each step that produced tokens, observed with the prompt
  tokens of the requests whose first token it sampled plus the tokens it sampled (engine.load.IterationTokens).
A dead worker's series disappear (backend_stats leaves its engine load out).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from engine.load import ITERATION_TOKEN_BUCKETS

# vLLM's counter -> the EngineLoad counter it is read from (engine.load)
ENGINE_COUNTERS = {
    "vllm:num_preemptions": ("preemptions_total", "Cumulative number of preemptions from the engine (vLLM's name)"),
    "vllm:prefix_cache_queries": ("prefix_query_tokens_total", "Prefix cache queries, in terms of number of queried "
                                  "tokens (vLLM's name)"),
    "vllm:prefix_cache_hits": ("prefix_hit_tokens_total", "Prefix cache hits, in terms of number of cached tokens "
                               "(vLLM's name)"),
}
ADMISSION = "admission"  # the `engine` label of the coordinator's admission queue
REASONS = ("capacity", "deferred")  # vLLM's waiting reasons
Samples = list[tuple[dict[str, str], float]]


def vllm_families(stats: dict, model_name: str) -> list[Metric]:
    """vLLM's scheduler and per-engine families from one `backend.stats()`."""
    label = {"model_name": model_name}
    live = [w for w in stats.get("workers") or [] if isinstance(w, dict) and ("running" in w or "engine" in w)]
    live.sort(key=lambda w: str(w.get("name")))
    engines = [({**label, "engine": str(w.get("name", "?"))}, w) for w in live]
    waiting: dict[str, Samples] = {"capacity": [], "deferred": []}
    for labels, w in engines:
        waiting["capacity"].append((labels, _number(_load(w).get("num_waiting")) or 0))
        waiting["deferred"].append((labels, _number(_load(w).get("num_reserved")) or 0))
    waiting["capacity"].append(({**label, "engine": ADMISSION}, _number(stats.get("queue_length")) or 0))
    waiting["deferred"].append(({**label, "engine": ADMISSION}, 0))
    totals = [(labels, c + d) for (labels, c), (_, d) in zip(waiting["capacity"], waiting["deferred"], strict=True)]
    out = [
        _gauge("vllm:num_requests_running", "Number of requests in model execution batches: each worker's engine's "
               "running batch (vLLM's name)", [(labels, _number(w.get("running")) or 0) for labels, w in engines]),
        _gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed: each worker engine's queue "
               "and KV handoffs, and the coordinator's admission queue as engine=\"admission\" (vLLM's name)", totals),
        _gauge("vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason: 'capacity' = waiting for "
               "room (an engine's queue, the admission queue); 'deferred' = waiting for its KV handoff. Sum of all "
               "reasons equals vllm:num_requests_waiting (vLLM's name)",
               [({**labels, "reason": reason}, value) for reason in REASONS for labels, value in waiting[reason]]),
        _gauge("vllm:kv_cache_usage_perc", "Fraction of each worker's KV blocks in use (vLLM's name)",
               [(labels, 1.0 - free / total) for labels, w in engines
                if (free := _number(w.get("free_blocks"))) is not None and (total := _number(w.get("total_blocks")))])]
    for name, (key, help) in ENGINE_COUNTERS.items():
        family = CounterMetricFamily(name, help, labels=["model_name", "engine"])
        for labels, w in engines:
            if (value := _number(_load(w).get(key))) is not None:
                family.add_metric(list(labels.values()), value)
        out.append(family)
    return out + [_iteration_tokens(engines)]


def _iteration_tokens(engines: list[tuple[dict[str, str], dict[str, Any]]]) -> Metric:
    steps = HistogramMetricFamily("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step: per "
                                  "step that produced tokens, the prompt tokens of the requests whose first token it "
                                  "sampled plus the tokens sampled (vLLM's name)", labels=["model_name", "engine"])
    for labels, w in engines:
        counts, total = w.get("iteration_token_counts"), _number(_load(w).get("iteration_tokens_total"))
        if not isinstance(counts, list | tuple) or len(counts) != len(ITERATION_TOKEN_BUCKETS) + 1 or total is None:
            continue
        bounds = [str(float(b)) for b in ITERATION_TOKEN_BUCKETS] + ["+Inf"]
        steps.add_metric(list(labels.values()), list(zip(bounds, accumulate(counts), strict=True)), total)
    return steps


def _load(worker: dict[str, Any]) -> dict[str, Any]:
    """A live worker's engine-load figures (coordinator.backend.stats); {} where its backend reports none."""
    load = worker.get("engine")
    return load if isinstance(load, dict) else {}


def _gauge(name: str, help: str, samples: Samples) -> Metric:
    family = GaugeMetricFamily(name, help, labels=list(samples[0][0]) if samples else [])
    for labels, value in samples:
        family.add_metric(list(labels.values()), float(value))
    return family


def _number(x: object) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None
