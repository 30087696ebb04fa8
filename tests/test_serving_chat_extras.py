"""The real `pdserve serve` (disaggregated, Ray, UCX) on a tiny Qwen3 checkpoint with <think> tokens and
`server.reasoning_parser: qwen3`: several choices each split into reasoning and content with usage summed, chat echo
through the choices path, and GET /admin/requests[/{id}] on a request in flight (operator key only, 404 once it
ended)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server_process import HALF_CPU, OPERATOR, running_server
from tests.think_checkpoint import make_think_checkpoint

pytestmark = pytest.mark.timeout(300)
USER = [{"role": "user", "content": "Why is the sky blue?"}]
PREFILL = [*USER, {"role": "assistant", "content": "The sky is"}]


@pytest.fixture(scope="module")
def think(checkpoints, tmp_path_factory):
    return make_think_checkpoint(tmp_path_factory.mktemp("think") / "tiny-think", checkpoints.tiny())


@pytest.fixture(scope="module")
def server(think, tmp_path_factory):
    config = {"model": str(think[0]), "prefill": HALF_CPU, "decode": HALF_CPU, "transfer": {"backends": ["ucx"]},
              "server": {"admin_api": True, "reasoning_parser": "qwen3", "api_key": "client-key"}}
    with running_server(tmp_path_factory.mktemp("srv"), config) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": "Bearer client-key"}) as c:
        yield c


def test_each_choice_is_split_and_usage_sums_their_reasoning(client, think):
    start, end = think[1], think[2]
    body = {"model": str(think[0]), "messages": USER, "max_tokens": 16, "temperature": 1.0, "seed": 9, "n": 3,
            "return_token_ids": True, "logit_bias": {str(start): 14, str(end): 14}}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    counts = []
    for c in r.json()["choices"]:
        ids, msg = c["token_ids"], c["message"]
        if ids and ids[0] == start:  # reasoning opened by the model: up to </think>, or to the end if cut
            k = ids.index(end) if end in ids else len(ids) - 1
            counts.append(k + 1)
            assert msg["reasoning"] is not None and "<think>" not in msg["reasoning"][:1]
        else:
            counts.append(0)
            assert msg["reasoning"] is None
    assert counts[0] == 14  # seed 9: <think> first, </think> 14th (tests/test_reasoning_serving.py)
    assert r.json()["usage"]["completion_tokens_details"] == {"reasoning_tokens": sum(counts)}


def test_chat_echo_through_the_choices_path(client, think):
    greedy = {"model": str(think[0]), "max_tokens": 6, "temperature": 0, "continue_final_message": True,
              "chat_template_kwargs": {"enable_thinking": False}}
    plain = client.post("/v1/chat/completions", json={**greedy, "messages": PREFILL}).json()
    text = plain["choices"][0]["message"]["content"]
    echoed = client.post("/v1/chat/completions", json={**greedy, "messages": PREFILL, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == "The sky is" + text
    chunks = []
    with client.stream("POST", "/v1/chat/completions", json={**greedy, "messages": PREFILL, "echo": True,
                                                            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    assert chunks[0]["choices"][0]["delta"]["content"].startswith("The sky is")
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "The sky is" + text


def _set_faults(url: str, faults: dict) -> None:
    r = httpx.post(f"{url}/admin/faults", headers=OPERATOR, json=faults, timeout=30)
    assert r.status_code == 200, r.text


def test_admin_requests_shows_a_request_in_flight(server, client, think):
    body = {"model": str(think[0]), "messages": USER, "ignore_eos": True, "stream": True}  # the whole context
    rid = "admin-probe-1"
    # decode steps slowed so the stream is still running when the views are read, however fast this machine
    # decodes (CI once saw all ~2000 tokens out before the first admin GET was answered)
    _set_faults(server.url, {"slow_step_s": 0.02, "slow_workers": ["decode-0"]})
    try:
        with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Request-Id": rid}) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            next(lines)
            view = httpx.get(f"{server.url}/admin/requests/{rid}", headers=OPERATOR)
            listed = httpx.get(server.url + "/admin/requests", headers=OPERATOR)
            tenant = httpx.get(f"{server.url}/admin/requests/{rid}", headers={"Authorization": "Bearer client-key"})
    finally:
        _set_faults(server.url, {})
    assert view.status_code == 200, view.text
    v = view.json()
    assert v["id"] == rid and v["state"] == "decode" and v["placement"] == "remote"
    assert v["prefill_worker"].startswith("prefill") and v["decode_worker"].startswith("decode")
    assert v["output_tokens"] > 0 and v["max_tokens"] > v["output_tokens"] and v["migrations"] == 0
    assert v["kv_blocks"]["used"] >= 1 and sum(k.get("kv_blocks", 0) for k in v["kv_blocks"]["booked"].values())
    assert {"admission", "prefill_compute"} <= set(v["phases"]) and v["age_s"] > 0
    assert listed.status_code == 200 and listed.json()["object"] == "list", listed.text
    assert tenant.status_code == 403 and tenant.json()["error"]["type"] == "permission_error"
    gone = httpx.get(f"{server.url}/admin/requests/{rid}", headers=OPERATOR)
    for _ in range(50):
        if gone.status_code == 404:
            break
        gone = httpx.get(f"{server.url}/admin/requests/{rid}", headers=OPERATOR)  # its abort may still be on its way
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "request_id", gone.text
    unknown = httpx.get(server.url + "/admin/requests/" + "x" * 300, headers=OPERATOR)
    assert unknown.status_code == 404 and len(unknown.text) < 400
