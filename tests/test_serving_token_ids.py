"""vLLM's response fields on the path of requests with several choices, echo or prompt_logprobs
(coordinator.api.choices), against the real server (`tiny`, collocated: these need the Ray backend's groups):
`prompt_logprobs: null` on the chat response and on each completion choice when none were asked for."""

from __future__ import annotations

import httpx
import pytest

from tests.server_process import HALF_CPU, running_server

pytestmark = pytest.mark.timeout(300)
MSGS = [{"role": "user", "content": "Tell me about the harbor."}]
SEEDED = {"max_tokens": 6, "temperature": 1.0, "seed": 7, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("token_ids"), {"model": "tiny", "mode": "collocated",
                                                               "decode": HALF_CPU}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def post(client, path: str, body: dict) -> dict:
    r = client.post(path, json={"model": "tiny", **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_prompt_logprobs_is_null_where_vllm_sends_it(client):
    chat = post(client, "/v1/chat/completions", {"messages": MSGS, "n": 2, **SEEDED})
    assert "prompt_logprobs" in chat and chat["prompt_logprobs"] is None, chat
    for extra in ({"n": 2}, {"echo": True}):
        done = post(client, "/v1/completions", {"prompt": "The harbor", **SEEDED, **extra})
        assert all("prompt_logprobs" in c and c["prompt_logprobs"] is None for c in done["choices"]), done
    asked = post(client, "/v1/completions", {"prompt": "The harbor", **SEEDED, "prompt_logprobs": 0})
    assert asked["choices"][0]["prompt_logprobs"][0] is None and len(asked["choices"][0]["prompt_logprobs"]) > 1
