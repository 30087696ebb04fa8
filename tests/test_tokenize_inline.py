"""Where a request's prompt is tokenized (coordinator.api.engine_inputs.tokenize_inline): short prompts on the event
loop (cheaper than a hop to a thread), long ones and chats with tools in a thread; both serve the prompt's tokens."""

import pytest

from coordinator.api import engine_inputs, protocol
from coordinator.api.app import create_app
from coordinator.config.settings import ServerSettings
from engine import LLM
from engine.text.tokenizer import Tokenizer
from tests.inprocess_backend import InProcessBackend, run_asgi

pytestmark = pytest.mark.timeout(120)
LIMIT = engine_inputs.INLINE_TOKENIZE_CHARS


def chat(content, **extra):
    return protocol.parse(protocol.ChatCompletionRequest,
                          {"model": "tiny", "messages": [{"role": "user", "content": content}], **extra})


def completion(prompt):
    return protocol.parse(protocol.CompletionRequest, {"model": "tiny", "prompt": prompt})


def test_short_prompts_inline_long_ones_and_tools_in_a_thread():
    assert engine_inputs.tokenize_inline(completion("x" * LIMIT))
    assert not engine_inputs.tokenize_inline(completion("x" * (LIMIT + 1)))
    assert engine_inputs.tokenize_inline(completion(list(range(5000))))  # token ids: validation only
    assert not engine_inputs.tokenize_inline(completion(["short", "x" * (LIMIT + 1)]))
    assert engine_inputs.tokenize_inline(chat("x" * LIMIT))
    assert not engine_inputs.tokenize_inline(chat([{"type": "text", "text": "x" * (LIMIT // 2 + 1)}] * 2))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert not engine_inputs.tokenize_inline(chat("hi", tools=[tool]))
    assert engine_inputs.tokenize_inline(chat("hi", chat_template_kwargs={"enable_thinking": False}))


@pytest.mark.parametrize("chars", [40, 3 * LIMIT])
def test_both_paths_serve_the_prompts_tokens(checkpoints, chars):
    backend = InProcessBackend(LLM(str(checkpoints.tiny())).engine, checkpoints.tiny())
    text = ("lorem ipsum dolor " * chars)[:chars]
    expected = len(Tokenizer.from_folder(checkpoints.tiny()).encode(text))

    async def fn(client):
        return await client.post("/v1/completions", json={"model": "tiny", "prompt": text, "max_tokens": 2})
    r = run_asgi(create_app(backend, ServerSettings()), backend, fn)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 2 and usage["prompt_tokens"] == expected
