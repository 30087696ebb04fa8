"""A worker slot past recovery.max_restarts on the real server (`pdserve serve`, local Ray, the embedded `tiny`
model, mode collocated, one worker): it is not silently dead. The 503 a request gets comes at once (not after
admission.timeout_s: nothing can come back without an operator), with Retry-After, and says the slot gave up and
how to revive it (not that a replacement is being started, nor that the server is overloaded), /health says
`failed` to all and why to the operator, and `POST /admin/workers/{name}/revive` (operator key only) starts it
again: it serves exactly, and a second revive of a live slot is a 409."""

import asyncio

import httpx
import pytest

from engine import LLM, SamplingParams
from tests.server_process import (
    HALF_CPU,
    OPERATOR,
    admin_kill,
    assert_nothing_booked,
    poll,
    running_server,
    wait_for_health,
    worker_pids,
)

pytestmark = pytest.mark.timeout(600)
DEADLINE_S = 180.0  # generous bound for polled states on a loaded machine (never a measured duration)
REFUSAL_S = 120.0   # generous bound for a refusal that does not wait (the admission timeout is an hour)
PROMPT = [11, 42, 7, 300, 5, 99, 1000, 3]


def _worker(url: str, headers: dict | None = None) -> dict:
    return httpx.get(f"{url}/health", headers=headers or {}, timeout=10).json()["workers"][0]


def _post(url: str, path: str, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}{path}", headers=OPERATOR if headers is None else headers, timeout=30)


def test_a_slot_past_max_restarts_says_it_gave_up_and_an_operator_revives_it(tmp_path):
    # a request waiting out admission.timeout_s would outlast the client's REFUSAL_S: the 503 must come before
    config = {"model": "tiny", "mode": "collocated", "decode": HALF_CPU, "admission": {"timeout_s": 3600},
              "recovery": {"max_restarts": 1, "backoff_initial_s": 0.1, "backoff_max_s": 0.2},
              "server": {"admin_api": True}}
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    wanted = LLM("tiny").generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].text
    with running_server(tmp_path, config) as server:
        url = server.url
        first_pid = worker_pids(server)
        asyncio.run(admin_kill(url, "decode-0"))  # the one restart recovery.max_restarts allows
        assert poll(lambda: _worker(url)["state"] == "live" and _worker(url)["restarts"] == 1, DEADLINE_S)
        asyncio.run(admin_kill(url, "decode-0"))  # past it: the slot gives up
        assert poll(lambda: _worker(url)["state"] == "failed", DEADLINE_S), _worker(url)

        refused = httpx.post(f"{url}/v1/completions", json=body, timeout=REFUSAL_S)
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["Retry-After"]) > 0
        assert refused.json()["error"]["type"] == "server_error"
        message = refused.json()["error"]["message"]
        assert message.startswith("No worker can serve this request until an operator acts: "), message
        streamed = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=REFUSAL_S)
        assert streamed.status_code == 503 and streamed.json()["error"]["message"] == message
        assert "decode-0 failed: gave up after 1 restarts within 600 s (recovery.max_restarts 1)" in message
        assert "no replacement is being started until an operator revives it (POST /admin/workers/decode-0/revive)" \
            in message, message
        assert "a replacement is being started" not in message
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["workers"][0]["state"] == "failed"
        assert "gave_up" not in health.json()["workers"][0]  # details are the operator's
        detail = _worker(url, OPERATOR)
        assert detail["gave_up"] == "gave up after 1 restarts within 600 s (recovery.max_restarts 1)", detail
        assert detail["last_failure"] == "killed through the admin API", detail

        assert _post(url, "/admin/workers/decode-0/revive", headers={}).status_code == 401
        assert _post(url, "/admin/workers/nobody/revive").status_code == 404
        revived = _post(url, "/admin/workers/decode-0/revive")
        assert revived.status_code == 200 and revived.json() == {"worker": "decode-0", "revived": True}
        wait_for_health(url, 200, DEADLINE_S)
        again = _post(url, "/admin/workers/decode-0/revive")
        assert again.status_code == 409 and again.json()["error"]["code"] == "not_failed"
        served = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert served.status_code == 200 and served.json()["choices"][0]["text"] == wanted
        assert "gave_up" not in _worker(url, OPERATOR) and worker_pids(server) != first_pid
        assert_nothing_booked(url)
