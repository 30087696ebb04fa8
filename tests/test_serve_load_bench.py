"""benchmarks/serve_load.py smoke on the CPU: its wait for the workers' deferred CUDA graphs measures a warm server
(no capture falls in the streams), says what it waited for, and never waits past its timeout; a round's figures
come from its streams' stamps as stated (chunk gaps, TPOT, tokens per chunk, the client's CPU per second)."""

from __future__ import annotations

import argparse

from benchmarks.serve_load import GRAPHS_PENDING, round_figures, wait_for_graphs


def gauges(*readings):
    """A /metrics reader that returns `readings` in turn (the last one again after), recording what it was asked."""
    asked, left = [], list(readings)

    def values(url, name):
        asked.append((url, name))
        return left.pop(0) if len(left) > 1 else left[0]
    return values, asked


def test_waits_until_every_worker_has_captured_its_graphs():
    values, asked = gauges({'{worker="decode-0"}': 5.0, '{worker="decode-1"}': 2.0},
                           {'{worker="decode-0"}': 1.0, '{worker="decode-1"}': 0.0},
                           {'{worker="decode-0"}': 0.0, '{worker="decode-1"}': 0.0})
    got = wait_for_graphs("http://s", timeout_s=10, poll_s=0.001, values=values)
    assert got["graphs_ready"] and got["graphs_pending_at_start"] == 7 and len(asked) == 3
    assert asked[0] == ("http://s", GRAPHS_PENDING)


def test_a_server_without_the_gauge_is_ready_after_a_short_look():
    values, asked = gauges({})
    got = wait_for_graphs("http://s", timeout_s=10, poll_s=0.001, absent_s=0.02, values=values)
    assert got == {"graphs_pending_at_start": 0, "graphs_wait_s": got["graphs_wait_s"], "graphs_ready": True}
    assert len(asked) > 1 and got["graphs_wait_s"] >= 0.02


def test_graphs_still_pending_at_the_timeout_are_reported_not_waited_for():
    values, _ = gauges({'{worker="decode-0"}': 3.0})
    got = wait_for_graphs("http://s", timeout_s=0.05, poll_s=0.001, values=values)
    assert got["graphs_ready"] is False and got["graphs_pending_at_start"] == 3 and got["graphs_wait_s"] >= 0.05


def stream(start: float, stamps: list[float], tokens: int) -> dict:
    """stream_one's record of a stream sent at `start` whose chunks came at `stamps`, carrying `tokens` in all."""
    return {"ttft": stamps[0] - start, "itl": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
            "tokens": tokens, "chunks": len(stamps), "e2e": stamps[-1] - start}


def test_a_rounds_figures_say_how_tokens_came_and_what_the_client_spent():
    """Two streams of 4 tokens: one a chunk a token every 10 ms, one in 3 chunks (its last three tokens as a pair and
    a single): TPOT from the first chunk to the last, gaps per chunk, 8 tokens in 7 chunks."""
    args = argparse.Namespace(requests=2, prompt_len=16, max_tokens=4, client_processes=1)
    results = [stream(0.0, [0.100, 0.110, 0.120, 0.130], 4), stream(0.0, [0.200, 0.220, 0.240], 4)]
    got = round_figures(results, wall=0.5, client_cpu_s=0.25, args=args)
    assert got["all_tokens_received"] and got["ttft_ms_p50"] == 200.0 and got["ttft_ms_p90"] == 200.0
    assert got["tpot_ms_p50"] == 13.33  # (0.240 - 0.200) / 3 against (0.130 - 0.100) / 3: the upper median
    assert got["chunk_gap_ms_p50"] == 10.0 and got["chunk_gap_ms_p99"] == 20.0
    assert got["tokens_per_chunk"] == round(8 / 7, 3) and got["output_tokens_per_s"] == 16.0
    assert got["client_cpu_s_per_s"] == 0.5
    assert not round_figures(results[:1] + [stream(0.0, [0.2, 0.3], 3)], 0.5, 0.0, args)["all_tokens_received"]
