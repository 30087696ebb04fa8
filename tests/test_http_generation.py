"""Generation through HTTP against a real uvicorn server and a real engine: the output equals engine.LLM's for the
same prompts and parameters, streamed or not, alone or concurrent; chat template, stop strings, stop_token_ids,
logprobs, usage, seeds."""

import asyncio
import json

import httpx
import openai
import pytest

from coordinator.api.app import create_app
from coordinator.config.settings import ServerSettings
from engine import LLM, SamplingParams
from tests.inprocess_backend import InProcessBackend, ServerThread, run_asgi, wait_until

pytestmark = pytest.mark.timeout(60)
MAX_LEN = 64
PROMPTS = ["Hello, world", "The old lighthouse stood at the edge", "Two plus two is", [5, 17, 300, 1200, 44]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def ref(checkpoints):
    return LLM(str(checkpoints.tiny()), max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def server(checkpoints):
    folder = checkpoints.tiny()
    backend = InProcessBackend(LLM(str(folder), max_model_len=MAX_LEN).engine, folder)
    with ServerThread(create_app(backend, ServerSettings()), backend) as srv:
        yield srv
    assert backend.integrity["in_use"] == 0


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c
    assert wait_until(lambda: server.backend.idle, 10)


def completion(client, prompt, **body):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream(client, path, body):
    """The parsed SSE events of a streamed request, up to and including [DONE] (as None)."""
    events = []
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: ")
                events.append(None if line == "data: [DONE]" else json.loads(line[6:]))
    assert events[-1] is None and None not in events[:-1]
    return events[:-1]


def greedy_body(prompt, **extra):
    return {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **extra}


def test_greedy_completions_equal_the_engine_streamed_and_not(client, ref):
    expected = ref.generate(PROMPTS, GREEDY)
    for prompt, exp in zip(PROMPTS, expected, strict=True):
        body = completion(client, prompt, max_tokens=16, temperature=0, ignore_eos=True)
        choice = body["choices"][0]
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == "tiny"
        assert choice["text"] == exp.text and choice["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": len(exp.prompt_token_ids), "completion_tokens": 16,
                                 "total_tokens": len(exp.prompt_token_ids) + 16,
                                 "prompt_tokens_details": {"cached_tokens": 0}}  # shorter than a block
        events = stream(client, "/v1/completions", greedy_body(prompt))
        assert "".join(e["choices"][0]["text"] for e in events) == exp.text
        assert [e["choices"][0]["finish_reason"] for e in events][-1] == "length"
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
        assert len({e["id"] for e in events}) == 1 and all("usage" not in e for e in events)


def test_a_list_of_one_string_is_one_prompt(client, ref):
    [exp] = ref.generate([PROMPTS[0]], GREEDY)
    assert completion(client, [PROMPTS[0]], max_tokens=16, temperature=0, ignore_eos=True)["choices"][0]["text"] \
        == exp.text


def test_concurrent_streams_each_equal_the_engine(server, ref):
    expected = ref.generate(PROMPTS, GREEDY)

    async def one(client, prompt):
        text = ""
        async with client.stream("POST", "/v1/completions", json=greedy_body(prompt, stream=True)) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS * 2))

    assert asyncio.run(main()) == [e.text for e in expected * 2]


def test_seeded_sampling_is_reproducible_and_equals_the_engine(client, ref):
    params = dict(temperature=0.9, top_p=0.95, top_k=50, min_p=0.01, seed=1234, max_tokens=20, ignore_eos=True)
    [exp] = ref.generate([PROMPTS[1]], SamplingParams(**params))
    texts = [completion(client, PROMPTS[1], **params)["choices"][0]["text"] for _ in range(2)]
    streamed = "".join(e["choices"][0]["text"] for e in stream(client, "/v1/completions",
                                                                {"model": "tiny", "prompt": PROMPTS[1], **params}))
    assert texts == [exp.text, exp.text] and streamed == exp.text
    other = completion(client, PROMPTS[1], **{**params, "seed": 99})["choices"][0]["text"]
    assert other != exp.text


def test_chat_applies_the_template_streamed_and_not(client, ref):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    templated = ref.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    prompt_ids = ref.tokenizer.encode(templated, add_special_tokens=False)
    [exp] = ref.chat([messages], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    body = {"model": "tiny", "messages": messages, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/chat/completions", json=body).json()
    assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
    assert r["choices"][0]["message"] == {"role": "assistant", "content": exp.text}
    assert r["usage"]["prompt_tokens"] == len(prompt_ids) == len(exp.prompt_token_ids)
    events = stream(client, "/v1/chat/completions", body)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == exp.text
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    parts = [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]  # content as a list of text parts
    body["messages"] = [messages[0], {"role": "user", "content": parts}]
    assert client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"] == exp.text


def test_chat_without_max_tokens_may_use_the_whole_context(client):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/chat/completions", json=body).json()
    assert r["usage"]["total_tokens"] == MAX_LEN and r["choices"][0]["finish_reason"] == "length"


def _token_texts(tokenizer, ids):
    """(start, end) of each token's text in decode(ids), for tokens whose text grows the decode."""
    spans, prev = [], 0
    for k in range(1, len(ids) + 1):
        n = len(tokenizer.decode(ids[:k]))
        spans.append((prev, n))
        prev = n
    return spans


def test_stop_string_spanning_tokens_ends_output_before_it(server, client, ref):
    [exp] = ref.generate([PROMPTS[1]], GREEDY)
    spans = _token_texts(ref.tokenizer, exp.token_ids)
    # a stop string that starts inside one token's text and ends inside the next one's
    i = next(i for i in range(1, len(spans) - 1)
             if spans[i][1] - spans[i][0] >= 2 and spans[i + 1][1] - spans[i + 1][0] >= 2)
    stop = exp.text[spans[i][0] + 1:spans[i + 1][1] - 1]
    want = exp.text[:exp.text.index(stop)]
    body = completion(client, PROMPTS[1], max_tokens=16, temperature=0, ignore_eos=True, stop=[stop, "zzzz"])
    assert body["choices"][0] == {"index": 0, "text": want, "logprobs": None, "finish_reason": "stop",
                                  "prompt_logprobs": None, "token_ids": None, "prompt_token_ids": None}
    assert body["usage"]["completion_tokens"] < 16
    assert body["id"] in server.backend.aborted  # the coordinator closed the stream: the engine stopped too
    events = stream(client, "/v1/completions", greedy_body(PROMPTS[1], stop=stop))
    assert "".join(e["choices"][0]["text"] for e in events) == want
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    # a stop string that only ever matches partially is held back, then sent in full
    tail = exp.text[-3:] + "\u2603"
    events = stream(client, "/v1/completions", greedy_body(PROMPTS[1], stop=tail))
    assert "".join(e["choices"][0]["text"] for e in events) == exp.text


def test_stop_token_ids_stop_like_the_engine(client, ref):
    [exp] = ref.generate([PROMPTS[0]], GREEDY)
    stop_id = exp.token_ids[5]
    [want] = ref.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                        stop_token_ids=[stop_id]))
    body = completion(client, PROMPTS[0], max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    assert body["choices"][0]["text"] == want.text and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(want.token_ids) <= 6


def test_completion_logprobs_have_the_openai_shape(client, ref):
    [exp] = ref.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3))
    body = completion(client, PROMPTS[2], max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    lp = body["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 8
    assert lp["token_logprobs"] == pytest.approx([t.logprob for t in exp.logprobs], abs=1e-4)
    assert all(1 <= len(top) <= 4 for top in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    assert all(top[tok] == lp_ for tok, lp_, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                                          strict=True))  # the sampled token is always there
    zero = completion(client, PROMPTS[2], max_tokens=4, temperature=0, ignore_eos=True, logprobs=0)
    zlp = zero["choices"][0]["logprobs"]
    assert [list(top) for top in zlp["top_logprobs"]] == [[tok] for tok in zlp["tokens"]]  # N + 1 = 1 entry
    assert lp["text_offset"] == sorted(lp["text_offset"])
    events = stream(client, "/v1/completions", {**greedy_body(PROMPTS[2]), "max_tokens": 8, "logprobs": 3})
    assert sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in events) == 8


def test_chat_logprobs_have_the_openai_shape(client):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
    content = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 6
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6
    plain = client.post("/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": None}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_include_usage_adds_a_usage_chunk_before_done(client):
    events = stream(client, "/v1/chat/completions",
                    {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                     "ignore_eos": True, "stream_options": {"include_usage": True}})
    *chunks, last = events
    assert all(c["usage"] is None for c in chunks) and last["choices"] == []
    assert last["usage"]["completion_tokens"] == 5
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 5
    assert "phases" not in last  # only when asked for: a plain OpenAI client sees OpenAI's shape


def test_include_phases_puts_the_request_phases_on_the_usage_chunk_and_refuses_what_it_cannot_trace(client):
    """The in-process backend records no phases of its own: ingress, then everything else is overhead (the Ray
    backend's phases are checked in the serving suites). Asking without include_usage, or for n > 1, is a 400."""
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 5, "ignore_eos": True,
            "stream_options": {"include_usage": True, "include_phases": True}}
    *_, last = stream(client, "/v1/completions", body)
    assert last["usage"]["completion_tokens"] == 5 and list(last["phases"]) == ["ingress", "overhead"]
    assert all(v >= 0 for v in last["phases"].values()) and last["phases"]["overhead"] > 0
    for extra, param in (({"stream_options": {"include_phases": True}}, "stream_options.include_phases"),
                         ({"n": 2}, "stream_options.include_phases")):
        r = client.post("/v1/completions", json={**body, "stream": True, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_transformers_written_checkpoint_serves_its_own_greedy_output(checkpoints):
    """Another model folder (written by transformers' save_pretrained), in-process ASGI: text and chunks match."""
    folder = checkpoints.get("LlamaForCausalLM")
    llm = LLM(str(folder), max_model_len=MAX_LEN)
    [exp] = llm.generate([PROMPTS[1]], GREEDY)
    backend = InProcessBackend(llm.engine, folder, model_name="hf-llama")
    app = create_app(backend, ServerSettings())
    body = {**greedy_body(PROMPTS[1]), "model": "hf-llama"}

    async def fn(client):
        return [await client.post("/v1/completions", json={**body, "stream": s}) for s in (False, True)]

    whole, streamed = run_asgi(app, backend, fn)
    assert whole.json()["choices"][0]["text"] == exp.text and whole.json()["model"] == "hf-llama"
    events = [json.loads(e[6:]) for e in streamed.text.split("\n\n") if e.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == exp.text
    assert streamed.text.endswith("data: [DONE]\n\n") and backend.idle


def _strict(text: str):
    """JSON as a strict parser reads it: -Infinity, Infinity and NaN are refused."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def test_constrained_outputs_with_logprobs_are_json_and_floored(client):
    """A grammar masks tokens to -inf; their logprobs come out at OpenAI's floor (-9999.0), never as -Infinity
    (a 500 on the whole body, invalid JSON in a stream)."""
    bodies = [("/v1/completions", {"model": "tiny", "prompt": "Pick", "max_tokens": 8, "logprobs": 5,
                                   "guided_choice": ["yes", "no"]}),
              ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "JSON please"}],
                                        "max_tokens": 12, "logprobs": True, "top_logprobs": 5,
                                        "response_format": {"type": "json_object"}})]
    for path, body in bodies:
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        data = _strict(r.text)
        choice = data["choices"][0]
        values = ([v for top in choice["logprobs"]["top_logprobs"] for v in top.values()]
                  if "text" in choice else
                  [t["logprob"] for c in choice["logprobs"]["content"] for t in c["top_logprobs"]])
        assert values and min(values) == -9999.0 and all(v <= 0 for v in values)
        with client.stream("POST", path, json={**body, "stream": True}) as s:
            assert s.status_code == 200
            chunks = [_strict(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert chunks and all("error" not in c for c in chunks)


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client):
    body = {**greedy_body(PROMPTS[1]), "max_tokens": 6,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = stream(client, "/v1/completions", body)
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert all(e["usage"]["prompt_tokens"] == events[-1]["usage"]["prompt_tokens"] > 0 for e in events)
    assert counts == sorted(counts) and counts[-1] == 6 and counts[0] >= 1  # grows with the tokens sent
    plain = stream(client, "/v1/completions", {**body, "stream_options": {"include_usage": True,
                                                                          "continuous_usage_stats": False}})
    assert all(e["usage"] is None for e in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 6
    r = client.post("/v1/completions", json={**body, "stream": True, "n": 2,
                                              "stream_options": {"include_usage": True, "include_phases": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.include_phases"  # single only


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_without_include_usage_as_vllm_answers(client, path):
    """vLLM's stream_options tests: continuous_usage_stats alone implies include_usage (vLLM's default), so every chunk
    carries the usage so far; with include_usage false it is accepted and no chunk carries a usage."""
    body = {**greedy_body(PROMPTS[1]), "max_tokens": 4}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    alone = stream(client, path, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all(e["usage"]["prompt_tokens"] > 0 for e in alone) and alone[-1]["usage"]["completion_tokens"] == 4
    assert alone[-1]["choices"] == []  # the usage chunk that include_usage adds
    off = stream(client, path, {**body, "stream_options": {"include_usage": False, "continuous_usage_stats": True}})
    assert off and all(e.get("usage") is None for e in off) and all(e["choices"] for e in off)


def test_a_forced_call_cut_by_max_tokens_has_an_empty_tool_calls_list(server):
    """vLLM's test_max_tokens_with_tool_choice_required, with the openai client: one token cannot hold a call;
    finish_reason "length" and `len(message.tool_calls) == 0` (a list, not null: len(None) raised in that test)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60, max_retries=0) as client:
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather?"}],
                                                 max_completion_tokens=1, temperature=0, tools=tools,
                                                 tool_choice=choice)
            assert out.choices[0].finish_reason == "length", out
            assert out.choices[0].message.tool_calls is not None and len(out.choices[0].message.tool_calls) == 0, out


def test_cached_tokens_count_the_prompt_blocks_the_prefix_cache_held_streamed_and_not(client, ref):
    """usage.prompt_tokens_details.cached_tokens (OpenAI's, vLLM's): 0 for a prompt never seen, then every full
    block of it but the one holding its last token (whose KV is always computed), on both endpoints, streamed or
    not, and with continuous usage on every chunk; the output is the cold run's."""
    prompt = list(range(300, 340))  # 40 tokens: 2 full blocks of 16 before the last token
    exp = ref.generate([prompt], GREEDY)[0]
    cold = completion(client, prompt, max_tokens=16, temperature=0, ignore_eos=True)
    assert cold["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    warm = completion(client, prompt, max_tokens=16, temperature=0, ignore_eos=True)
    assert warm["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert cold["choices"][0]["text"] == warm["choices"][0]["text"] == exp.text
    events = stream(client, "/v1/completions", greedy_body(prompt, stream_options={"include_usage": True}))
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == exp.text
    events = stream(client, "/v1/completions", greedy_body(prompt, stream_options={
        "include_usage": True, "continuous_usage_stats": True}))
    assert all(e["usage"]["prompt_tokens_details"] == {"cached_tokens": 32} for e in events)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "tell me " * 14}], "max_tokens": 4}
    first = client.post("/v1/chat/completions", json=chat).json()["usage"]
    assert first["prompt_tokens"] > 32 and first["prompt_tokens_details"] == {"cached_tokens": 0}
    events = stream(client, "/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}})
    assert events[-1]["usage"]["prompt_tokens_details"] == {
        "cached_tokens": (first["prompt_tokens"] - 1) // 16 * 16}
