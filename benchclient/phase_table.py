"""Where did the time go: the server's per-request phases (pdserve's `stream_options.include_phases`) summarized.

Each successful request that carried phases (seconds per phase, summing to its latency as the server measured it)
gives every phase a share of that latency; a phase the request did not have (a migration, or the KV transfer of a
collocated server) counts as a share of 0. `phase_summary` returns, per phase, the mean seconds and the mean, p50 and
p99 of its share over those requests; `format_phase_table` is the short table `pdserve bench` prints. Phases keep
the order the server sent them in (a request's own order: ingress first, overhead last).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from benchclient.client import RequestResult
from benchclient.stats import percentile


def phase_summary(results: Sequence[RequestResult]) -> dict:
    """{"requests": n, "server_e2e_mean_ms", "phases": {phase: {mean_ms, share_mean, share_p50, share_p99}}} over
    the measured successful requests with phases; {"requests": 0, "phases": {}} when none had them."""
    traced = [r.phases for r in results if not r.warmup and r.ok and r.phases]
    names = list(dict.fromkeys(p for phases in traced for p in phases))
    totals = [math.fsum(phases.values()) for phases in traced]
    out: dict = {"requests": len(traced), "phases": {}}
    if not traced:
        return out
    out["server_e2e_mean_ms"] = statistics.fmean(totals) * 1000
    for name in names:
        seconds = [phases.get(name, 0.0) for phases in traced]
        shares = [s / t if t > 0 else 0.0 for s, t in zip(seconds, totals, strict=True)]
        out["phases"][name] = {"mean_ms": statistics.fmean(seconds) * 1000, "share_mean": statistics.fmean(shares),
                               "share_p50": percentile(shares, 50), "share_p99": percentile(shares, 99)}
    return out


def format_phase_table(summary: dict) -> str:
    """The short "where did the time go" table; "" when no request carried phases."""
    if not summary.get("requests"):
        return ""
    lines = [f"where did the time go ({summary['requests']} requests; server-side phases, share of each request's "
             "latency)", f"{'phase':<20}{'mean ms':>10}{'mean':>9}{'p50':>9}{'p99':>9}"]
    for name, row in summary["phases"].items():
        lines.append(f"{name:<20}{row['mean_ms']:>10.1f}" + "".join(
            f"{row[k]:>9.1%}" for k in ("share_mean", "share_p50", "share_p99")))
    lines.append(f"{'total (server)':<20}{summary['server_e2e_mean_ms']:>10.1f}")
    return "\n".join(lines)
