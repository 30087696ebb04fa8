"""Hostile clients against the real server (`pdserve serve`, tiny, 1 prefill + 1 decode, two HTTP processes in front
of one core, tenants, the admin API), issue 46: a flood of huge request heads without any key gets 431 (a huge URL
414) and the connection closed, and no HTTP process's memory grows with it, while normal requests are served; /metrics
names no tenant without the operator's or the metrics key; /admin/faults refuses a seed that is not an integer
(NaN, 1e400, "x", true) with a 400 and leaves nothing in force; a tenant's burst stays within its tokens per minute,
and a chat without max_tokens under a limit below prompt + 256 is served (its output the limit's allowance)."""

import json
import socket
import threading
from pathlib import Path

import httpx
import pytest

from tests.server_process import HALF_CPU, OPERATOR, frontend_pids, running_server

pytestmark = pytest.mark.timeout(300)
METRICS_KEY = "pdserve-test-metrics-reader"
MAX_MODEL_LEN = 512
FLOOD_BYTES = 48 << 20  # per connection: a 48 MB header line
GROWTH_BOUND = 24 << 20  # what an HTTP process's peak memory may grow by under the whole flood
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a long story about the sea."}],
        "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = {"model": "tiny", "max_model_len": MAX_MODEL_LEN, "prefill": HALF_CPU, "decode": HALF_CPU,
              "transfer": {"backends": ["ucx"]},
              "tenants": [{"name": "free-tenant", "api_keys": ["k-free"]},
                          {"name": "metered-tenant", "api_keys": ["k-metered"], "tokens_per_minute": 400},
                          {"name": "tight-tenant", "api_keys": ["k-tight"], "tokens_per_minute": 200}],
              "server": {"api_processes": 2, "admin_api": True, "metrics_api_key": METRICS_KEY},
              "recovery": {"prefill_retry": False}}  # an injected prefill error reaches the client (its check below)
    with running_server(tmp_path_factory.mktemp("hostile"), config) as srv:
        yield srv


def _key(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _peak_rss(pid: int) -> int:
    """The process's peak resident memory (VmHWM), bytes: what a flood made it hold at any moment."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def _flood(port: int, head_start: bytes, size: int, results: list) -> None:
    """One connection sending `head_start` then `size` bytes of one header line (1 MB at a time) and the head's end,
    as long as the server reads; the status line it got (or what ended the connection)."""
    chunk = b"a" * (1 << 20)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall(head_start)
            try:
                for _ in range(size // len(chunk)):
                    s.sendall(chunk)
                s.sendall(b"\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server stopped reading: its answer is read below
            received = b""
            while chunk_in := s.recv(65536):
                received += chunk_in
        results.append(received.split(b"\r\n", 1)[0] + b"\r\n" + received.partition(b"\r\n\r\n")[2])
    except OSError as e:
        results.append(repr(e).encode())


def test_a_header_flood_without_a_key_gets_431_and_no_http_process_grows(server):
    port = int(server.url.rsplit(":", 1)[1])
    processes = frontend_pids(server.pid)
    assert len(processes) == 2
    before = {pid: _peak_rss(pid) for pid in processes.values()}
    results: list = []
    threads = [threading.Thread(target=_flood, args=(port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Flood: ",
                                                     FLOOD_BYTES, results)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 4
    for result in results:
        status, _, body = result.partition(b"\r\n")
        assert status.startswith(b"HTTP/1.1 431 "), result[:300]
        assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"
    grown = {pid: _peak_rss(pid) - before[pid] for pid in before}
    assert all(g < GROWTH_BOUND for g in grown.values()), grown
    url_results: list = []
    _flood(port, b"GET /health?q=", 1 << 20, url_results)  # a 1 MB URL: the request line alone is over the limit
    assert url_results[0].startswith(b"HTTP/1.1 414 "), url_results[0][:300]
    # a head just under the limit is served, and so are normal requests
    big = httpx.get(f"{server.url}/health", headers={"X-Padding": "p" * 60000}, timeout=30)
    assert big.status_code == 200
    r = httpx.post(f"{server.url}/v1/completions", headers=_key("k-free"), timeout=60,
                   json={"model": "tiny", "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200, r.text


def test_metrics_name_tenants_only_for_the_operator_and_the_metrics_key(server):
    r = httpx.post(f"{server.url}/v1/completions", headers=_key("k-free"), timeout=60,
                   json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    for headers in ({}, _key("k-free"), _key("not-a-key")):
        text = httpx.get(f"{server.url}/metrics", headers=headers, timeout=30).text
        assert "pdserve_requests_total" in text  # the rest stays open to all
        assert "tenant" not in text and "free-tenant" not in text and "metered-tenant" not in text, headers
    for headers in (OPERATOR, _key(METRICS_KEY)):
        text = httpx.get(f"{server.url}/metrics", headers=headers, timeout=30).text
        assert 'pdserve_tenant_requests_total{outcome="finished",tenant="free-tenant"}' in text, headers
        assert 'pdserve_tenant_in_flight{tenant="metered-tenant"}' in text


@pytest.mark.parametrize("seed", ["NaN", "1e400", '"x"', "true", "-1"])
def test_admin_faults_refuses_a_seed_that_is_not_an_integer_and_keeps_nothing_of_it(server, seed):
    body = '{"prefill_error_fraction": 1.0, "seed": ' + seed + "}"
    r = httpx.post(f"{server.url}/admin/faults", content=body, timeout=30,
                   headers={**OPERATOR, "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "seed" in error["message"]
    served = httpx.post(f"{server.url}/v1/completions", headers=_key("k-free"), timeout=60,
                        json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    assert served.status_code == 200, served.text  # every prefill would fail, had the faults been set
    ok = httpx.post(f"{server.url}/admin/faults", json={"seed": 7}, headers=OPERATOR, timeout=30)
    assert ok.status_code == 200 and ok.json()["faults"]["seed"] == 7


def test_without_prefill_retry_an_injected_prefill_error_is_a_502_naming_it(server):
    """recovery.prefill_retry false: a failed prefill is not run again on the decode worker; the client gets a 502
    (never a 500) naming the error, and the next request after the faults are off is served."""
    assert httpx.post(f"{server.url}/admin/faults", json={"prefill_error_fraction": 1.0}, headers=OPERATOR,
                      timeout=30).status_code == 200
    try:
        r = httpx.post(f"{server.url}/v1/completions", headers=_key("k-free"), timeout=60,
                       json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    finally:
        assert httpx.post(f"{server.url}/admin/faults", json={}, headers=OPERATOR, timeout=30).status_code == 200
    assert r.status_code == 502 and "injected" in r.json()["error"]["message"], r.text
    served = httpx.post(f"{server.url}/v1/completions", headers=_key("k-free"), timeout=60,
                        json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    assert served.status_code == 200, served.text


def test_a_tenants_burst_stays_within_its_tokens_per_minute(server):
    """Six chats at once without max_tokens (each may generate to the end of the context, ~490 tokens) from a tenant
    of 400 tokens a minute: what the admitted ones used sums to at most 400 (it was one request's 510 and more:
    charged 256 up front, then what it generated), the others get 429 with Retry-After."""
    def chat(_: int) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/chat/completions", headers=_key("k-metered"), json=CHAT, timeout=120)
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(chat, range(6)))
    served = [r for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code != 200]
    assert served, [r.text for r in answers]
    assert all(r.status_code == 429 and int(r.headers["retry-after"]) >= 1 for r in refused), \
        [r.text for r in refused]
    used = sum(r.json()["usage"]["total_tokens"] for r in served)
    assert used <= 400, [r.json()["usage"] for r in served]
    first = served[0].json()
    assert first["choices"][0]["finish_reason"] == "length"  # cut at the allowance the limit left


def test_a_chat_without_max_tokens_under_a_limit_below_prompt_plus_256_is_served(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=_key("k-tight"), json=CHAT, timeout=120)
    assert r.status_code == 200, r.text  # was a 400: prompt + 256 tokens charged up front, above 200
    usage = r.json()["usage"]
    assert usage["total_tokens"] == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    long = {**CHAT, "messages": [{"role": "user", "content": "sea " * 300}]}
    refused = httpx.post(f"{server.url}/v1/chat/completions", headers=_key("k-tight"), json=long, timeout=60)
    assert refused.status_code == 400 and "leaves no room" in refused.json()["error"]["message"]
