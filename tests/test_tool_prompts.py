"""Chat prompts that carry `tools`, on a copy of `tiny` whose chat template renders them (as Llama 3.1's and Qwen's
do), through the app with the in-process backend: /tokenize takes `tools` (vLLM's chat form does) and counts the
prompt the chat endpoint bills for the same messages and tools."""

import shutil

import httpx
import pytest

from coordinator.api.app import create_app
from coordinator.config.settings import ServerSettings
from engine import LLM
from tests.inprocess_backend import InProcessBackend, run_asgi

pytestmark = pytest.mark.timeout(120)
TOOL_TEMPLATE = (  # tools as JSON in a system turn before the conversation, each on its own line
    "{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nTools:\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MSGS = [{"role": "user", "content": "What is the weather in Oslo?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def model(checkpoints, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tool_template") / "tiny-tools"
    shutil.copytree(checkpoints.tiny(), folder)
    (folder / "chat_template.jinja").write_text(TOOL_TEMPLATE, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def engine(model):
    return LLM(str(model), max_model_len=512).engine


@pytest.fixture
def backend(engine, model):
    b = InProcessBackend(engine, model)
    yield b
    assert b.idle


def call(backend, requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    async def fn(client):
        return [await client.post(path, json=body) for path, body in requests]
    return run_asgi(create_app(backend, ServerSettings()), backend, fn, timeout=60)


def test_tokenize_counts_a_tool_bearing_prompt_as_the_chat_endpoint_bills_it(backend):
    chat = {"model": "tiny", "messages": MSGS, "tools": TOOLS, "max_tokens": 1}
    tok, plain, served = call(backend, [("/tokenize", {"messages": MSGS, "tools": TOOLS}),
                                        ("/tokenize", {"messages": MSGS}), ("/v1/chat/completions", chat)])
    for r in (tok, plain, served):
        assert r.status_code == 200, r.text
    assert tok.json()["count"] == served.json()["usage"]["prompt_tokens"] == len(tok.json()["tokens"])
    assert tok.json()["count"] > plain.json()["count"]  # the tools were rendered, not dropped


def test_tokenize_checks_tools_as_the_chat_endpoint_does(backend):
    bad_name = [{"type": "function", "function": {"name": "no spaces allowed"}}]
    twice = TOOLS * 2
    for tools, param in ((bad_name, "tools[0].function.name"), (twice, "tools"), ("x", "tools")):
        (r,) = call(backend, [("/tokenize", {"messages": MSGS, "tools": tools})])
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_special_token_text_in_tools_is_text_not_control_tokens(backend, engine):
    tok = engine.tokenizer
    specials = [tok.special_tokens_map["eos_token"], tok.special_tokens_map["bos_token"], "<|eot_id|>",
                "<|start_header_id|>"]
    ids = {s: tok.encode(s, add_special_tokens=False) for s in specials}
    assert all(len(v) == 1 and v[0] in tok.special_token_ids for v in ids.values())  # each is one control token
    text = " then ".join(specials)
    hostile = [{"type": "function", "function": {
        "name": "get_weather", "description": f"Weather. {text}",
        "parameters": {"type": "object", "properties": {text: {"type": "string", "description": text,
                                                               "enum": [text]}}}}}]
    clean, dirty = call(backend, [("/tokenize", {"messages": MSGS, "tools": TOOLS}),
                                  ("/tokenize", {"messages": MSGS, "tools": hostile})])
    assert clean.status_code == dirty.status_code == 200, dirty.text
    for s, (token_id,) in ids.items():  # as many of each as the template writes, none from the tools' text
        assert dirty.json()["tokens"].count(token_id) == clean.json()["tokens"].count(token_id), s
    assert tok.decode(dirty.json()["tokens"], skip_special_tokens=False).count(text) == 4  # the text is all there
