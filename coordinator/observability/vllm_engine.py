"""vLLM's scheduler and engine families, built at each scrape from the backend's figures (coordinator.backend.stats):
what a dashboard built for vLLM reads about the engines, in vLLM's names, types and labels (`model_name`, and
`engine` where vLLM has one series per engine core: here one per worker, named as pdserve names it).

Owns:
- `vllm:num_requests_running` (requests placed on workers) and `vllm:num_requests_waiting` (the admission queue);
- per worker: `vllm:kv_cache_usage_perc` (its KV blocks in use), `vllm:num_preemptions_total`,
  `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` (prompt tokens looked up in and supplied by its
  prefix cache), from the worker's EngineLoad counters since its engine started (a restarted worker starts again
  from 0, which Prometheus reads as a counter reset);
- `vllm:iteration_tokens_total`, vLLM's histogram of tokens per engine step, per worker: the workers report counts
  since start, not each step, so it has only its `+Inf` bucket, `_count` = steps and `_sum` = tokens computed
  (prefill chunks, recomputes and decodes): rate(_sum) / rate(_count) is the mean tokens per step, quantiles are not
  available.
A dead worker's series disappear (backend_stats leaves its engine load out).
"""

from __future__ import annotations

from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

# vLLM's counter -> the EngineLoad counter it is read from (engine.load)
ENGINE_COUNTERS = {
    "vllm:num_preemptions": ("preemptions_total", "Cumulative number of preemptions from the engine (vLLM's name)"),
    "vllm:prefix_cache_queries": ("prefix_query_tokens_total", "Prefix cache queries, in terms of number of queried "
                                  "tokens (vLLM's name)"),
    "vllm:prefix_cache_hits": ("prefix_hit_tokens_total", "Prefix cache hits, in terms of number of cached tokens "
                               "(vLLM's name)"),
}


def vllm_families(stats: dict, model_name: str) -> list[Metric]:
    """vLLM's scheduler and per-engine families from one `backend.stats()`."""
    label = {"model_name": model_name}
    workers = [w for w in stats.get("workers") or [] if isinstance(w, dict)]
    running = _number(stats.get("in_flight"))
    if running is None:  # a backend without a request count: the workers' running batches
        running = sum(_number(w.get("running")) or 0 for w in workers)
    gauges = [("vllm:num_requests_running", "Requests placed on workers (vLLM's name)", [(label, running)]),
              ("vllm:num_requests_waiting", "Requests waiting for admission (vLLM's name)",
               [(label, _number(stats.get("queue_length")) or 0)]),
              ("vllm:kv_cache_usage_perc", "Fraction of each worker's KV blocks in use (vLLM's name)",
               [({**label, "engine": w.get("name", "?")}, 1.0 - free / total) for w in workers
                if (free := _number(w.get("free_blocks"))) is not None and (total := _number(w.get("total_blocks")))])]
    out: list[Metric] = []
    for name, help, samples in gauges:
        family = GaugeMetricFamily(name, help, labels=_labels(samples))
        for labels, value in samples:
            family.add_metric([str(v) for v in labels.values()], float(value))
        out.append(family)
    engines = [({**label, "engine": str(w.get("name", "?"))}, w["engine"]) for w in workers
               if isinstance(w.get("engine"), dict)]
    for name, (key, help) in ENGINE_COUNTERS.items():
        family = CounterMetricFamily(name, help, labels=["model_name", "engine"])
        for labels, load in engines:
            if (value := _number(load.get(key))) is not None:
                family.add_metric(list(labels.values()), value)
        out.append(family)
    steps = HistogramMetricFamily("vllm:iteration_tokens_total", "Tokens per engine step (vLLM's name): workers "
                                  "report totals, not each step, so only the +Inf bucket; _sum is tokens computed, "
                                  "_count engine steps", labels=["model_name", "engine"])
    for labels, load in engines:
        count, tokens = _number(load.get("steps")), _number(load.get("scheduled_tokens_total"))
        if count is not None and tokens is not None:
            steps.add_metric(list(labels.values()), [("+Inf", count)], tokens)
    return out + [steps]


def _labels(samples: list[tuple[dict[str, Any], float]]) -> list[str]:
    return list(samples[0][0]) if samples else []


def _number(x: object) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None
