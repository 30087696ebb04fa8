"""What a stranger learns from the real server (`pdserve serve`, local Ray, 1 prefill + 1 decode, the `tiny`
checkpoint served from a folder by its path, no served_model_name): error answers to hostile input name no Python
exception type, no filesystem path and repeat at most a short excerpt of the input; /v1/models lists the folder's
name, not its path (a request naming the path, as vLLM's clients do, is still served); a 100 KB URL is a 414.
And what it listens on: a single-host server's sockets are all on the loopback, its KV agents' included."""

import ipaddress
import json
import re
import shutil
import socket
from urllib.parse import urlparse

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.tiny import resolve_model_path
from tests.listening_sockets import descendants_of, listening_sockets
from tests.server_process import HALF_CPU, poll, running_server, scrape, values_in, worker_pids

pytestmark = pytest.mark.timeout(400)
FOLDER = "my-tiny-checkpoint"
PYTHON_TYPE = re.compile(r"\b[A-Z][a-zA-Z]*Error:")
ECHO_LIMIT = 200  # characters of one input an error message may repeat (coordinator.client_text: MAX_LINE_CHARS)
LONG = 7000
COMP, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoints") / FOLDER
    shutil.copytree(resolve_model_path("tiny"), folder)
    config = {"model": str(folder), "prefill": HALF_CPU, "decode": HALF_CPU, "transfer": {"backends": ["ucx"]}}
    with running_server(tmp_path_factory.mktemp("hostile_clients"), config) as server:
        yield server, folder


def _words(n: int) -> str:
    """n characters of distinct words with spaces (an excerpt cannot hide in a run cut short)."""
    text, i = [], 0
    while sum(len(w) + 1 for w in text) < n:
        text.append(f"w{i}x")
        i += 1
    return " ".join(text)[:n]


def _deep(n: int, inner: str = "{}") -> str:
    return '{"type":"object","properties":{"a":' * n + inner + "}}" * n


def _cases(model: str) -> list[tuple[str, str, str]]:
    """(route, raw JSON body, the long input it carries or "") of hostile requests."""
    a, words = "A" * LONG, _words(LONG)
    chat = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    comp = {"model": model, "prompt": "x", "max_tokens": 2}
    dumps = json.dumps
    return [
        (COMP, dumps({**comp, "model": a}), a),
        (COMP, dumps({**comp, a: 1}), a),
        (COMP, dumps({**comp, "guided_regex": a + "("}), a),
        (COMP, dumps({**comp, "guided_regex": "(" + words}), words),
        (COMP, dumps({**comp, "guided_grammar": a}), a),
        (COMP, dumps({**comp, "guided_grammar": "start: " + words + " ("}), words),
        (COMP, dumps({**comp, "guided_json": {"type": "string", "pattern": a + "("}}), a),
        (COMP, dumps({**comp, "logit_bias": {a: 1}}), a),
        (COMP, dumps({**comp, "prompt": "\ud800 lone surrogate"}), ""),
        (COMP, dumps({**comp, "guided_json": "{" + words}), words),
        (COMP, dumps(comp)[:-1] + ',"guided_json":' + _deep(300) + "}", ""),
        (COMP, dumps(comp)[:-1] + ',"prompt":' + "[" * 100000 + "1" + "]" * 100000 + "}", ""),
        (CHAT, dumps({**chat, "messages": [{"role": a, "content": "x"}]}), a),
        (CHAT, dumps({**chat, "messages": [{"role": "user", "content": "\udfff"}]}), ""),
        (CHAT, dumps({**chat, "tools": [{"type": "function", "function": {"name": a, "parameters": {}}}]}), a),
        (CHAT, dumps(chat)[:-1] + ',"tools":[{"type":"function","function":{"name":"f","parameters":'
         + _deep(300) + "}}]}", ""),
        (CHAT, dumps({**chat, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"$ref": "#/$defs/" + a}}}}), a),
        (CHAT, dumps({**chat, "tool_choice": {"type": "function", "function": {"name": a}}}), a),
    ]


def _echoes(message: str, given: str) -> bool:
    """Whether `message` repeats more than ECHO_LIMIT characters of `given` in a row."""
    return any(given[i:i + ECHO_LIMIT + 1] in message for i in range(len(given) - ECHO_LIMIT))


def test_hostile_inputs_get_4xx_without_python_types_paths_or_the_input_echoed(served):
    server, folder = served
    leaks = []
    for route, body, given in _cases(str(folder)):  # the model named by its path: served before and after the id
        # changed, so every answer is about the hostile part
        r = httpx.post(server.url + route, content=body.encode(),
                       headers={"Content-Type": "application/json"}, timeout=120)
        where = f"{route} {body[:120]!r}: {r.status_code} {r.text[:300]!r}"
        assert 400 <= r.status_code < 500, where
        message = r.json()["error"]["message"] + " " + str(r.json()["error"]["param"])
        if PYTHON_TYPE.search(message):
            leaks.append(f"a Python type: {where}")
        if str(folder.parent) in message or ".py" in message or "site-packages" in message:
            leaks.append(f"a path: {where}")
        if _echoes(message, given):
            leaks.append(f"the input echoed (over {ECHO_LIMIT} characters of it): {where}")
    assert not leaks, "\n".join(leaks)


def test_models_lists_the_folder_name_and_a_request_naming_the_path_is_served(served):
    server, folder = served
    listed = httpx.get(f"{server.url}/v1/models", timeout=10)
    assert listed.status_code == 200 and str(folder.parent) not in listed.text, listed.text
    (card,) = listed.json()["data"]
    assert (card["id"], card["root"]) == (FOLDER, FOLDER), card
    wanted = LLM(str(folder)).generate(["Hello"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    for model in (FOLDER, str(folder)):  # the id listed, and the path vLLM would have listed
        r = httpx.post(f"{server.url}{COMP}", json={"model": model, "prompt": "Hello", "max_tokens": 6,
                                                    "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == wanted.text, r.text
        assert r.json()["model"] == FOLDER
    unknown = httpx.post(f"{server.url}{COMP}", json={"model": "other", "prompt": "x"}, timeout=60)
    assert unknown.status_code == 404 and str(folder.parent) not in unknown.text, unknown.text


def test_a_100_kb_url_is_a_414(served):
    server, _ = served
    address = urlparse(server.url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        sock.sendall(b"GET /v1/models?" + b"q" * 100_000 + b" HTTP/1.1\r\nHost: pdserve\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 414 "), answer[:300]
    assert json.loads(body)["error"]["code"] == "uri_too_long"


def _loopback(address: str) -> bool:
    return ipaddress.ip_address(address.removeprefix("::ffff:")).is_loopback


def test_a_single_host_server_listens_on_the_loopback_only(served):
    """Every listening socket of the server's processes is on the loopback: Ray's GCS, raylet, object manager,
    agents and core workers; the coordinator; each worker's output stream and KV agent, whose peers reach it by its
    UCX worker address (no UCX connection listener, which ucxx would open on every interface), with UCX's TCP
    transport on lo (UCX_NET_DEVICES=lo). Looked at once KV blocks have moved between the two workers over UCX."""
    server, _ = served
    r = httpx.post(f"{server.url}{COMP}", json={"model": FOLDER, "prompt": _words(300), "max_tokens": 3},
                   timeout=120)
    assert r.status_code == 200, r.text

    def moved() -> float:
        text = scrape(server.url)
        return sum(sum(values_in(text, f"pdserve_transfer_{op}_bytes").values()) for op in ("read", "write"))
    assert poll(moved, 30.0), "no KV blocks moved between the workers"
    listening = listening_sockets(descendants_of(server.pid))
    workers = set(worker_pids(server))
    assert len(workers) == 2 and workers <= {pid for _, _, pid, _ in listening}, (workers, listening)
    exposed = [entry for entry in listening if not _loopback(entry[0])]
    assert not exposed, exposed
