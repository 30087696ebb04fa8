"""vLLM's token-id response fields through a real uvicorn server and engine (`tiny`): `prompt_logprobs: null` where
vLLM sends it (the chat response, each completion choice) when no prompt logprobs were asked for;
`return_token_ids` (each choice's generated `token_ids`, and `prompt_token_ids` on the chat response or the
completion choice, both null in a whole response without it, as vLLM's; streamed, each chunk's new ids and the
prompt's on the first chunk only), plain and with a
streamed tool call; `return_tokens_as_token_ids` (logprobs name each token `token_id:<id>`, the alternatives too,
text offsets unchanged). The single-choice path: n > 1, echo and prompt_logprobs are tests/test_serving_token_ids.py's
(they need the Ray backend's groups)."""

import json
import re

import httpx
import pytest

from coordinator.api.app import create_app
from coordinator.config.settings import ServerSettings
from engine import LLM, SamplingParams
from tests.inprocess_backend import InProcessBackend, ServerThread, wait_until

pytestmark = pytest.mark.timeout(120)
MAX_LEN = 96
MSGS = [{"role": "user", "content": "Tell me about the harbor."}]
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
TOOLS = [{"type": "function", "function": {"name": "ping", "parameters": {
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}]
AS_ID = re.compile(r"^token_id:\d+$")


@pytest.fixture(scope="module")
def ref(checkpoints):
    return LLM(str(checkpoints.tiny()), max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def server(checkpoints):
    folder = checkpoints.tiny()
    backend = InProcessBackend(LLM(str(folder), max_model_len=MAX_LEN).engine, folder)
    with ServerThread(create_app(backend, ServerSettings()), backend) as srv:
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
    assert wait_until(lambda: server.backend.idle, 10)


def post(client, path: str, body: dict) -> dict:
    r = client.post(path, json={"model": "tiny", **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream(client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={"model": "tiny", **body, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_prompt_logprobs_is_null_where_vllm_sends_it(client):
    for extra in ({}, {"tools": TOOLS, "tool_choice": "required"}):
        chat = post(client, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, **extra})
        assert "prompt_logprobs" in chat and chat["prompt_logprobs"] is None, chat
        assert all("prompt_logprobs" not in c for c in chat["choices"])
    done = post(client, "/v1/completions", {"prompt": "The harbor", "max_tokens": 4})
    assert "prompt_logprobs" in done["choices"][0] and done["choices"][0]["prompt_logprobs"] is None, done
    assert "prompt_logprobs" not in done


def test_return_token_ids_on_completions_whole_and_streamed(client, ref):
    prompt = "The old lighthouse"
    [expected] = ref.generate([prompt], SamplingParams(**GREEDY))
    body = {"prompt": prompt, **GREEDY, "return_token_ids": True}
    whole = post(client, "/v1/completions", body)
    choice = whole["choices"][0]
    assert choice["prompt_token_ids"] == ref.tokenizer.encode(prompt) and choice["token_ids"] == expected.token_ids
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"]
    chunks = stream(client, "/v1/completions", body)
    assert [i for c in chunks for i in c["choices"][0]["token_ids"]] == expected.token_ids
    assert chunks[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    for off in ({}, {"return_token_ids": False}):  # vLLM's test_basic_completion_with_emoji: the keys are there, null
        plain = post(client, "/v1/completions", {"prompt": prompt, **GREEDY, **off})["choices"][0]
        assert "prompt_token_ids" in plain and plain["prompt_token_ids"] is None, plain
        assert "token_ids" in plain and plain["token_ids"] is None, plain
    assert all("token_ids" not in c["choices"][0] for c in stream(client, "/v1/completions", {"prompt": prompt,
                                                                                              **GREEDY}))


def test_return_token_ids_on_chat_whole_and_streamed(client, ref):
    prompt_ids = post(client, "/tokenize", {"messages": MSGS})["tokens"]
    [expected] = ref.generate([prompt_ids], SamplingParams(**GREEDY))
    body = {"messages": MSGS, **GREEDY, "return_token_ids": True}
    whole = post(client, "/v1/chat/completions", body)
    assert whole["prompt_token_ids"] == prompt_ids and whole["choices"][0]["token_ids"] == expected.token_ids
    assert whole["choices"][0]["message"]["content"] == expected.text
    chunks = stream(client, "/v1/chat/completions", body)
    assert [i for c in chunks for i in c["choices"][0]["token_ids"]] == expected.token_ids
    assert chunks[0]["prompt_token_ids"] == prompt_ids and all("prompt_token_ids" not in c for c in chunks[1:])
    plain = post(client, "/v1/chat/completions", {**body, "return_token_ids": False})  # vLLM's: null, not absent
    assert "prompt_token_ids" in plain and plain["prompt_token_ids"] is None, plain
    assert "token_ids" in plain["choices"][0] and plain["choices"][0]["token_ids"] is None, plain
    assert all("token_ids" not in c["choices"][0] for c in stream(client, "/v1/chat/completions", plain_body(body)))


def plain_body(body: dict) -> dict:
    return {k: v for k, v in body.items() if k != "return_token_ids"}


def test_return_token_ids_with_a_streamed_tool_call(client):
    for choice in ("required", {"type": "function", "function": {"name": "ping"}}):  # sent at the end; as generated
        call = {"messages": MSGS, "max_tokens": 40, "seed": 1, "tools": TOOLS, "tool_choice": choice,
                "parallel_tool_calls": False, "return_token_ids": True}
        whole = post(client, "/v1/chat/completions", call)
        assert whole["choices"][0]["message"].get("tool_calls"), whole
        assert len(whole["choices"][0]["token_ids"]) == whole["usage"]["completion_tokens"]
        chunks = stream(client, "/v1/chat/completions", call)
        assert [i for c in chunks for i in c["choices"][0]["token_ids"]] == whole["choices"][0]["token_ids"]
        assert "prompt_token_ids" in chunks[0] and all("prompt_token_ids" not in c for c in chunks[1:])


def test_return_tokens_as_token_ids_names_every_logprob_token_by_id(client):
    chat = post(client, "/v1/chat/completions", {"messages": MSGS, **GREEDY, "logprobs": True, "top_logprobs": 2,
                                                 "return_tokens_as_token_ids": True, "return_token_ids": True})
    content = chat["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{i}" for i in chat["choices"][0]["token_ids"]]
    assert all(AS_ID.match(t["token"]) for e in content for t in e["top_logprobs"])
    body = {"prompt": "The harbor", **GREEDY, "logprobs": 2}
    named = post(client, "/v1/completions", {**body, "return_tokens_as_token_ids": True})["choices"][0]["logprobs"]
    plain = post(client, "/v1/completions", body)["choices"][0]["logprobs"]
    assert all(AS_ID.match(t) for t in named["tokens"]) and len(named["tokens"]) == len(plain["tokens"])
    assert named["text_offset"] == plain["text_offset"] and named["token_logprobs"] == plain["token_logprobs"]
    assert all(AS_ID.match(k) for top in named["top_logprobs"] for k in top)
    streamed = stream(client, "/v1/completions", {"prompt": "The harbor", **GREEDY, "logprobs": 1,
                                                  "return_tokens_as_token_ids": True})
    assert all(AS_ID.match(t) for c in streamed for t in (c["choices"][0]["logprobs"] or {}).get("tokens", []))


@pytest.mark.parametrize("field", ["return_token_ids", "return_tokens_as_token_ids"])
def test_the_flags_take_only_booleans(client, field):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1, field: "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
