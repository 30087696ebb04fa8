"""No request parameter is silently ignored: unknown fields are 400s naming them on both endpoints, and the
request-parameter table of docs/parameters.md says exactly what coordinator/api/protocol.py does (every declared
field has a row; a "yes" is a declared field; a "400" is refused, by being unknown or through the example value its
notes give)."""

import json
import logging
import re
from pathlib import Path

import pytest

from coordinator.api import protocol
from coordinator.api.app import create_app
from coordinator.config.settings import ServerSettings
from coordinator.errors import APIError, RequestIdFilter
from engine import LLM
from tests.inprocess_backend import InProcessBackend, run_asgi

pytestmark = pytest.mark.timeout(120)
PARAMETERS = Path(__file__).resolve().parents[1] / "docs" / "parameters.md"
MODELS = {"completions": protocol.CompletionRequest, "chat": protocol.ChatCompletionRequest}
BASE = {"completions": {"model": "tiny", "prompt": "x", "stream": True},
        "chat": {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True}}
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def table() -> dict[str, dict[str, str]]:
    """{parameter: {"completions": "yes" | "400", "chat": ..., "notes": ...}} from docs/parameters.md's table."""
    section = PARAMETERS.read_text().split("## Request parameters", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"^\| `([\w.]+)` \| (yes|400) \| (yes|400) \|(.*)\|$", line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} has two rows"
            rows[m.group(1)] = {"completions": m.group(2), "chat": m.group(3), "notes": m.group(4).strip()}
    assert len(rows) > 40, "the request-parameter table of docs/parameters.md was not found"
    return rows


def with_field(endpoint: str, dotted: str, value) -> dict:
    body = json.loads(json.dumps(BASE[endpoint]))
    *parents, leaf = dotted.split(".")
    node = body
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return body


def refused_param(endpoint: str, body: dict) -> str | None:
    try:
        protocol.parse(MODELS[endpoint], body)
    except APIError as e:
        assert e.status == 400, e.body()
        return e.param
    return None


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_declared_field_has_a_row_and_every_yes_is_declared(endpoint):
    rows = table()
    declared = set(MODELS[endpoint].model_fields)
    missing = sorted(declared - set(rows))
    assert not missing, f"declared on {endpoint} but not in docs/parameters.md's table: {missing}"
    yes = {name for name, row in rows.items() if row[endpoint] == "yes"}
    nested = {f"stream_options.{name}" for name in protocol.StreamOptions.model_fields}  # a "yes" row may name one
    unknown = sorted(yes - declared - nested)
    assert not unknown, f"'yes' in docs/parameters.md but unknown to {endpoint}: {unknown}"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_400_row_is_refused_naming_the_field(endpoint):
    accepted = []
    for name, row in table().items():
        if row[endpoint] != "400":
            continue
        top = name.split(".")[0]
        if top in MODELS[endpoint].model_fields and "." not in name:  # declared: refused at the value its notes give
            example = re.search(rf'`"{re.escape(name)}": ([^`]+)`', row["notes"])
            if example is None:  # declared, and the notes name no refused value: the row is out of date
                accepted.append(name)
                continue
            value = json.loads(example.group(1))
        else:
            value = 1  # unknown: refused whatever its value
        if refused_param(endpoint, with_field(endpoint, name, value)) != name:
            accepted.append(name)
    assert not accepted, (f"'400' in docs/parameters.md but {endpoint} accepts (or refuses naming another field): "
                          f"{accepted}")


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("field", ["max_token", "Temperature", "web_search_options", "prediction", "x"])
def test_unknown_fields_are_400s_naming_them(endpoint, field):
    assert refused_param(endpoint, with_field(endpoint, field, {"type": "json_object"})) == field


def test_unknown_nested_fields_are_named_with_their_path():
    body = with_field("chat", "stream_options.include_usage_stats", True)
    assert refused_param("chat", body) == "stream_options.include_usage_stats"
    body = with_field("chat", "messages", [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}])
    assert refused_param("chat", body) == "messages[0].content[0].x"


def test_store_is_accepted_only_false_and_metadata_is_bounded():
    assert refused_param("completions", with_field("completions", "store", False)) is None
    assert refused_param("chat", with_field("chat", "store", True)) == "store"
    assert refused_param("chat", with_field("chat", "metadata", {"k": "v" * 513})) == "metadata"
    assert refused_param("chat", with_field("chat", "metadata", {str(i): "v" for i in range(17)})) == "metadata"


@pytest.fixture(scope="module")
def engine(checkpoints):
    return LLM(str(checkpoints.tiny()), max_model_len=64).engine


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_over_http_an_unknown_field_is_an_openai_400_and_never_reaches_the_backend(engine, checkpoints, endpoint):
    backend = InProcessBackend(engine, checkpoints.tiny())
    body = {**BASE[endpoint], "stream": False, "max_token": 4}

    async def fn(client):
        return await client.post(PATHS[endpoint], json=body)
    r = run_asgi(create_app(backend, ServerSettings()), backend, fn)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_token" and err["type"] == "invalid_request_error" and "max_token" in err["message"]
    assert backend.generate_calls == 0


def test_user_and_metadata_are_logged_with_the_request_id(engine, checkpoints, caplog):
    backend = InProcessBackend(engine, checkpoints.tiny())
    body = {**BASE["chat"], "stream": False, "max_tokens": 2, "user": "alice", "metadata": {"team": "eval"}}

    async def fn(client):
        return await client.post(PATHS["chat"], json=body, headers={"X-Request-Id": "rid-user-1"})
    caplog.handler.addFilter(RequestIdFilter())  # as `pdserve serve`'s handlers do: the id at the time of the record
    with caplog.at_level(logging.INFO, logger="coordinator.requests"):
        r = run_asgi(create_app(backend, ServerSettings()), backend, fn)
    assert r.status_code == 200, r.text
    logged = [rec for rec in caplog.records if rec.name == "coordinator.requests"]
    assert len(logged) == 1 and "alice" in logged[0].getMessage() and "eval" in logged[0].getMessage()
    assert logged[0].request_id == "rid-user-1"
