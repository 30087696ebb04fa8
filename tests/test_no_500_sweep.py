"""The no-500 sweep (issue 37): a seeded random sample of the request parameter space (tests/sweep_requests.py), sent
to one real collocated server on `tiny`, six at a time, after the combinations once found broken. Each combination
of endpoint (chat, completions), streaming, n / best_of, echo, logprobs / top_logprobs, prompt_logprobs,
response_format (json_object, json_schema with $defs), guided_choice / regex / grammar, tools with every
tool_choice (none, auto, required, named; a tool with a local $ref, one with special-token text), stop strings and
tokens, max_tokens small enough to cut JSON and tool calls, return_token_ids, return_tokens_as_token_ids,
stream_options, sampling fields in and out of their ranges, and odd messages must end in a 200 or a 400 whose error
names the field (`param`): never a 5xx (a 503 of admission's shedding, with Retry-After, only rarely), never a hang,
never a body or an SSE data line that is not strict JSON (no NaN or Infinity), never an in-band error in a stream,
every stream ending with [DONE], every finish reason OpenAI's ("error" only where token bans may leave a
structured output no allowed token), and every tool call's arguments valid JSON (streamed named calls cut by
max_tokens or a stop excepted: they stream as generated, as vLLM's). A failure names the request that broke the
rule."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx
import pytest

from tests.server_process import HALF_CPU, running_server
from tests.sweep_requests import KNOWN, TOOLS, sample

pytestmark = pytest.mark.timeout(600)
SEED, REQUESTS, CONCURRENCY = 37, 500, 6
FINISHES = {"stop", "length", "tool_calls"}


def _strict(text: str) -> Any:
    """json.loads that refuses NaN and Infinity (Python's accepts them; JSON does not); integers stay text (a model
    may write one longer than Python converts)."""
    def refuse(constant: str) -> Any:
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse, parse_int=str)


def _check_calls(calls: list[dict], where: str) -> None:
    for call in calls:
        _strict(call["function"]["arguments"])  # a tool call's arguments are always JSON
        assert call["function"]["name"] in {t["function"]["name"] for t in TOOLS}, where


def _finishes(request: dict) -> set[str]:
    """The finish reasons a response may carry: "error" only where the request's token bans (bad_words, a negative
    logit_bias) may leave its structured output no allowed token (the grammar fails: the engine's "error")."""
    constrained = any(k in request for k in ("response_format", "guided_choice", "guided_regex", "guided_grammar",
                                             "structured_outputs"))
    constrained |= request.get("tool_choice") not in (None, "none", "auto")
    bans = "bad_words" in request or any(v < 0 for v in (request.get("logit_bias") or {}).values())
    return FINISHES | {"error"} if constrained and bans else FINISHES


def _check_whole(r: httpx.Response, request: dict, where: str) -> None:
    body = _strict(r.text)
    if r.status_code != 200:
        return
    assert body["choices"], where
    for choice in body["choices"]:
        assert choice["finish_reason"] in _finishes(request), where
        _check_calls(choice.get("message", {}).get("tool_calls") or [], where)


def _check_stream(lines: list[str], request: dict, where: str) -> None:
    data = [line[6:] for line in lines if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", where
    calls: dict[tuple[int, int], dict] = {}
    finish: dict[int, str] = {}
    for text in data[:-1]:
        chunk = _strict(text)
        assert "error" not in chunk, (where, chunk)
        for choice in chunk["choices"]:
            assert choice["finish_reason"] in _finishes(request) | {None}, where
            finish[choice["index"]] = choice["finish_reason"] or finish.get(choice["index"])
            for call in (choice.get("delta") or {}).get("tool_calls") or []:
                entry = calls.setdefault((choice["index"], call["index"]), {"function": {"arguments": ""}})
                entry["function"]["name"] = call["function"].get("name") or entry["function"].get("name")
                entry["function"]["arguments"] += call["function"].get("arguments") or ""
    # a named call streams its arguments as they are generated: one cut by max_tokens, a stop string or a stop token
    # stays cut (as vLLM's); one that ended on its own is whole
    may_cut = {"length", "error"} | ({"stop"} if request.get("stop") or request.get("stop_token_ids") else set())
    _check_calls([c for (i, _), c in calls.items() if finish.get(i) not in may_cut], where)


async def _send(client: httpx.AsyncClient, path: str, body: dict) -> tuple[int, str | None]:
    """(status, the 400's param or the 503's code); raises AssertionError naming the request when a rule is
    broken."""
    where = f"{path} {json.dumps(body)}"
    if body.get("stream"):
        async with client.stream("POST", path, json=body) as r:
            if r.status_code == 200:
                _check_stream([line async for line in r.aiter_lines()], body, where)
                return 200, None
            await r.aread()
    else:
        r = await client.post(path, json=body)
    if r.status_code == 503 and r.headers.get("retry-after"):  # admission shed it: the others' bookings left no room
        return 503, _strict(r.text)["error"]["code"]
    assert r.status_code in (200, 400), (r.status_code, r.text[:500], where)
    _check_whole(r, body, where)
    if r.status_code == 200:
        return 200, None
    error = _strict(r.text)["error"]
    assert isinstance(error["param"], str) and error["param"], (error, where)  # the 400 names the field
    return 400, error["param"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = {"model": "tiny", "mode": "collocated", "decode": {**HALF_CPU, "workers": 1,
                                                                "kv_cache_memory_bytes": 256 << 20}}
    with running_server(tmp_path_factory.mktemp("server_sweep"), config) as server:
        yield server


def test_no_request_of_the_parameter_space_gets_a_500_or_invalid_json(server):
    rng = random.Random(SEED)
    requests = KNOWN + [sample(rng) for _ in range(REQUESTS)]

    async def run() -> list:
        gate = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            async def one(path: str, body: dict) -> Any:
                async with gate:
                    try:
                        return await _send(client, path, body)
                    except AssertionError as e:
                        return e
                    except Exception as e:  # noqa: BLE001 - invalid JSON, a broken connection: named with its request
                        return AssertionError(f"{type(e).__name__}: {e}: {path} {json.dumps(body)}")
            return await asyncio.gather(*[one(p, b) for p, b in requests])
    results = asyncio.run(run())
    broken = [str(r)[:1500] for r in results if isinstance(r, AssertionError)]
    assert not broken, f"{len(broken)} of {len(requests)} broke a rule:\n" + "\n".join(broken[:8])
    statuses = [status for status, _ in results]
    assert statuses.count(200) >= len(requests) // 3, statuses  # the sample reaches the model, not only validation
    assert statuses.count(503) <= len(requests) // 20, statuses  # shedding under this load is the exception
