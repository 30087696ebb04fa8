"""Pools whose slots gave up on the real server (`pdserve serve`, local Ray, 1 prefill + 1 decode, the embedded
`tiny` model, `recovery.max_restarts: 0`: a killed slot gives up at once, back only by an operator's revive). With
recovery.fallback on, the prefill slot given up leaves the decode worker serving whole requests, exactly; once the
decode slot has given up too, nothing can serve until an operator acts, and a request gets its 503 at once (the
admission timeout here is an hour), with Retry-After and both slots' story, not "overloaded"."""

import asyncio

import httpx
import pytest

from engine import LLM, SamplingParams
from tests.server_process import HALF_CPU, OPERATOR, admin_kill, metric_values, poll, running_server

pytestmark = pytest.mark.timeout(400)
DEADLINE_S = 180.0  # generous bound for polled states on a loaded machine (never a measured duration)
REFUSAL_S = 120.0   # generous bound for a refusal that does not wait (a wait would last admission.timeout_s: 1 h)
PROMPT = [11, 42, 7, 300, 5, 99, 1000, 3]


def _state(url: str, name: str) -> str:
    workers = httpx.get(f"{url}/health", headers=OPERATOR, timeout=10).json()["workers"]
    return next(w["state"] for w in workers if w["name"] == name)


def test_fallback_serves_while_one_pool_gave_up_and_both_given_up_answer_503_at_once(tmp_path):
    config = {"model": "tiny", "prefill": HALF_CPU, "decode": HALF_CPU, "transfer": {"backends": ["ucx"]},
              "admission": {"timeout_s": 3600}, "recovery": {"max_restarts": 0, "fallback": True},
              "server": {"admin_api": True}}
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    wanted = LLM("tiny").generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].text
    with running_server(tmp_path, config) as server:
        url = server.url
        asyncio.run(admin_kill(url, "prefill-0"))
        assert poll(lambda: _state(url, "prefill-0") == "failed", DEADLINE_S)
        served = httpx.post(f"{url}/v1/completions", json=body, timeout=REFUSAL_S)
        assert served.status_code == 200 and served.json()["choices"][0]["text"] == wanted, served.text
        assert metric_values(url, "pdserve_fallback_placements_total")['{missing="prefill"}'] >= 1

        asyncio.run(admin_kill(url, "decode-0"))
        assert poll(lambda: _state(url, "decode-0") == "failed", DEADLINE_S)
        refused = httpx.post(f"{url}/v1/completions", json=body, timeout=REFUSAL_S)
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["Retry-After"]) > 0
        error = refused.json()["error"]
        assert error["message"].startswith("No worker can serve this request until an operator acts: "), error
        for name in ("prefill-0", "decode-0"):
            assert f"{name} failed: gave up after 0 restarts" in error["message"], error
            assert f"POST /admin/workers/{name}/revive" in error["message"], error
        assert "overloaded" not in error["message"]
        assert metric_values(url, "pdserve_requests_total")['{outcome="rejected"}'] >= 1
