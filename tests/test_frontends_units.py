"""What crosses between the core and the HTTP processes (coordinator.frontends): errors keep what the HTTP layer
answers with (status, Retry-After, headers), a phase trace taken over keeps its sum identity, a Link delivers a
turn's messages as one frame in order and ends when the peer goes, a Link whose peer stops reading is cut off instead
of buffering without end, and a scrape adds other processes' figures in."""

import asyncio
import socket

import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator import errors
from coordinator.api.drain import Lifecycle
from coordinator.contract import BackendError, Overloaded, PrefillFailed, RequestTooLarge, TransferFailed, WorkerLost
from coordinator.frontends import link as link_module
from coordinator.frontends.link import Link, LinkClosed
from coordinator.frontends.wire import decode_error, encode_error
from coordinator.observability.metrics import Metrics
from coordinator.observability.phases import PhaseTrace


@pytest.mark.parametrize("error", [Overloaded("full", retry_after_s=3.5), RequestTooLarge("huge"), WorkerLost("gone"),
                                   BackendError("broken"), TransferFailed("no KV"), PrefillFailed("failed there"),
                                   ValueError("no rank 7"),
                                   errors.APIError(429, "slow down", "requests", "rate_limited",
                                                   code="rate_limit_exceeded", headers={"Retry-After": "2"})])
def test_errors_cross_with_what_the_http_layer_answers_with(error):
    back = decode_error(encode_error(error))
    assert type(back) is type(error) and str(back) == str(error)
    if isinstance(error, Overloaded):
        assert back.retry_after_s == 3.5
    if isinstance(error, errors.APIError):
        assert (back.status, back.kind, back.code, back.headers) == (429, "rate_limited", "rate_limit_exceeded",
                                                                      {"Retry-After": "2"})


def test_an_unexpected_error_crosses_as_a_backend_error_naming_nothing_of_it():
    """Its type and text are the core process's log's (issue 46: no Python type names in answers)."""
    back = decode_error(encode_error(KeyError("secret detail")))
    assert type(back) is BackendError and "KeyError" not in str(back) and "secret" not in str(back)
    assert "internal error in the core process" in str(back)


def test_a_trace_taken_over_keeps_the_phases_summing_to_the_whole():
    frontend = PhaseTrace(100.0)
    frontend.mark("ingress", 100.002)
    core = PhaseTrace.restored(frontend.state())  # the core goes on marking its copy
    core.mark("admission", 100.005)
    core.split([("prefill_queue", 0.001), ("prefill_compute", 0.010)], 100.020)
    frontend.adopt(core.state())
    phases = frontend.finish(100.030)
    assert phases["ingress"] == pytest.approx(0.002) and phases["admission"] == pytest.approx(0.003)
    assert phases["prefill_compute"] == pytest.approx(0.010)
    assert sum(phases.values()) == pytest.approx(0.030)
    frontend.adopt(PhaseTrace(100.0).state())  # a finished trace (or an older state) does not change
    assert frontend.finish() == phases


def test_a_link_sends_one_turns_messages_as_one_frame_in_order_and_ends_with_its_peer():
    async def run():
        a, b = socket.socketpair()
        left = Link(*await asyncio.open_connection(sock=a))
        right = Link(*await asyncio.open_connection(sock=b))
        for i in range(5):
            left.send(("delta", i, list(range(i))))
        frames = right.batches()
        first = await anext(frames)
        left.send(("end", 9))
        second = await anext(frames)
        left.close()
        rest = [batch async for batch in frames]
        right.close()
        return first, second, rest
    first, second, rest = asyncio.run(run())
    assert first == [("delta", i, list(range(i))) for i in range(5)]
    assert second == [("end", 9)] and rest == []


def test_a_link_whose_peer_stops_reading_is_cut_off_and_both_ends_see_it_end(monkeypatch):
    monkeypatch.setattr(link_module, "MAX_BUFFERED_BYTES", 1 << 20)

    async def run() -> tuple[int, list]:
        a, b = socket.socketpair()
        left = Link(*await asyncio.open_connection(sock=a))
        right = Link(*await asyncio.open_connection(sock=b))  # never reads until the end
        sent = 0
        with pytest.raises(LinkClosed):
            for _ in range(10_000):  # 64 KiB a turn: far past the kernel's buffers and the limit
                left.send(("tokens", sent, b"x" * (64 << 10)))
                sent += 1
                await asyncio.sleep(0)
        received = [batch async for batch in right.batches()]  # what got through, then the end
        right.close()
        return sent, received
    sent, received = asyncio.run(run())
    assert 16 <= sent < 10_000
    assert sum(len(batch) for batch in received) < sent  # cut off: what was left unsent never arrives


def _values(text: bytes) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text.decode()) for s in f.samples}


def test_a_scrape_adds_the_other_processes_requests_and_takes_the_largest_draining_flag():
    class Idle:
        def stats(self):
            return {"workers": [], "queue_length": 0}
    mine, other = Metrics("tiny"), Metrics("tiny")
    lifecycles = Lifecycle(), Lifecycle()
    for metrics, lifecycle in zip((mine, other), lifecycles, strict=True):
        metrics.watch(Idle(), lifecycle)
    mine.requests.inc("finished", 2)
    other.requests.inc("finished", 3)
    other.requests.inc("timeout")
    other.ttft.observe(0.02)
    mine.ttft.observe(0.3)
    lifecycles[1].admit()
    lifecycles[1].begin_drain()
    merged = _values(mine.exposition([other.local_families()]))
    assert merged[("pdserve_requests_total", (("outcome", "finished"),))] == 5
    assert merged[("pdserve_requests_total", (("outcome", "timeout"),))] == 1
    assert merged[("pdserve_time_to_first_token_seconds_count", ())] == 2
    assert merged[("pdserve_time_to_first_token_seconds_bucket", (("le", "0.025"),))] == 1
    assert merged[("vllm:time_to_first_token_seconds_count", (("model_name", "tiny"),))] == 2
    assert merged[("pdserve_requests_in_flight", ())] == 1
    assert merged[("pdserve_draining", ())] == 1
    assert _values(mine.exposition())[("pdserve_requests_total", (("outcome", "finished"),))] == 2
