"""n, best_of, prompt lists, echo and prompt_logprobs with the `openai` client against the real server, disaggregated
and collocated (one server per mode): n seeded choices equal n separate requests seeded seed + j (engine.choices),
echo logprobs equal the engine's prompt logprobs, streamed equals whole, and nothing stays booked afterwards."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from tests.server_process import (
    HALF_CPU,
    assert_nothing_booked,
    metric_values,
    poll,
    requests_in_flight,
    running_server,
)

pytestmark = pytest.mark.timeout(300)
PROMPT = "The lighthouse keeper counted the ships"
SEEDED = {"temperature": 0.9, "seed": 1234, "max_tokens": 8}
EXTRA = {"ignore_eos": True}
MODES = {
    "disaggregated": {"prefill": HALF_CPU, "decode": HALF_CPU, "transfer": {"backends": ["ucx"]}},
    "collocated": {"mode": "collocated", "decode": HALF_CPU},
}


@pytest.fixture(scope="module", params=list(MODES))
def server(request, tmp_path_factory):
    config = {"model": "tiny", **MODES[request.param], "server": {"admin_api": True}}
    with running_server(tmp_path_factory.mktemp(request.param), config) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def engine():
    return LLM("tiny")


def separate(client, j: int, **kw) -> str:
    out = client.completions.create(model="tiny", prompt=PROMPT, **{**SEEDED, "seed": SEEDED["seed"] + j}, **kw,
                                    extra_body=EXTRA)
    return out.choices[0].text


def test_n_choices_equal_separate_seeded_requests_streamed_and_not(client):
    want = [separate(client, j) for j in range(3)]
    assert len(set(want)) == 3
    out = client.completions.create(model="tiny", prompt=PROMPT, n=3, **SEEDED, extra_body=EXTRA)
    assert [c.index for c in out.choices] == [0, 1, 2] and [c.text for c in out.choices] == want
    assert all(c.finish_reason == "length" for c in out.choices) and out.usage.completion_tokens == 24
    texts = {}
    for chunk in client.completions.create(model="tiny", prompt=PROMPT, n=3, stream=True, **SEEDED,
                                           extra_body=EXTRA):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[j] for j in range(3)] == want
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                          **SEEDED, extra_body=EXTRA)
    single = [client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                             **{**SEEDED, "seed": SEEDED["seed"] + j}, extra_body=EXTRA)
              for j in range(2)]
    assert [c.message.content for c in chat.choices] == [s.choices[0].message.content for s in single]
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                                stream=True, **SEEDED, extra_body=EXTRA):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[j] for j in range(2)] == [c.message.content for c in chat.choices]


def test_prompt_lists_index_across_prompts_with_one_usage(client):
    prompts = [PROMPT, "Five bells rang"]
    out = client.completions.create(model="tiny", prompt=prompts, n=2, **SEEDED, extra_body=EXTRA)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == separate(client, 0) and out.choices[1].text == separate(client, 1)
    one = client.completions.create(model="tiny", prompt="Five bells rang", **SEEDED, extra_body=EXTRA)
    assert out.choices[2].text == one.choices[0].text
    first = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1).usage.prompt_tokens
    assert out.usage.prompt_tokens == first + one.usage.prompt_tokens
    ids = client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=2, temperature=0)
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage.prompt_tokens == 5
    assert out.usage.completion_tokens == 32


@pytest.mark.parametrize("path, extra", [
    ("completions", {"n": 2}), ("completions", {"prompt": [PROMPT, "Five bells rang"]}),
    ("completions", {"echo": True, "n": 3}), ("chat/completions", {"n": 2})])
def test_continuous_usage_stats_with_several_choices_count_each_choice(server, path, extra):
    """As vLLM does with n > 1: every chunk carries its own choice's usage so far (its prompt's tokens, the tokens its
    chunks have carried); the closing usage chunk counts each prompt once and every choice's tokens."""
    body = {**SEEDED, "model": "tiny", "max_tokens": 6, "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"continuous_usage_stats": True}}
    extra = dict(extra)
    prompts = extra.pop("prompt", [PROMPT])
    n = extra.get("n", 1)
    if path == "chat/completions":
        body["messages"] = [{"role": "user", "content": PROMPT}]
        lengths = [len(httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "messages": body["messages"]},
                                  timeout=30).json()["tokens"])]
    else:
        body["prompt"] = prompts if len(prompts) > 1 else prompts[0]
        lengths = [len(httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "prompt": p}, timeout=30)
                       .json()["tokens"]) for p in prompts]
    with httpx.stream("POST", f"{server.url}/v1/{path}", json={**body, **extra}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    *chunks, last = events
    sent: dict[int, int] = {}
    for e in chunks:
        (choice,) = e["choices"]
        i, usage = choice["index"], e["usage"]
        sent[i] = sent.get(i, 0) + len(choice.get("token_ids") or [])
        assert usage["prompt_tokens"] == lengths[i // n], (i, usage)
        assert usage["completion_tokens"] == sent[i], (i, usage, sent)  # this choice's tokens sent so far
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert sorted(sent) == list(range(n * len(lengths))) and set(sent.values()) == {6}
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] == sum(lengths)
    assert last["usage"]["completion_tokens"] == 6 * n * len(lengths)


def test_echo_logprobs_equal_the_engines_prompt_logprobs(client, engine):
    ids = engine.engine.tokenizer.encode(PROMPT)
    e = engine.engine
    e.add_request("ref", ids, SamplingParams(max_tokens=1, prompt_logprobs=2))
    ref = None
    while e.has_unfinished():
        ref = [o for o in e.step() if o.prompt_logprobs is not None] or ref
    entries = ref[0].prompt_logprobs
    out = client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=2, max_tokens=3,
                                    temperature=0)
    lp = out.choices[0].logprobs
    assert out.choices[0].text.startswith(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([x.logprob for x in entries], abs=1e-4)
    assert len(lp.tokens) == len(ids) + 3
    streamed = list(client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=2, max_tokens=3,
                                              temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text
    raw = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 1})
    plp = raw.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert plp[1][str(ids[1])]["logprob"] == pytest.approx(entries[0].logprob, abs=1e-4)


def test_chat_prompt_logprobs_cover_the_templated_prompt(server, client, engine):
    msgs = [{"role": "user", "content": "hi"}]
    ids = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "messages": msgs}, timeout=30).json()["tokens"]
    e = engine.engine
    e.add_request("chat-ref", ids, SamplingParams(max_tokens=1, prompt_logprobs=1))
    ref = None
    while e.has_unfinished():
        ref = [o for o in e.step() if o.prompt_logprobs is not None] or ref
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 1})
    plp = chat.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert [p[str(t)]["logprob"] for p, t in zip(plp[1:], ids[1:], strict=True)] == pytest.approx(
        [x.logprob for x in ref[0].prompt_logprobs], abs=1e-4)


def test_best_of_keeps_the_most_likely_and_refuses_stream(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, n=1, best_of=3, **SEEDED, extra_body=EXTRA)
    assert len(out.choices) == 1 and out.choices[0].logprobs is None
    assert out.choices[0].text in [separate(client, j) for j in range(3)]
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model="tiny", prompt=PROMPT, best_of=2, stream=True)
    with pytest.raises(openai.BadRequestError, match="n"):
        client.completions.create(model="tiny", prompt=PROMPT, n=129)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model="tiny", prompt=PROMPT, n=3, best_of=2)


def test_metrics_count_a_request_of_n_choices_once(server, client):
    def totals():
        requests = sum(metric_values(server.url, "pdserve_requests_total").values())
        return (requests, metric_values(server.url, "pdserve_prompt_tokens_total")[None],
                metric_values(server.url, "pdserve_generation_tokens_total")[None])
    before = totals()
    out = client.completions.create(model="tiny", prompt=PROMPT, n=3, **SEEDED, extra_body=EXTRA)
    after = totals()
    assert after[0] - before[0] == 1
    assert after[1] - before[1] == out.usage.prompt_tokens
    assert after[2] - before[2] == out.usage.completion_tokens == 3 * SEEDED["max_tokens"]


def test_clients_that_leave_at_the_last_event_leave_nothing_in_flight(server):
    """The openai client closes a stream's connection once it reads [DONE], which can cancel the stream's cleanup
    while it closes the choices: the drain ticket (a server held it 30 s at stop) and the tenant's charge (its
    in-flight limit) must still be given back."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True, **SEEDED, **EXTRA}
    text = {"model": "tiny", "prompt": PROMPT, "n": 3, "stream": True, **SEEDED, **EXTRA}
    for path, body in (("chat/completions", {**chat, "n": 2}), ("chat/completions", chat), ("completions", text)):
        for _ in range(12):
            with httpx.stream("POST", f"{server.url}/v1/{path}", json=body, timeout=60) as r:
                assert r.status_code == 200
                assert any(line == "data: [DONE]" for line in r.iter_lines())  # then the connection is dropped

    assert poll(lambda: not any(requests_in_flight(server.url)), 10), requests_in_flight(server.url)


def test_nothing_stays_booked(server, client):
    assert_nothing_booked(server.url)
