"""vLLM's response fields on the path of requests with several choices, echo or prompt_logprobs
(coordinator.api.choices), against the real server (`tiny`, collocated: these need the Ray backend's groups):
`prompt_logprobs: null` on the chat response and on each completion choice when none were asked for;
`return_token_ids` per choice (the prompt's ids on each completion choice and on the chat response, streamed on
each choice's first chunk); `return_tokens_as_token_ids` naming echoed prompt tokens by id too."""

from __future__ import annotations

import json
import re

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


def stream(client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={"model": "tiny", **body, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_return_token_ids_per_choice_whole_and_streamed(client):
    body = {**SEEDED, "n": 2, "return_token_ids": True}
    prompt_ids = post(client, "/tokenize", {"prompt": "The harbor"})["tokens"]
    done = post(client, "/v1/completions", {"prompt": "The harbor", **body})
    assert [len(c["token_ids"]) for c in done["choices"]] == [6, 6]
    assert all(c["prompt_token_ids"] == prompt_ids for c in done["choices"])
    chunks = stream(client, "/v1/completions", {"prompt": "The harbor", **body})
    for c in done["choices"]:  # seeded: the streamed choice is the same sequence
        mine = [k["choices"][0] for k in chunks if k["choices"] and k["choices"][0]["index"] == c["index"]]
        assert [i for m in mine for i in m["token_ids"]] == c["token_ids"]
        assert mine[0]["prompt_token_ids"] == prompt_ids and all("prompt_token_ids" not in m for m in mine[1:])
    chat_ids = post(client, "/tokenize", {"messages": MSGS})["tokens"]
    chat = post(client, "/v1/chat/completions", {"messages": MSGS, **body})
    assert chat["prompt_token_ids"] == chat_ids and [len(c["token_ids"]) for c in chat["choices"]] == [6, 6]
    chunks = stream(client, "/v1/chat/completions", {"messages": MSGS, **body})
    for c in chat["choices"]:
        mine = [k for k in chunks if k["choices"] and k["choices"][0]["index"] == c["index"]]
        assert [i for k in mine for i in k["choices"][0]["token_ids"]] == c["token_ids"]
        assert mine[0]["prompt_token_ids"] == chat_ids and all("prompt_token_ids" not in k for k in mine[1:])


def test_return_tokens_as_token_ids_names_echoed_prompt_tokens_by_id(client):
    body = {"prompt": "The harbor", **SEEDED, "logprobs": 1, "echo": True}
    named = post(client, "/v1/completions", {**body, "return_tokens_as_token_ids": True, "return_token_ids": True})
    plain = post(client, "/v1/completions", body)["choices"][0]["logprobs"]
    lp, choice = named["choices"][0]["logprobs"], named["choices"][0]
    assert lp["tokens"] == [f"token_id:{i}" for i in choice["prompt_token_ids"] + choice["token_ids"]]
    assert lp["text_offset"] == plain["text_offset"] and lp["token_logprobs"] == plain["token_logprobs"]
    assert all(re.match(r"^token_id:\d+$", k) for top in lp["top_logprobs"] if top for k in top)


def test_token_id_fields_are_null_when_not_asked_for(client):
    """vLLM's test_basic_completion_with_emoji reads `prompt_token_ids` as a key of every completion choice (null
    without return_token_ids); the chat response's too."""
    for extra in ({"n": 2}, {"echo": True}, {"n": 2, "return_token_ids": False}):
        done = post(client, "/v1/completions", {"prompt": "The harbor", **SEEDED, **extra})
        for c in done["choices"]:
            assert "prompt_token_ids" in c and c["prompt_token_ids"] is None, done
            assert "token_ids" in c and c["token_ids"] is None, done
    chat = post(client, "/v1/chat/completions", {"messages": MSGS, "n": 2, **SEEDED})
    assert "prompt_token_ids" in chat and chat["prompt_token_ids"] is None, chat
    assert all("token_ids" in c and c["token_ids"] is None for c in chat["choices"]), chat


@pytest.mark.parametrize("k", [0, 1])
def test_echo_logprobs_hold_each_tokens_own_logprob(client, k):
    """vLLM's test_echo_logprob_completion: with echo, every entry of top_logprobs but the first (null) has between
    max(k, 1) and k + 1 tokens, for a text and a token-id prompt; here also: each holds its own token's logprob (with
    logprobs 0, only that: the echoed prompt tokens had none)."""
    for prompt in ("Hello, my name is", [5, 17, 300, 1200, 44]):
        choice = post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0, "echo": True,
                                                  "logprobs": k, "return_token_ids": True})["choices"][0]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(choice["prompt_token_ids"]) + len(choice["token_ids"]) > 5
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for token, own, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
            assert max(k, 1) <= len(top) <= k + 1, lp
            assert top[token] == own, (token, top)
