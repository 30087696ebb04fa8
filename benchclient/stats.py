"""The metric maths of one load run: latency distributions, throughput, errors and goodput.

Owns `SLO`, `percentile` (linear interpolation between closest ranks, as numpy's default) and `summarize`,
which takes every `RequestResult` (warm-up ones are left out here, failed ones are counted, never dropped) and
the measurement window, and returns one flat dict of figures in ms, requests/s and tokens/s.
Definitions: TTFT = first output chunk - send; TPOT = (e2e - TTFT) / (completion tokens - 1) per request
(requests with one token have none); ITL = gaps between successive output chunks of a request, over all
requests; e2e = `[DONE]` - send. Goodput = successful requests meeting both SLOs / window; a one-token
request meets the TPOT SLO trivially. Throughputs divide by the window: from the first measured send to the
last measured request's end. Prompt caching: `cached_prompt_tokens_ratio` = the prompt tokens the server reported
cached (usage.prompt_tokens_details.cached_tokens) / all prompt tokens of the requests that reported it (NaN: none
did). Multi-turn runs add the TTFT of turns after the first (`ttft_later_turns_*`: those whose history a cache can
serve) and `conversations`.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from benchclient.client import RequestResult

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    ttft_ms: float = 1000.0
    tpot_ms: float = 100.0

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of milliseconds, got {value!r}")

    @property
    def goodput_key(self) -> str:
        """The column a sweep gives goodput under this pair in: goodput@<ttft ms>/<tpot ms>."""
        return f"goodput@{self.ttft_ms:g}/{self.tpot_ms:g}"

    def met_by(self, r: RequestResult) -> bool:
        if not r.ok or r.ttft is None or r.ttft * 1000 > self.ttft_ms:
            return False
        return r.tpot is None or r.tpot * 1000 <= self.tpot_ms


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(name: str, values_s: Sequence[float]) -> dict[str, float]:
    """{name_mean_ms, name_p50_ms, ...} from values in seconds."""
    out = {f"{name}_mean_ms": statistics.fmean(values_s) * 1000 if values_s else math.nan}
    for q in PERCENTILES:
        out[f"{name}_p{q}_ms"] = percentile(values_s, q) * 1000
    return out


def summarize(results: Sequence[RequestResult], slo: SLO) -> dict[str, float | int | dict]:
    measured = [r for r in results if not r.warmup]
    ok = [r for r in measured if r.ok]
    window = measurement_window(measured)
    summary: dict[str, float | int | dict] = {
        "requests": len(measured), "completed": len(ok), "failed": len(measured) - len(ok),
        "warmup_requests": len(results) - len(measured), "duration_s": window}
    summary["errors"] = dict(Counter(_error_kind(r.error) for r in measured if not r.ok))
    summary.update(distribution("ttft", [r.ttft for r in ok if r.ttft is not None]))
    summary.update(distribution("tpot", [r.tpot for r in ok if r.tpot is not None]))
    summary.update(distribution("itl", [gap for r in ok for gap in r.itl]))
    summary.update(distribution("e2e", [r.e2e for r in ok if r.e2e is not None]))
    out_tokens = sum(r.completion_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    good = sum(slo.met_by(r) for r in measured)
    per_s = (lambda x: x / window) if window > 0 else (lambda x: math.nan)
    summary.update({
        "request_throughput": per_s(len(ok)), "output_token_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(out_tokens + in_tokens), "goodput": per_s(good),
        "slo_attainment": good / len(measured) if measured else math.nan,
        "prompt_tokens_mean": in_tokens / len(ok) if ok else math.nan,
        "completion_tokens_mean": out_tokens / len(ok) if ok else math.nan,
        "tokens_from_usage": all(r.tokens_from_usage for r in ok),
        "slo_ttft_ms": slo.ttft_ms, "slo_tpot_ms": slo.tpot_ms})
    reported = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    summary["cached_prompt_tokens_ratio"] = (sum(r.cached_tokens for r in reported)
                                             / sum(r.prompt_tokens for r in reported)) if reported else math.nan
    if any(r.turn is not None for r in measured):
        summary["conversations"] = len({r.conversation for r in measured})
        summary.update(distribution("ttft_later_turns", [r.ttft for r in ok if r.turn and r.ttft is not None]))
    return summary


def measurement_window(measured: Sequence[RequestResult]) -> float:
    if not measured:
        return 0.0
    first = min(r.start for r in measured)
    last = max(r.end if r.end is not None else r.start for r in measured)
    return last - first


def _error_kind(error: str | None) -> str:
    """Group errors for the summary: 'HTTP 503', 'in-band error', 'ReadTimeout', ..."""
    text = error or ""
    if text.startswith("HTTP "):
        return text.split(":", 1)[0]
    return text.split(":", 1)[0][:60]


FORMAT = [("requests", "{:.0f}"), ("completed", "{:.0f}"), ("failed", "{:.0f}"), ("duration_s", "{:.2f}"),
          ("request_throughput", "{:.2f} req/s"), ("output_token_throughput", "{:.1f} tok/s"),
          ("total_token_throughput", "{:.1f} tok/s"), ("goodput", "{:.2f} req/s"), ("slo_attainment", "{:.1%}"),
          ("cached_prompt_tokens_ratio", "{:.1%}"), ("cache_share_device", "{:.1%}"), ("cache_share_host", "{:.1%}")]


def format_summary(s: dict) -> str:
    """A human-readable block of the figures, as `pdserve bench` prints it."""
    lines = [f"{key:<26}{fmt.format(s[key])}" for key, fmt in FORMAT if key in s]  # cache shares: pdserve's counters
    lines.append(f"{'SLOs':<26}TTFT <= {s['slo_ttft_ms']:g} ms, TPOT <= {s['slo_tpot_ms']:g} ms")
    if s["errors"]:
        lines.append(f"{'errors':<26}{s['errors']}")
    lines.append(f"{'(ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft", "tpot", "itl", "e2e", *(("ttft_later_turns",) if "ttft_later_turns_p50_ms" in s else ())):
        row = [s[f"{name}_mean_ms"]] + [s[f"{name}_p{q}_ms"] for q in PERCENTILES]
        label = "TTFT turn>1" if name == "ttft_later_turns" else name.upper()
        lines.append(f"{label:<12}" + "".join(f"{v:>10.1f}" for v in row))
    return "\n".join(lines)
