"""Request life cycle against a real uvicorn server: a client that goes away mid-stream or mid-request gets its
request aborted in the engine (blocks freed), timeouts end requests, draining refuses new work but lets running
streams finish, and /metrics counts all of it; and a Generation's deadline against a real in-process backend."""

import asyncio
import json
import time

import httpx
import pytest

from coordinator.api.app import create_app
from coordinator.api.lifecycle import Generation
from coordinator.api.text_output import TextOutput
from coordinator.config.settings import ServerSettings
from coordinator.contract import GenerateRequest
from coordinator.errors import APIError
from coordinator.observability.metrics import Metrics
from engine import LLM, SamplingParams
from tests.inprocess_backend import InProcessBackend, ServerThread, wait_until
from tests.server_process import streamed_chunks

pytestmark = pytest.mark.timeout(60)
LONG = {"model": "tiny", "prompt": "The old lighthouse", "max_tokens": 40, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def engine(checkpoints):
    return LLM(str(checkpoints.tiny()), max_model_len=64).engine


@pytest.fixture
def server(engine, checkpoints, request):
    settings = getattr(request, "param", {})
    backend = InProcessBackend(engine, checkpoints.tiny())
    with ServerThread(create_app(backend, ServerSettings(**settings)), backend) as srv:
        yield srv
    assert backend.idle and backend.integrity["in_use"] == 0


def metric(server, line_start: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start + " ")]
    assert len(values) == 1, line_start
    return values[0]


def test_client_disconnect_mid_stream_aborts_the_request_and_frees_its_blocks(server):
    backend = server.backend
    backend.pause_after(3)  # three tokens, then the request cannot finish on its own
    with httpx.Client(base_url=server.url, timeout=10) as client:
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            lines = r.iter_lines()  # keep it referenced: dropping it closes the response
            first = json.loads(next(line for line in lines if line)[6:])  # the stream has begun
            assert wait_until(lambda: backend.integrity["in_use"] > 0 and backend._paused.is_set())
    # the response is closed: the server must notice and abort the request
    request_id = first["id"]
    assert wait_until(lambda: request_id in backend.aborted and backend.idle), (backend.aborted, backend.integrity)
    backend.resume()
    assert request_id not in backend.finished and backend.generate_calls == 1
    assert backend.engine.check_integrity()["in_use"] == 0 and not backend.engine.has_unfinished()
    assert wait_until(lambda: metric(server, 'pdserve_requests_total{outcome="aborted"}') == 1)
    assert metric(server, "pdserve_requests_in_flight") == 0


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_before_any_output_aborts_the_request(server, stream):
    """Non-streamed, or streamed before the first token (no response started yet)."""
    backend = server.backend
    backend.pause()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**LONG, "stream": stream},
                   timeout=httpx.Timeout(10, read=0.3))
    assert wait_until(lambda: len(backend.aborted) == 1 and backend.idle), backend.aborted
    backend.resume()
    assert not backend.finished


@pytest.mark.parametrize("server", [{"request_timeout_s": 1.0}], indirect=True)
def test_requests_end_at_their_timeout(server):
    backend = server.backend
    warm = httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 1}, timeout=30)
    assert warm.status_code == 200  # the first step of a fresh engine may be slow; the first token must not be
    backend.pause()
    r = httpx.post(server.url + "/v1/completions", json=LONG, timeout=10)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    r = httpx.post(server.url + "/v1/completions", json={**LONG, "stream": True}, timeout=10)
    assert r.status_code == 504  # nothing was sent yet: a plain error response
    backend.resume()
    backend.pause_after(1)  # the first token, then nothing until the deadline
    with httpx.Client(base_url=server.url, timeout=10) as client:
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            lines = (line for line in r.iter_lines() if line)
            first = next(lines)
            rest = list(lines)
    assert first.startswith("data: {") and rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["error"]["code"] == "timeout"
    assert wait_until(lambda: len(backend.aborted) == 3 and backend.idle), backend.aborted
    backend.resume()
    assert metric(server, 'pdserve_requests_total{outcome="timeout"}') == 3
    assert metric(server, 'pdserve_requests_total{outcome="finished"}') == 1


def test_draining_refuses_new_requests_and_lets_running_streams_finish(server):
    backend, lifecycle = server.backend, server.app.state.lifecycle
    assert httpx.get(server.url + "/health").status_code == 200
    backend.pause_after(1)
    with httpx.Client(base_url=server.url, timeout=10) as client:
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            lines = (line for line in r.iter_lines() if line)
            first = next(lines)
            lifecycle.begin_drain()
            health = client.get("/health")
            assert health.status_code == 503 and health.headers["retry-after"]
            refused = client.post("/v1/chat/completions",
                                  json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]})
            assert refused.status_code == 503 and refused.headers["retry-after"]
            assert refused.json()["error"]["type"] == "server_error"
            assert not server.call(lifecycle.wait_idle(0.05))  # the stream is still running
            backend.resume()
            rest = list(lines)
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert server.call(lifecycle.wait_idle(10)) and lifecycle.in_flight == 0
    assert backend.generate_calls == 1 and first.startswith("data: {")
    assert metric(server, 'pdserve_errors_total{kind="draining"}') == 1


def test_metrics_report_latencies_outcomes_and_backend_load(server):
    with httpx.Client(base_url=server.url, timeout=10) as client:
        for stream in (False, True):
            assert client.post("/v1/completions", json={**LONG, "max_tokens": 5, "stream": stream}).status_code == 200
        assert client.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
        text = client.get("/metrics").text
    assert "pdserve_time_to_first_token_seconds_count 2" in text
    assert "pdserve_e2e_request_latency_seconds_count 2" in text
    assert "pdserve_inter_token_latency_seconds_count 8" in text  # 4 gaps per 5-token request, one token a step
    assert 'pdserve_requests_total{outcome="finished"} 2' in text
    assert 'pdserve_requests_total{outcome="rejected"} 1' in text
    assert 'pdserve_errors_total{kind="not_found"} 1' in text
    assert "pdserve_generation_tokens_total 10" in text
    assert 'pdserve_worker_total_blocks{role="both",worker="inprocess-0"}' in text  # prometheus_client sorts labels
    assert "pdserve_queue_length 0" in text and "pdserve_transfer_bytes_total 0" in text


def _generation(engine, checkpoints, timeout_s: float, stream_interval: int = 1):
    backend = InProcessBackend(engine, checkpoints.tiny())
    prompt = engine.tokenizer.encode("The old lighthouse")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    gen = Generation(backend, GenerateRequest("gen-1", prompt, params, stream_interval=stream_interval),
                     TextOutput(engine.tokenizer, prompt), Metrics("tiny"), timeout_s, False, time.monotonic())
    return backend, gen


def test_an_error_while_a_chunk_gathers_comes_after_the_tokens_already_taken(engine, checkpoints):
    """stream_interval 8: the deadline passes with a few tokens of the next chunk taken; the client gets them
    (every token it is charged for), then the 504."""
    async def main():
        backend, gen = _generation(engine, checkpoints, 1.0, stream_interval=8)
        await backend.start()
        try:
            pieces = [await gen.next_piece()]  # the first token, at once
            backend.pause_after(3)             # a few more tokens, then none: the deadline passes mid-chunk
            with pytest.raises(APIError) as e:
                while True:
                    pieces.append(await gen.next_piece())
            assert e.value.status == 504
            assert len(pieces) >= 2 and pieces[-1].finish_reason is None  # the partial chunk came out first
            assert "".join(p.text for p in pieces) == gen.text.text and gen.completion_tokens > 1
            await gen.close("timeout")
        finally:
            backend.resume()
            await backend.shutdown()
    asyncio.run(main())


def test_a_deadline_that_passes_during_a_wait_is_a_504_and_leaves_the_task_uncancelled(engine, checkpoints):
    """One timer per request cancels the wait under way at the deadline: the caller sees the 504, and its task
    carries no cancellation on (it goes on to send the error event)."""
    async def main():
        backend, gen = _generation(engine, checkpoints, 0.5)
        backend.pause_after(1)  # the first token, then nothing (a pause() after it could come a step late)
        await backend.start()
        try:
            assert (await gen.next_piece()).text is not None  # the first token
            with pytest.raises(APIError) as e:
                await gen.next_piece()
            assert e.value.status == 504 and e.value.kind == "timeout"
            assert asyncio.current_task().cancelling() == 0
            await asyncio.sleep(0)  # no cancellation left to deliver
            with pytest.raises(APIError) as again:  # past the deadline: at once, without waiting
                await gen.next_piece()
            assert again.value.status == 504
            await gen.close("timeout")
            backend.resume()
            assert await asyncio.to_thread(wait_until, lambda: backend.idle) and backend.aborted == ["gen-1"]
        finally:
            backend.resume()
            await backend.shutdown()
    asyncio.run(main())


def test_a_cancellation_that_is_not_the_deadline_stays_a_cancellation(engine, checkpoints):
    """A client gone (its task cancelled) while the request waits for a token: no 504, the cancellation goes on."""
    async def main():
        backend, gen = _generation(engine, checkpoints, 30.0)
        backend.pause_after(1)
        await backend.start()
        try:
            await gen.next_piece()
            waiting = asyncio.ensure_future(gen.next_piece())
            await asyncio.sleep(0.05)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await gen.close("aborted")
            assert backend.aborted == ["gen-1"]
        finally:
            backend.resume()
            await backend.shutdown()
    asyncio.run(main())


@pytest.mark.parametrize("server", [{"stream_interval": 4}], indirect=True)
def test_stream_interval_sends_the_first_token_at_once_then_chunks_of_that_many(server):
    counts, text = streamed_chunks(server.url, LONG)
    assert sum(counts) == LONG["max_tokens"] and counts[0] == 1
    assert all(c >= 4 for c in counts[1:-1]) and counts[-1] >= 1  # the end goes out with what is left
    assert len(counts) <= 1 + -(-(LONG["max_tokens"] - 1) // 4)
    whole = httpx.post(server.url + "/v1/completions", json=LONG, timeout=30).json()["choices"][0]["text"]
    assert text == whole  # the same output, in fewer chunks


def test_without_stream_interval_every_token_is_its_own_chunk(server):
    counts, _ = streamed_chunks(server.url, LONG)
    assert sum(counts) == LONG["max_tokens"] and len(counts) > LONG["max_tokens"] // 2


def test_a_tenants_stream_interval_applies_to_its_requests_only(engine, checkpoints):
    from coordinator.config.tenants_config import TenantConfig, TenantsConfig
    tenants = TenantsConfig((TenantConfig("bulk", ("k-bulk",), priority="low", stream_interval=8),
                             TenantConfig("chat", ("k-chat",), priority="high")))
    backend = InProcessBackend(engine, checkpoints.tiny())
    with ServerThread(create_app(backend, ServerSettings(), tenants), backend) as srv:
        bulk, _ = streamed_chunks(srv.url, LONG, "k-bulk")
        chat, _ = streamed_chunks(srv.url, LONG, "k-chat")
    assert sum(bulk) == sum(chat) == LONG["max_tokens"]
    assert bulk[0] == 1 and all(c >= 8 for c in bulk[1:-1]) and len(bulk) <= 1 + -(-39 // 8)
    assert len(chat) > len(bulk)
    assert backend.idle and backend.integrity["in_use"] == 0
