"""Reasoning output (server.reasoning_parser) and continue_final_message through a real uvicorn server and a real engine
(single-choice requests; several choices and chat echo: tests/test_serving_chat_extras.py), on a tiny Qwen3
checkpoint whose tokenizer has <think> and </think> (tests/think_checkpoint.py). Random weights emit the tags when a
seeded request biases them (logit_bias); every split is checked against the token ids the same response returns
(return_token_ids), streamed and not, at one and at four tokens per chunk."""

import contextlib

import httpx
import pytest

from coordinator.api.app import create_app
from coordinator.config.settings import ServerSettings
from engine import LLM
from tests.inprocess_backend import InProcessBackend, ServerThread, wait_until
from tests.test_http_generation import stream
from tests.think_checkpoint import make_think_checkpoint

pytestmark = pytest.mark.timeout(120)
USER = [{"role": "user", "content": "Why is the sky blue?"}]
# seeds at which tiny's random weights, so biased, write the tags mid-output (a precondition each test asserts)
DEEPSEEK = {"chat_template_kwargs": {"thinking": True}, "seed": 3, "logit_bias": {"END": 14}}
QWEN = {"seed": 9, "logit_bias": {"START": 14, "END": 14}}


@pytest.fixture(scope="module")
def model(checkpoints, tmp_path_factory):
    return make_think_checkpoint(tmp_path_factory.mktemp("think") / "tiny-think", checkpoints.tiny())


@pytest.fixture(scope="module")
def engine(model):
    return LLM(str(model[0]), max_model_len=256).engine


@contextlib.contextmanager
def serving(engine, model, **settings):
    backend = InProcessBackend(engine, model[0])
    with ServerThread(create_app(backend, ServerSettings(**settings)), backend) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as client:
        yield client
        assert wait_until(lambda: backend.idle, 10)
    assert backend.integrity["in_use"] == 0


def body(model, preset, **extra):
    start, end = model[1], model[2]
    bias = {str({"START": start, "END": end}[k]): v for k, v in preset["logit_bias"].items()}
    return {"model": "tiny", "messages": USER, "max_tokens": 16, "temperature": 1.0, "return_token_ids": True,
            **{k: v for k, v in preset.items() if k != "logit_bias"}, "logit_bias": bias, **extra}


def post(client, b):
    r = client.post("/v1/chat/completions", json=b)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(client, b):
    """(reasoning, content, usage) joined from the stream's deltas; no delta's reasoning and content hold a tag."""
    events = stream(client, "/v1/chat/completions", {**b, "stream_options": {"include_usage": True}})
    reasoning = content = ""
    for e in events[:-1]:
        delta = e["choices"][0]["delta"]
        assert delta.get("reasoning") == delta.get("reasoning_content")
        reasoning += delta.get("reasoning") or ""
        content += delta.get("content") or ""
    return reasoning, content, events[-1]["usage"]


def assert_same(again: tuple, first: tuple, engine) -> None:
    """The same request sent again gives the same reasoning, content and usage, but for cached_tokens: the first
    run left its prompt in the prefix cache, so the second finds every full block of it there (all but the last
    token, which is computed to sample from), whatever the first found."""
    (*text, usage), (*text_first, usage_first) = again, first
    block = engine.config.block_size
    cached, cached_first = (u["prompt_tokens_details"]["cached_tokens"] for u in (usage, usage_first))
    assert cached_first <= cached == (usage["prompt_tokens"] - 1) // block * block
    assert text == text_first and _but_cached(usage) == _but_cached(usage_first)


def _but_cached(usage: dict) -> dict:
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


@pytest.mark.parametrize("interval", [1, 4])
def test_deepseek_r1_reasoning_ends_at_the_close_tag(engine, model, interval):
    tok, end = engine.tokenizer, model[2]
    with serving(engine, model, reasoning_parser="deepseek_r1", stream_interval=interval) as client:
        whole = post(client, body(model, DEEPSEEK))
        ids = whole["choices"][0]["token_ids"]
        assert end in ids[1:-1]  # precondition: </think> mid-output
        k = ids.index(end)
        msg, usage = whole["choices"][0]["message"], whole["usage"]
        assert msg["reasoning"] == msg["reasoning_content"] and "</think>" not in msg["reasoning"]
        assert msg["reasoning"] + "</think>" + (msg["content"] or "") == tok.decode(ids)
        assert msg["content"] and usage["completion_tokens_details"] == {"reasoning_tokens": k + 1}
        assert_same(streamed(client, body(model, DEEPSEEK)), (msg["reasoning"], msg["content"], usage), engine)
        # cut before </think>: all reasoning, content null
        cut = post(client, body(model, DEEPSEEK, max_tokens=k))["choices"][0]["message"]
        assert cut["content"] is None and cut["reasoning"] == tok.decode(ids[:k])


def test_qwen3_reasoning_is_between_the_tags_and_off_with_thinking_off(engine, model):
    tok, start, end = engine.tokenizer, model[1], model[2]
    with serving(engine, model, reasoning_parser="qwen3", stream_interval=3) as client:
        whole = post(client, body(model, QWEN))
        ids = whole["choices"][0]["token_ids"]
        assert ids[0] == start and end in ids[2:-1]  # precondition
        k = ids.index(end)
        msg = whole["choices"][0]["message"]
        assert "<think>" + msg["reasoning"] + "</think>" + msg["content"] == tok.decode(ids)
        assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": k + 1}
        assert_same(streamed(client, body(model, QWEN)), (msg["reasoning"], msg["content"], whole["usage"]), engine)
        off = post(client, body(model, QWEN, chat_template_kwargs={"enable_thinking": False}))
        assert off["choices"][0]["message"]["reasoning"] is None
        assert off["choices"][0]["message"]["content"] == tok.decode(off["choices"][0]["token_ids"])
        assert off["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
        refused = client.post("/v1/chat/completions", json=body(model, QWEN, response_format={"type": "json_object"}))
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format"


def test_without_a_parser_the_think_text_is_content(engine, model):
    tok = engine.tokenizer
    with serving(engine, model) as client:
        whole = post(client, body(model, QWEN))
        msg = whole["choices"][0]["message"]
        assert set(msg) == {"role", "content"} and "completion_tokens_details" not in whole["usage"]
        assert msg["content"] == tok.decode(whole["choices"][0]["token_ids"]) and "<think>" in msg["content"]


PREFILL = [*USER, {"role": "assistant", "content": "The sky is"}]


def test_continue_final_message_ends_the_prompt_inside_the_last_message(engine, model):
    greedy = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    with serving(engine, model) as client:
        full = client.post("/tokenize", json={"messages": PREFILL, "add_generation_prompt": False}).json()["tokens"]
        cont = client.post("/tokenize", json={"messages": PREFILL, "continue_final_message": True}).json()["tokens"]
        assert cont == full[:-1] and engine.tokenizer.decode([full[-1]], False) == "<|eot_id|>"
        chat = post(client, {**greedy, "messages": PREFILL, "continue_final_message": True,
                             "add_generation_prompt": False})
        plain = client.post("/v1/completions", json={**greedy, "prompt": cont}).json()
        assert chat["usage"]["prompt_tokens"] == len(cont)
        assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
        for extra, param in (({"continue_final_message": True, "add_generation_prompt": True},
                              "continue_final_message"),
                             ({"continue_final_message": True, "messages": [*USER, {"role": "assistant",
                                                                                    "content": " "}]},
                              "messages[1].content")):
            r = client.post("/v1/chat/completions", json={**greedy, "messages": PREFILL, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_chat_echo_with_tools_is_refused(engine, model):
    tools = [{"type": "function", "function": {"name": "f"}}]
    with serving(engine, model) as client:
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "echo": True, "tools": tools})
        assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text
