"""Tenants on the real server (`pdserve serve`, tiny, 1 prefill + 1 decode), served by two HTTP processes in front of
one core (`server.api_processes: 2`, coordinator.frontends): keys map to tenants, a tenant's rate limit answers 429
with Retry-After and is one limit across the processes, and a flood from a low-priority tenant does not hold back a
high-priority one: once the high requests arrive, no waiting low request starts before them (counted in the order
first tokens arrive, no clock). Per-tenant usage in /metrics is exact. A tenant's stream_interval chunks its streams
(the decode poll holds its outputs back, coordinator.backend.held_queue) without changing what they say.
The HTTP processes: each keep-alive connection stays with the process that accepted it, and /health says which one
(`http_process`), so the last tests pin a client to each: both serve; a scrape of either counts every request of
both; a SIGKILLed HTTP process is replaced, what its streams held is freed (the core aborts them when its link
ends), and what it had counted stays counted; choices (n > 1), token logprobs and echoed prompt logprobs cross the
processes whole."""

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.engine_helpers import random_prompts
from tests.inprocess_backend import wait_until
from tests.server_process import (
    HALF_CPU,
    OPERATOR,
    assert_nothing_booked,
    frontend_pids,
    metric_values,
    running_server,
    streamed_chunks,
    wait_for_idle_workers,
)

pytestmark = pytest.mark.timeout(300)
PROMPT_LEN, MAX_TOKENS = 32, 80  # 8 KV blocks booked each: 7 low requests fill the 60 blocks low may book
LONG_TOKENS = 300  # the killed HTTP process's three streams (21 blocks each): far from done when it dies


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = {"model": "tiny", "prefill": HALF_CPU, "decode": {**HALF_CPU, "num_kv_blocks": 80},
              "transfer": {"backends": ["ucx"]},
              # the whole output booked up front (PROMPT_LEN's arithmetic), not the default growing bookings
              "admission": {"timeout_s": 120, "priority_aging_s": 1000, "reserved_for_high": 0.25,
                            "reserve_output": 1.0},
              "tenants": [{"name": "interactive", "api_keys": ["k-high"], "priority": "high"},
                          {"name": "bulk", "api_keys": ["k-low"], "priority": "low"},
                          {"name": "metered", "api_keys": ["k-rpm"], "requests_per_minute": 2},
                          {"name": "chunky", "api_keys": ["k-chunky"], "stream_interval": 4},
                          {"name": "metered2", "api_keys": ["k-rpm2"], "requests_per_minute": 2}],
              "server": {"api_processes": 2, "admin_api": True}}
    with running_server(tmp_path_factory.mktemp("tenants"), config) as srv:
        yield srv


def _body(prompt):
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}


def test_keys_are_tenants_and_rate_limits_answer_429(server):
    url = server.url
    ok = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=ok, timeout=60).status_code == 401
    assert httpx.post(f"{url}/v1/completions", json=ok, timeout=60,
                      headers={"Authorization": "Bearer nope"}).status_code == 401
    metered = {"Authorization": "Bearer k-rpm"}
    codes = [httpx.post(f"{url}/v1/completions", json=ok, headers=metered, timeout=60) for _ in range(3)]
    assert [r.status_code for r in codes] == [200, 200, 429]
    refused = codes[2]
    assert int(refused.headers["retry-after"]) >= 1 and refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert metric_values(url, "pdserve_tenant_rate_limited_total")['{tenant="metered"}'] == 1


def test_a_low_priority_flood_does_not_hold_back_high_priority_requests(server):
    url = server.url
    low_prompts = random_prompts([PROMPT_LEN] * 40, 2000, seed=51)
    high_prompts = random_prompts([PROMPT_LEN] * 8, 2000, seed=52)
    order: list[str] = []  # who got a first token, in arrival order
    high_sent_at = [None]

    async def stream(client, prompt, key, tag):
        async with client.stream("POST", f"{url}/v1/completions", json=_body(prompt),
                                 headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status_code == 200
            first = True
            async for line in r.aiter_lines():
                if line.startswith("data: ") and first:
                    first = False
                    order.append(tag)

    async def run():
        async with httpx.AsyncClient(timeout=240, limits=httpx.Limits(max_connections=100)) as client:
            lows = [asyncio.create_task(stream(client, p, "k-low", "low")) for p in low_prompts]
            while metric_values(url, "pdserve_queue_length").get(None, 0) < 20:  # the flood is queued
                await asyncio.sleep(0.05)
            highs = [asyncio.create_task(stream(client, p, "k-high", "high")) for p in high_prompts]
            # mark once every high is in the admission queue or has its first token: a low that finishes while a
            # high is still on the wire or in ingress (counted in flight, not yet queued) lets the next low in, and
            # that one is not the priority rule's to stop
            while (metric_values(url, "pdserve_queue_length_by_priority").get('{priority="1"}', 0)
                   + order.count("high")) < 8:
                await asyncio.sleep(0.01)
            high_sent_at[0] = len(order)
            await asyncio.gather(*lows, *highs)
    asyncio.run(run())
    after = order[high_sent_at[0]:]
    # no high after the mark: every high had its first token by then (served ahead of every low still waiting)
    last_high = max((i for i, tag in enumerate(after) if tag == "high"), default=None)
    lows_before_last_high = 0 if last_high is None else after[:last_high].count("low")
    # only low requests already granted a slot when the highs had arrived (at most 7) may start before the last high
    assert lows_before_last_high <= 7, (high_sent_at[0], order)
    usage = metric_values(url, "pdserve_tenant_requests_total")
    assert usage['{tenant="interactive",outcome="finished"}'] == 8
    assert usage['{tenant="bulk",outcome="finished"}'] == 40
    completion = metric_values(url, "pdserve_tenant_completion_tokens_total")
    assert completion['{tenant="interactive"}'] == 8 * MAX_TOKENS and completion['{tenant="bulk"}'] == 40 * MAX_TOKENS
    prompt = metric_values(url, "pdserve_tenant_prompt_tokens_total")
    assert prompt['{tenant="interactive"}'] == 8 * PROMPT_LEN
    wait_for_idle_workers(url)


def _set_faults(url: str, faults: dict) -> None:
    r = httpx.post(f"{url}/admin/faults", headers=OPERATOR, json=faults, timeout=30)
    assert r.status_code == 200, r.text


def test_a_tenants_stream_interval_chunks_its_streams_through_the_ray_backend(server):
    body = {"model": "tiny", "prompt": "The old lighthouse", "max_tokens": 30, "ignore_eos": True, "temperature": 0}
    # decode steps slowed so tokens come apart and chunks are made by the interval, not by a busy machine's
    # coalescing (a loaded CI once sent the first two tokens in one chunk)
    _set_faults(server.url, {"slow_step_s": 0.05, "slow_workers": ["decode-0"]})
    try:
        chunky, chunky_text = streamed_chunks(server.url, body, "k-chunky")
        plain, plain_text = streamed_chunks(server.url, body, "k-high")
    finally:
        _set_faults(server.url, {})
    assert sum(chunky) == sum(plain) == 30 and chunky_text == plain_text
    assert chunky[0] == 1 and all(c >= 4 for c in chunky[1:-1]) and len(chunky) <= 1 + -(-29 // 4)
    # the plain stream is not held back: a chunk of fewer than 4 tokens in its middle (a reader that falls behind
    # gets several tokens at once, so its chunk count alone says little: CI saw [1, 1, 3, 1, 10, 14])
    assert any(c < 4 for c in plain[1:-1]), plain


def _pinned(url: str, key: str = "k-high", want: dict[int, int] | None = None) -> dict[int, list[httpx.Client]]:
    """Clients kept alive on chosen HTTP processes: `want` {process index: clients} (default one on each), found by
    opening connections until each index answered /health often enough (the kernel gives a new connection to
    whichever process accepts first)."""
    want = want or {0: 1, 1: 1}
    clients: dict[int, list[httpx.Client]] = {i: [] for i in want}
    for _ in range(400):
        client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120,
                              limits=httpx.Limits(max_connections=1))
        index = client.get("/health").json()["http_process"]
        if len(clients.get(index, ())) < want.get(index, 0):
            clients[index].append(client)
        else:
            client.close()
        if all(len(clients[i]) == n for i, n in want.items()):
            return clients
        time.sleep(0.01)
    raise AssertionError(f"connections per HTTP process after 400 tries: { {i: len(c) for i, c in clients.items()} }")


def _completion(client: httpx.Client, max_tokens: int = 6, **extra) -> httpx.Response:
    return client.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": max_tokens,
                                                "ignore_eos": True, **extra})


def test_both_processes_serve_and_every_scrape_counts_both(server):
    clients = {i: c[0] for i, c in _pinned(server.url).items()}
    before = {i: metric_values(server.url, "pdserve_requests_total") for i in (0, 1)}
    assert before[0] == before[1]
    for index, requests in ((0, 3), (1, 2)):
        for n in range(requests):
            r = _completion(clients[index], stream=n % 2 == 1)
            assert r.status_code == 200, r.text
            assert clients[index].get("/health").json()["http_process"] == index  # still the same connection
    finished = []
    for client in clients.values():  # each process answers with both processes' counts
        text = client.get("/metrics").text
        line = next(x for x in text.splitlines() if x.startswith('pdserve_requests_total{outcome="finished"}'))
        finished.append(float(line.split()[-1]))
        tokens = next(x for x in text.splitlines() if x.startswith("pdserve_generation_tokens_total "))
        assert float(tokens.split()[-1]) >= 5 * 6
    start = before[0].get('{outcome="finished"}', 0)
    assert finished == [start + 5, start + 5]
    stalls = metric_values(server.url, "pdserve_http_loop_stalls_total")  # each process's own loop, by index
    assert set(stalls) == {'{http_process="0"}', '{http_process="1"}'}, stalls
    for client in clients.values():
        client.close()


def test_a_tenants_limit_is_one_limit_across_the_processes(server):
    clients = {i: c[0] for i, c in _pinned(server.url, key="k-rpm2").items()}
    assert _completion(clients[0]).status_code == 200
    assert _completion(clients[1]).status_code == 200  # the second of two per minute, through the other process
    refused = _completion(clients[0])
    assert refused.status_code == 429 and "Retry-After" in refused.headers, refused.text
    usage = metric_values(server.url, "pdserve_tenant_rate_limited_total")
    assert usage['{tenant="metered2"}'] == 1
    for client in clients.values():
        client.close()


def test_a_killed_http_process_is_replaced_and_what_its_streams_held_is_freed(server):
    pids = frontend_pids(server.pid)
    assert sorted(pids) == [0, 1]
    clients = _pinned(server.url, want={0: 3, 1: 1})  # three streams' connections on process 0, one client on 1
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": True}
    sampled = sum(metric_values(server.url, "pdserve_worker_engine_sampled_tokens_total").values())
    assert _completion(clients[0][0]).status_code == 200  # counted by process 0, which dies below
    counted = _finished(clients[1][0])  # a scrape through process 1 collects process 0's counts too
    responses = [c.send(c.build_request("POST", "/v1/completions", json=body), stream=True) for c in clients[0]]
    lines = [r.iter_lines() for r in responses]
    for r, it in zip(responses, lines, strict=True):  # every stream has begun: each holds a decode booking now
        assert r.status_code == 200
        assert next(line for line in it if line.startswith("data: {"))
    os.kill(pids[0], signal.SIGKILL)
    cut = 0
    for it in lines:
        try:
            for _ in it:
                pass
        except httpx.HTTPError:
            cut += 1
    assert cut == len(responses)
    assert _completion(clients[1][0]).status_code == 200  # the other process serves meanwhile
    assert wait_until(lambda: set(frontend_pids(server.pid)) == {0, 1} and frontend_pids(server.pid)[0] != pids[0],
                      60, 0.2)
    for key in ("k-high", "k-low"):  # a tenant's key is a client's, not an operator's, whatever its class
        r = httpx.get(f"{server.url}/admin/integrity", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 403 and r.json()["error"]["code"] == "operator_key_required"
        assert httpx.post(f"{server.url}/admin/workers/decode-0/kill", headers={"Authorization": f"Bearer {key}"},
                          timeout=30).status_code == 403
    assert_nothing_booked(server.url)
    # the core aborted the dead process's streams, rather than letting them run to their end
    sampled = sum(metric_values(server.url, "pdserve_worker_engine_sampled_tokens_total").values()) - sampled
    assert sampled < len(responses) * LONG_TOKENS / 2, sampled
    for group in clients.values():
        for client in group:
            client.close()
    fresh = _pinned(server.url)  # both processes, the replacement included, serve again
    for (client,) in fresh.values():
        assert _finished(client) >= counted  # the dead process's counts stay: the merged counter never goes down
        assert _completion(client).status_code == 200
        client.close()


def _finished(client: httpx.Client) -> float:
    """pdserve_requests_total{outcome="finished"} in a scrape through this client's HTTP process."""
    line = next(x for x in client.get("/metrics").text.splitlines()
                if x.startswith('pdserve_requests_total{outcome="finished"}'))
    return float(line.split()[-1])


def test_choices_and_logprobs_cross_the_http_processes(server):
    """n > 1 (the core's group stream), per-token logprobs and echoed prompt logprobs through an HTTP process."""
    headers = {"Authorization": "Bearer k-high"}
    body = {"model": "tiny", "prompt": "The old lighthouse", "max_tokens": 8, "ignore_eos": True, "n": 2,
            "logprobs": 1, "seed": 3}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert all(len(c["logprobs"]["tokens"]) == 8 and c["finish_reason"] == "length" for c in choices)
    tokens = {0: 0, 1: 0}
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, headers=headers,
                      timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    tokens[c["index"]] += len(c["logprobs"]["tokens"])
    assert tokens == {0: 8, 1: 8}
    echo = httpx.post(f"{server.url}/v1/completions", headers=headers, timeout=60,
                      json={"model": "tiny", "prompt": "hello there", "max_tokens": 2, "echo": True, "logprobs": 0})
    assert echo.status_code == 200, echo.text
    lp = echo.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) > 2  # the prompt's tokens, then the two new ones
