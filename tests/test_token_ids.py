"""vLLM's response fields through a real uvicorn server and engine (`tiny`): `prompt_logprobs: null` where vLLM
sends it (the chat response, each completion choice) when no prompt logprobs were asked for. The single-choice
path: n > 1, echo and prompt_logprobs are tests/test_serving_token_ids.py's (they need the Ray backend's groups)."""

import json
import re

import httpx
import pytest

from coordinator.api.app import create_app
from coordinator.config.settings import ServerSettings
from engine import LLM
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
