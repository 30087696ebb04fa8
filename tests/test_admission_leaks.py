"""Admission as a reservation on the real server (`pdserve serve`, tiny model, 1 prefill + 1 decode over UCX):
requests dropped by their clients in every phase (waiting in prefill, during the KV handoff, mid-decode) give back
everything they booked, and requests whose prefill failed (an injected error) run whole on the decode worker, exactly,
their failed attempts leaving nothing booked. Afterwards a request of every size
is served, the coordinator's bookings are zero, and every engine's blocks are free. Under saturation the admission
path answers 503 with Retry-After, never a 5xx, and the decode engine never preempts (the output is booked)."""

import asyncio
import time

import httpx
import pytest

from engine import LLM, SamplingParams
from tests.engine_helpers import random_prompts
from tests.server_process import (
    HALF_CPU,
    OPERATOR,
    assert_nothing_booked,
    metric_values,
    running_server,
    stream_until,
)

pytestmark = pytest.mark.timeout(400)
VOCAB = 2000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = {"model": "tiny", "prefill": {**HALF_CPU, "chunk_size": 256, "kv_cache_memory_bytes": 256 << 20},
              "decode": {**HALF_CPU, "kv_cache_memory_bytes": 128 << 20},  # 2,048 blocks of 16 tokens
              "transfer": {"backends": ["ucx"]}, "server": {"admin_api": True},
              # the whole output booked up front (not the default growing bookings: test_serving_bookings), so a
              # flood is answered 503 and never preempted
              "admission": {"timeout_s": 5, "reserve_output": 1.0}}
    with running_server(tmp_path_factory.mktemp("leaks"), config) as srv:
        yield srv


def _booked(url: str, name: str) -> float:
    return sum(metric_values(url, name).values())


def _serves_every_size(url: str) -> None:
    for n in (1, 17, 600, 1800):
        prompt = random_prompts([n], VOCAB, seed=n)[0]
        r = httpx.post(f"{url}/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 200, (n, r.text)
        assert r.json()["usage"]["completion_tokens"] == 8


def test_drops_in_every_phase_and_prefill_errors_leave_nothing_booked(server):
    url = server.url
    long = random_prompts([1800] * 60, VOCAB, seed=41)

    async def drop_during_prefill():
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(stream_until(client, url, {"model": "tiny", "prompt": p, "max_tokens": 32,
                                                                      "ignore_eos": True}, 10**9)) for p in long]
            while _booked(url, "pdserve_worker_booked_prompt_tokens") < 10 * 1800:
                await asyncio.sleep(0.01)
            for t in tasks:  # the admitted ones are in prefill, the rest wait for room: their clients go away now
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    asyncio.run(drop_during_prefill())
    assert_nothing_booked(server.url)

    # during the handoff: every transfer stalls 2 s, each client leaves after its first token
    r = httpx.post(f"{url}/admin/faults", headers=OPERATOR, timeout=30,
                   json={"transfer_stall_fraction": 1.0, "transfer_stall_s": 2.0})
    assert r.status_code == 200, r.text
    # the first token does not wait for the pushed KV: it streams while the (stalled) writes are still under way,
    # and the decode worker joins once they have landed (the stall is the lever: 2 s each side of it, no timing)
    prompt = random_prompts([120], VOCAB, seed=41)[0]
    start = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True, "stream": True}) as s:
        stamps = [time.monotonic() - start for line in s.iter_lines() if line.startswith("data: {")]
    # token 1 before the writes, the rest after (tokens that arrive together may share a chunk: 2-4 chunks)
    assert 2 <= len(stamps) <= 4 and stamps[0] < 2.0 <= stamps[1], stamps
    short = random_prompts([100 + i for i in range(60)], VOCAB, seed=42)

    async def drop_after(chunks: int, prompts, max_tokens: int):
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[stream_until(client, url, {"model": "tiny", "prompt": p, "ignore_eos": True,
                                                                      "max_tokens": max_tokens}, chunks)
                                          for p in prompts])
    assert asyncio.run(drop_after(1, short, 64)) == [1] * 60
    assert httpx.post(f"{url}/admin/faults", headers=OPERATOR, json={}, timeout=30).status_code == 200
    assert_nothing_booked(server.url)

    # mid-decode
    assert asyncio.run(drop_after(5, short, 300)) == [5] * 60
    assert_nothing_booked(server.url)

    # an injected prefill error: each request runs whole on the decode worker instead (recovery.prefill_retry),
    # exactly, its failed attempt booking nothing left behind
    assert httpx.post(f"{url}/admin/faults", headers=OPERATOR, json={"prefill_error_fraction": 1.0},
                      timeout=30).status_code == 200
    retried = metric_values(url, "pdserve_migrations_total").get('{event="prefill_retried"}', 0)
    prompts = random_prompts([200] * 60, VOCAB, seed=44)
    want = [o.text for o in LLM("tiny").generate(prompts, SamplingParams(temperature=0, max_tokens=8))]

    async def failing():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[client.post(f"{url}/v1/completions", json={
                "model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 0}) for p in prompts])
    responses = asyncio.run(failing())
    group = httpx.post(f"{url}/v1/completions", timeout=120, json={  # n > 1: prefilled on the decode worker
        "model": "tiny", "prompt": prompts[0], "max_tokens": 8, "temperature": 0, "n": 2})
    assert httpx.post(f"{url}/admin/faults", headers=OPERATOR, json={}, timeout=30).status_code == 200
    assert {r.status_code for r in responses} == {200}, {r.status_code for r in responses}
    assert [r.json()["choices"][0]["text"] for r in responses] == want
    assert group.status_code == 200 and [c["text"] for c in group.json()["choices"]] == [want[0]] * 2, group.text
    assert metric_values(url, "pdserve_migrations_total")['{event="prefill_retried"}'] - retried == 61
    assert_nothing_booked(server.url)
    _serves_every_size(url)
    assert_nothing_booked(server.url)


def test_saturation_gets_503_with_retry_after_and_nothing_leaks(server):
    url = server.url
    prompts = random_prompts([1000] * 60, VOCAB, seed=43)  # 70 blocks booked each: 29 fit at once
    preempted_before = _booked(url, "pdserve_worker_engine_preemptions_total")

    async def flood():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=200)) as client:
            return await asyncio.gather(*[client.post(f"{url}/v1/completions", json={
                "model": "tiny", "prompt": p, "max_tokens": 100, "ignore_eos": True}) for p in prompts])
    responses = asyncio.run(flood())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503}, codes
    assert codes.count(503) > 0 and codes.count(200) > 0, codes
    for r in responses:
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1 and "room" in r.json()["error"]["message"], r.text
        else:
            assert r.json()["usage"]["completion_tokens"] == 100
    assert _booked(url, "pdserve_worker_engine_preemptions_total") == preempted_before  # no preemption at all
    assert_nothing_booked(server.url)
    _serves_every_size(url)


def test_a_request_ended_by_its_first_token_gives_back_the_decode_blocks_booked_during_its_prefill(server):
    # the decode worker books a request's KV blocks while its prompt is prefilled (decode_pool.reservations); a
    # request whose first token ends it never reaches the handoff that would take them
    for n in (17, 600, 1800):
        prompt = random_prompts([n], VOCAB, seed=n + 7)[0]
        r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
    assert_nothing_booked(server.url)
