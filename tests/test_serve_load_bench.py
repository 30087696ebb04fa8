"""benchmarks/serve_load.py smoke's wait for the workers' deferred CUDA graphs, on the CPU: it measures a warm
server (no capture falls in the streams), says what it waited for, and never waits past its timeout."""

from __future__ import annotations

from benchmarks.serve_load import GRAPHS_PENDING, wait_for_graphs


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
