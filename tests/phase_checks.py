"""Checks of per-request phase tracing (coordinator.observability.phases) against a running server, shared by the
serving suites:
a streamed request timed by the client as its bytes arrive, its phases read from the final usage chunk, and the
`pdserve_request_phase_seconds` histograms read from /metrics."""

from __future__ import annotations

import json
import math
import time

import httpx

from coordinator.observability.phases import DISAGGREGATED_ONLY, PHASES, RESTORE_ONLY
from tests.server_process import metric_values

DISAGGREGATED = set(PHASES) - {"migration", *RESTORE_ONLY}
COLLOCATED = DISAGGREGATED - set(DISAGGREGATED_ONLY)
WITH_PHASES = {"stream": True, "stream_options": {"include_usage": True, "include_phases": True}}


async def stream_with_phases(client: httpx.AsyncClient, url: str, body: dict, on_chunk=None) -> dict:
    """POST a streamed completion asking for its phases: {"e2e": seconds from before the request to [DONE] on the
    client's clock, "phases", "completion_tokens", "text", "chunks"}. `on_chunk(n)` after each output chunk."""
    out: dict = {"phases": None, "completion_tokens": None, "text": "", "chunks": 0}
    start = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json={**body, **WITH_PHASES}) as r:
        assert r.status_code == 200, (await r.aread()).decode()
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                out["e2e"] = time.perf_counter() - start
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk.get("usage"):
                    out["completion_tokens"] = chunk["usage"]["completion_tokens"]
                    out["phases"] = chunk.get("phases")
                for choice in chunk["choices"]:
                    out["text"] += choice["text"]
                    out["chunks"] += 1
                    if on_chunk is not None:
                        on_chunk(out["chunks"])
    assert "e2e" in out, "the stream ended without [DONE]"
    return out


# What a client's e2e holds outside the server's window on a loaded 2-core CI machine: its own event loop's lag and
# the request's bytes before the handler runs, the usage chunk and [DONE] after the phases are read (a 656 ms stream
# once measured 37 ms more than its phases, 0.656 * 5% = 33 ms, while the other test process served beside it)
CLIENT_SIDE_S = 0.05


def assert_partition(result: dict, expected: set[str], unseen_s: float = CLIENT_SIDE_S) -> None:
    """The request has exactly the expected phases, none negative, summing to the client's e2e within 5% plus
    `unseen_s` the client may wait outside the server's window (before its handler runs, after its last byte)."""
    phases = result["phases"]
    assert phases is not None and set(phases) == expected, phases
    assert all(v >= 0 for v in phases.values()), phases
    total = math.fsum(phases.values())
    assert total <= 1.05 * result["e2e"], (total, result["e2e"], phases)  # never more than the client saw
    assert result["e2e"] - total <= 0.05 * result["e2e"] + unseen_s, (total, result["e2e"], phases)


def wait_until_every_worker_is_live(url: str, timeout_s: float = 120.0) -> None:
    """/health 200 means every pool has a live worker; this waits for all of them (a replacement included)."""
    deadline = time.monotonic() + timeout_s
    while not all(w["state"] == "live" for w in httpx.get(f"{url}/health", timeout=10).json()["workers"]):
        assert time.monotonic() < deadline, httpx.get(f"{url}/health", timeout=10).text
        time.sleep(0.2)


def e2e_count(url: str) -> float:
    return metric_values(url, "pdserve_e2e_request_latency_seconds_count").get(None) or 0.0


def phase_histograms(url: str, requests: float, timeout_s: float = 20.0) -> tuple[dict, dict]:
    """({phase: count}, {phase: sum}) from /metrics once the server has `requests` end-to-end samples (a stream's
    close, which observes both, runs just after its [DONE] is sent). Asserts the identity behind them: every phase
    label is exported and the phase sums add up to the end-to-end sum (every request so far was single-choice)."""
    deadline = time.monotonic() + timeout_s
    while e2e_count(url) != requests:
        assert time.monotonic() < deadline, f"{e2e_count(url)} end-to-end samples, not {requests}"
        time.sleep(0.1)
    counts = metric_values(url, "pdserve_request_phase_seconds_count")
    sums = metric_values(url, "pdserve_request_phase_seconds_sum")
    assert len(counts) == len(sums) == len(PHASES), counts
    counts = {p: counts[f'{{phase="{p}"}}'] for p in PHASES}
    sums = {p: sums[f'{{phase="{p}"}}'] for p in PHASES}
    e2e_sum = metric_values(url, "pdserve_e2e_request_latency_seconds_sum")[None]
    assert math.isclose(math.fsum(sums.values()), e2e_sum, rel_tol=1e-9, abs_tol=1e-6), (sums, e2e_sum)
    return counts, sums
