"""`server.api_processes: 2` on the real server (`pdserve serve`, tiny, 1 prefill + 1 decode): two HTTP processes in
front of one core. Each keep-alive connection stays with the process that accepted it, and /health says which one
(`http_process`), so the tests pin a client to each process: both serve; a scrape of either counts every request
of both; a tenant's limit is one limit across them; a SIGKILLed HTTP process is replaced, and what its streams
held is freed (the core aborts them when its link ends)."""

import os
import signal
import time

import httpx
import pytest

from tests.inprocess_backend import wait_until
from tests.server_process import HALF_CPU, assert_nothing_booked, frontend_pids, metric_values, running_server

pytestmark = pytest.mark.timeout(300)
MAX_TOKENS = 1500  # the killed process's streams: far from done when it dies


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = {"model": "tiny", "prefill": HALF_CPU, "decode": HALF_CPU, "transfer": {"backends": ["ucx"]},
              "server": {"api_processes": 2, "admin_api": True},
              "tenants": [{"name": "open", "api_keys": ["k-open"]},
                          {"name": "metered", "api_keys": ["k-rpm"], "requests_per_minute": 2}]}
    with running_server(tmp_path_factory.mktemp("frontends"), config) as srv:
        yield srv


def _pinned(url: str, key: str = "k-open", want: dict[int, int] | None = None) -> dict[int, list[httpx.Client]]:
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
    for client in clients.values():
        client.close()


def test_a_tenants_limit_is_one_limit_across_the_processes(server):
    clients = {i: c[0] for i, c in _pinned(server.url, key="k-rpm").items()}
    assert _completion(clients[0]).status_code == 200
    assert _completion(clients[1]).status_code == 200  # the second of two per minute, through the other process
    refused = _completion(clients[0])
    assert refused.status_code == 429 and "Retry-After" in refused.headers, refused.text
    usage = metric_values(server.url, "pdserve_tenant_rate_limited_total")
    assert usage['{tenant="metered"}'] == 1
    for client in clients.values():
        client.close()


def test_a_killed_http_process_is_replaced_and_what_its_streams_held_is_freed(server):
    pids = frontend_pids(server.pid)
    assert sorted(pids) == [0, 1]
    clients = _pinned(server.url, want={0: 4, 1: 1})  # four streams' connections on process 0, one client on 1
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    sampled = sum(metric_values(server.url, "pdserve_worker_engine_sampled_tokens_total").values())
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
    assert_nothing_booked(server.url, "k-open")
    # the core aborted the dead process's streams, rather than letting them run to their end
    sampled = sum(metric_values(server.url, "pdserve_worker_engine_sampled_tokens_total").values()) - sampled
    assert sampled < len(responses) * MAX_TOKENS / 2, sampled
    for group in clients.values():
        for client in group:
            client.close()
    fresh = _pinned(server.url)  # both processes, the replacement included, serve again
    for (client,) in fresh.values():
        assert _completion(client).status_code == 200
        client.close()
