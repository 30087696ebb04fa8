"""Which cache tier supplied the KV of the tokens a server admitted during a run, from its /metrics.

Owns `read_tier_counters` (one read of pdserve's counters, summed over its workers) and `tier_shares` (two reads, one
before and one after a run, as shares of the tokens admitted in between). The counters: `vllm:prefix_cache_queries`
(tokens admitted, each admission looking up the prefix cache: prompts, and recomputes after a preemption),
`vllm:prefix_cache_hits` (of those, tokens a device prefix cache supplied) and `pdserve_kv_tier_hit_tokens{tier}`
(tokens copied back from a tier below it). Another server, a refused /metrics or a counter that went backwards (a
worker replaced mid-run) gives no shares rather than wrong ones.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

QUERIES = "vllm:prefix_cache_queries_total"
DEVICE_HITS = "vllm:prefix_cache_hits_total"
TIER_HITS = "pdserve_kv_tier_hit_tokens_total"


def read_tier_counters(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> dict[str, float] | None:
    """{"queries", "device", one key per tier below the device (e.g. "host")}: token counts summed over the
    server's workers; None when the server does not report the prefix cache's counters."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url.rstrip("/") + "/metrics", headers=headers, timeout=timeout_s)
        response.raise_for_status()
        families = list(text_string_to_metric_families(response.text))
    except (httpx.HTTPError, ValueError):
        return None
    sums: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            if sample.name == QUERIES:
                key = "queries"
            elif sample.name == DEVICE_HITS:
                key = "device"
            elif sample.name == TIER_HITS:
                key = sample.labels.get("tier", "?")
            else:
                continue
            sums[key] = sums.get(key, 0.0) + sample.value
    return sums if "queries" in sums and "device" in sums else None


def tier_shares(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """{"cache_share_device": ..., "cache_share_<tier>": ...}: each tier's share of the tokens admitted between the
    two reads; {} when either read is missing, nothing was admitted or a counter went backwards."""
    if before is None or after is None:
        return {}
    deltas = {key: after[key] - before.get(key, 0.0) for key in after}
    if deltas["queries"] <= 0 or any(v < 0 for v in deltas.values()):
        return {}
    return {f"cache_share_{key}": value / deltas["queries"] for key, value in deltas.items() if key != "queries"}
