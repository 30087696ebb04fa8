"""Structured outputs and tool calls end to end with the `openai` client on the real server (`tiny`, random weights),
disaggregated (the prefill worker samples the first token under the grammar, the decode worker rebuilds the matcher
and continues) and collocated: gibberish comes out as JSON valid for 100 random schemas, as one of the choices, as
a regex match, and as tool calls whose arguments validate. Each server's workers report their start phase by phase
(/health to the operator, pdserve_worker_start_seconds), the grammar tables among them, built once each worker
was routable (pool_worker.start_phases); the first structured request, sent while streams run, leaves them exact."""

import asyncio
import json
import random
import re
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest

from tests.json_schemas import random_schema
from tests.server_process import HALF_CPU, OPERATOR, complete, metric_values, running_server, wait_for_idle_workers

MESSAGES = [{"role": "user", "content": "Give me the data."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping", "parameters": {
             "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}}}]
SCHEMAS = {"disaggregated": 100, "collocated": 30}


@pytest.fixture(scope="module", params=["disaggregated", "collocated"])
def server(request, tmp_path_factory):
    if request.param == "disaggregated":
        config = {"model": "tiny", "prefill": HALF_CPU, "decode": {**HALF_CPU, "max_num_seqs": 128},
                  "transfer": {"backends": ["ucx"]}}
    else:
        config = {"model": "tiny", "mode": "collocated", "decode": {**HALF_CPU, "workers": 1, "max_num_seqs": 128}}
    with running_server(tmp_path_factory.mktemp(f"structured_{request.param}"), config) as srv:
        yield SimpleNamespace(url=srv.url, mode=request.param)
        wait_for_idle_workers(srv.url)


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300, max_retries=0) as c:
        yield c


START_PHASES = {"schedule", "process", "imports", "engine_config", "engine_weights", "engine_kv_cache", "agent"}


def test_start_phases_reported_and_the_first_structured_request_beside_streams(server):
    """First in the module: the server's first structured request. Every worker lists its start phases; `grammar`
    joins them once its tables are built in the background (polled: the build may still run at /health 200)."""
    for _ in range(600):
        workers = httpx.get(f"{server.url}/health", headers=OPERATOR, timeout=10).json()["workers"]
        if all("grammar" in w["start_phases_s"] for w in workers):
            break
        asyncio.run(asyncio.sleep(0.1))
    for w in workers:
        phases = w["start_phases_s"]
        assert START_PHASES | {"grammar"} <= set(phases) and all(s >= 0 for s in phases.values()), w
    assert "start_phases_s" not in httpx.get(f"{server.url}/health", timeout=10).json()["workers"][0]  # operator's
    seconds = metric_values(server.url, "pdserve_worker_start_seconds")
    for w in workers:
        for phase in START_PHASES | {"grammar"}:
            name, role = w["name"], w["role"]
            assert seconds[f'{{worker="{name}",role="{role}",phase="{phase}"}}'] >= 0

    async def run() -> tuple[list[dict], dict]:
        async with httpx.AsyncClient(timeout=300) as client:
            body = {"model": "tiny", "max_tokens": 48, "ignore_eos": True, "stream": True, "temperature": 0}
            chunks = [0] * 3
            streams = [asyncio.create_task(complete(client, server.url, {**body, "prompt": f"Story {i}:"},
                                                    lambda n, i=i: chunks.__setitem__(i, n))) for i in range(3)]
            while min(chunks) < 2:  # every stream is running
                await asyncio.sleep(0.01)
            r = await client.post(f"{server.url}/v1/chat/completions", json={
                "model": "tiny", "messages": MESSAGES, "max_tokens": 200,
                "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}})
            assert r.status_code == 200, r.text
            return await asyncio.gather(*streams), r.json()
    streamed, structured = asyncio.run(run())
    assert all(s["completion_tokens"] == 48 and s["finish_reason"] == "length" for s in streamed)
    assert structured["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(structured["choices"][0]["message"]["content"]), WEATHER)


def test_random_schemas_give_valid_json_on_both_endpoints(server):
    rng = random.Random(14)
    schemas = [random_schema(rng) for _ in range(SCHEMAS[server.mode])]

    async def one(client: openai.AsyncOpenAI, i: int, schema: dict) -> str:
        if i % 2:
            out = await client.completions.create(model="tiny", prompt=f"Record {i}:", max_tokens=500, seed=i,
                                                  extra_body={"structured_outputs": {"json": schema}})
            return out.choices[0].finish_reason, out.choices[0].text
        out = await client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=500, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                    "strict": True}})
        return out.choices[0].finish_reason, out.choices[0].message.content

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300,
                                      max_retries=0) as client:
            return await asyncio.gather(*[one(client, i, s) for i, s in enumerate(schemas)])

    for (finish, text), schema in zip(asyncio.run(run()), schemas, strict=True):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_json_object_choice_and_regex_streamed_and_not(client):
    # any object: nothing bounds the gibberish, so a seed whose object closes (seeded sampling: same on every worker)
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=600, seed=14,
                                         response_format={"type": "json_object"})
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    choices = ["alpha beta", "gamma", "delta \"quoted\""]
    for stream in (False, True):
        kw = dict(model="tiny", prompt="Pick:", max_tokens=30, seed=5, stream=stream)
        got = client.completions.create(**kw, extra_body={"guided_choice": choices})
        text = "".join(c.choices[0].text for c in got) if stream else got.choices[0].text
        assert text in choices
        got = client.completions.create(**kw, extra_body={"guided_regex": r"[a-z]{3}-\d{2,4}"})
        text = "".join(c.choices[0].text for c in got) if stream else got.choices[0].text
        assert re.fullmatch(r"[a-z]{3}-\d{2,4}", text), text
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=300, seed=7, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}))
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), WEATHER)


def test_tool_choice_required_and_named_give_calls_that_validate(client):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(3):
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=400, seed=seed, tools=TOOLS,
                                             tool_choice="required", parallel_tool_calls=False)
        msg = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls" and msg.content is None and len(msg.tool_calls) == 1
        call = msg.tool_calls[0]
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=400, seed=1, tools=TOOLS,
                                         tool_choice=named)
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    for choice in ("required", named):
        chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=400, seed=2,
                                                     tools=TOOLS, tool_choice=choice, stream=True))
        deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
        assert deltas and deltas[0].id.startswith("call_") and deltas[0].function.name
        calls: dict[int, dict] = {}
        for d in deltas:
            entry = calls.setdefault(d.index, {"name": d.function.name, "arguments": ""})
            entry["arguments"] += d.function.arguments or ""
        for entry in calls.values():
            jsonschema.validate(json.loads(entry["arguments"]), schemas[entry["name"]])
        assert chunks[-1].choices[0].finish_reason == ("stop" if choice == named else "tool_calls")


def test_every_choice_of_n_gets_its_own_tool_calls_whole_and_streamed(client):
    """n > 1 with tools: each choice's text is read as its own calls (it came back as content before)."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=400, seed=4, tools=TOOLS,
                                             tool_choice=choice, n=3, parallel_tool_calls=False)
        assert sorted(c.index for c in out.choices) == [0, 1, 2]
        for c in out.choices:
            assert c.finish_reason == ("stop" if choice == named else "tool_calls"), c
            assert c.message.content is None and len(c.message.tool_calls) == 1
            call = c.message.tool_calls[0]
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        assert len({c.message.tool_calls[0].id for c in out.choices}) == 3
        chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=400, seed=5,
                                                     tools=TOOLS, tool_choice=choice, n=2, stream=True))
        calls: dict[tuple[int, int], dict] = {}  # (choice index, call index) -> the call
        finish: dict[int, str] = {}
        for chunk in chunks:
            for c in chunk.choices:
                assert not c.delta.content, c  # every choice's text went out as a call
                for d in c.delta.tool_calls or []:
                    entry = calls.setdefault((c.index, d.index), {"name": d.function.name, "arguments": ""})
                    entry["arguments"] += d.function.arguments or ""
                if c.finish_reason:
                    finish[c.index] = c.finish_reason
        assert {i for i, _ in calls} == {0, 1} and set(finish.values()) == {"stop" if choice == named else "tool_calls"}
        for entry in calls.values():
            jsonschema.validate(json.loads(entry["arguments"]), schemas[entry["name"]])


def test_auto_and_none_leave_plain_text_as_content(client):
    for choice in ("auto", "none"):
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                                             tools=TOOLS, tool_choice=choice)
        assert out.choices[0].message.content and not out.choices[0].message.tool_calls


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),  # the second one set, in field order
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
])
def test_invalid_specs_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, extra_body=body)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
