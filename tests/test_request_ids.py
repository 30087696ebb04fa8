"""Request ids through a real uvicorn server and a real engine: the client's X-Request-Id (or a generated one) comes
back on every response of the request (success, SSE stream, every 4xx/5xx), is the backend request's id, shapes the
OpenAI body id, and is on every log line about the request; a malformed X-Request-Id is a 400 naming the header."""

import json
import logging

import httpx
import pytest

from coordinator import errors
from coordinator.api.app import create_app
from coordinator.config.settings import ServerSettings
from coordinator.contract import BackendError, Overloaded
from engine import LLM
from tests.inprocess_backend import InProcessBackend, ServerThread, wait_until

pytestmark = pytest.mark.timeout(60)
MAX_LEN = 64
COMP, CHAT = "/v1/completions", "/v1/chat/completions"
BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
CHAT_BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "ignore_eos": True}


class RecordingBackend(InProcessBackend):
    """The in-process engine backend, keeping every GenerateRequest it was given."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.requests = []

    def generate(self, request):
        self.requests.append(request)
        return super().generate(request)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.addFilter(errors.RequestIdFilter())
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def server(checkpoints):
    folder = checkpoints.tiny()
    backend = RecordingBackend(LLM(str(folder), max_model_len=MAX_LEN).engine, folder)
    with ServerThread(create_app(backend, ServerSettings(api_key="k")), backend) as srv:
        yield srv


@pytest.fixture
def client(server):
    server.backend.fail_with = None
    server.backend.fail_stream_after = None
    with httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": "Bearer k"}) as c:
        yield c
    assert wait_until(lambda: server.backend.idle, 10)


@pytest.fixture
def logs():
    handler = Records()
    logger = logging.getLogger()
    logger.addHandler(handler)
    old = logging.getLogger("coordinator").level
    logging.getLogger("coordinator").setLevel(logging.INFO)
    yield handler.records
    logger.removeHandler(handler)
    logging.getLogger("coordinator").setLevel(old)


def test_a_client_id_is_returned_is_the_backend_id_and_shapes_the_body_id(client, server):
    for path, body, prefix in [(COMP, BODY, "cmpl-"), (CHAT, CHAT_BODY, "chatcmpl-")]:
        rid = f"trace-{prefix}42:a/b"
        r = client.post(path, json=body, headers={"X-Request-Id": rid})
        assert r.status_code == 200 and r.headers["x-request-id"] == rid
        assert r.json()["id"] == prefix + rid
        assert server.backend.requests[-1].request_id == rid and rid in server.backend.finished
    already = "chatcmpl-abc"  # an id that already has the body's prefix is the body id as it is
    assert client.post(CHAT, json=CHAT_BODY, headers={"X-Request-Id": already}).json()["id"] == already


def test_a_stream_carries_the_id_in_its_header_and_every_chunk(client, server):
    with client.stream("POST", CHAT, json={**CHAT_BODY, "stream": True}, headers={"X-Request-Id": "s-1"}) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "s-1"
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert len(chunks) >= 2 and {c["id"] for c in chunks} == {"chatcmpl-s-1"}
    assert server.backend.requests[-1].request_id == "s-1"


def test_without_a_client_id_one_is_generated_unique_and_equal_to_the_body_id(client, server):
    seen = set()
    for path, body, prefix in [(COMP, BODY, "cmpl-"), (CHAT, CHAT_BODY, "chatcmpl-"), (COMP, BODY, "cmpl-")]:
        r = client.post(path, json=body)
        rid = r.headers["x-request-id"]
        assert r.status_code == 200 and rid.startswith(prefix) and r.json()["id"] == rid
        assert server.backend.requests[-1].request_id == rid
        seen.add(rid)
    assert len(seen) == 3
    assert client.get("/v1/models").headers["x-request-id"].startswith("req-")


def test_every_error_response_carries_the_id(client, server):
    h = {"X-Request-Id": "err-1"}
    cases = [
        client.post(COMP, json={**BODY, "temperature": -1}, headers=h),                   # 400
        client.post(COMP, json=BODY, headers={**h, "Authorization": "Bearer wrong"}),      # 401
        client.get("/v1/nothing", headers=h),                                              # 404
        client.get(COMP, headers=h),                                                       # 405
        client.post(COMP, content=b"{}", headers={**h, "Content-Type": "text/plain"}),    # 415
        client.post(COMP, json={**BODY, "prompt": "x" * 10_000_000}, headers=h),           # 413
    ]
    server.backend.fail_with = Overloaded("queue full", retry_after_s=2)
    cases.append(client.post(COMP, json=BODY, headers=h))                                  # 503
    server.backend.fail_with = BackendError("worker died")
    cases.append(client.post(COMP, json=BODY, headers=h))                                  # 502
    server.backend.fail_with = RuntimeError("a bug")
    cases.append(client.post(COMP, json=BODY, headers=h))                                  # 500
    assert [r.status_code for r in cases] == [400, 401, 404, 405, 415, 413, 503, 502, 500]
    for r in cases:
        assert r.headers["x-request-id"] == "err-1", r.status_code
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("bad", [b"", b"has space", b"x" * 129, b"tab\there", b"caf\xc3\xa9"])
def test_a_malformed_request_id_is_a_400_naming_the_header(client, server, bad):
    calls = server.backend.generate_calls
    r = client.post(COMP, json=BODY, headers=[(b"X-Request-Id", bad)])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "X-Request-Id" and "X-Request-Id" in err["message"]
    assert r.headers["x-request-id"].startswith("cmpl-") and r.headers["x-request-id"].encode() != bad
    assert server.backend.generate_calls == calls


def test_a_control_character_in_a_header_is_a_400_json_error_from_the_http_layer(client, server):
    """DEL is not allowed in any header value (RFC 9110): the HTTP parser refuses the request before the app, with
    OpenAI's error JSON, and the connection closes."""
    calls = server.backend.generate_calls
    r = client.post(COMP, json=BODY, headers=[(b"X-Request-Id", b"nul\x7f")])
    assert r.status_code == 400 and r.headers["connection"] == "close"
    assert r.json()["error"]["code"] == "invalid_http_request" and "header" in r.json()["error"]["message"]
    assert server.backend.generate_calls == calls


def test_two_request_id_headers_are_refused(client):
    r = client.post(COMP, json=BODY, headers=[(b"X-Request-Id", b"a"), (b"X-Request-Id", b"b")])
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"


def test_the_longest_valid_id_is_accepted(client):
    rid = "".join(chr(33 + i % 94) for i in range(128))  # every printable ASCII character but space
    r = client.post(COMP, json=BODY, headers={"X-Request-Id": rid})
    assert r.status_code == 200 and r.headers["x-request-id"] == rid


def test_log_lines_about_a_request_carry_its_id(client, server, logs):
    ray_text = "ray::DecodeWorker.step() (pid=31337, ip=10.1.2.3, actor_id=a1b2c3d4e5f60718293a4b5c01000000)"
    server.backend.fail_with = BackendError(ray_text)
    r = client.post(COMP, json=BODY, headers={"X-Request-Id": "log-1"})
    assert r.status_code == 502 and "31337" not in r.text
    failures = [rec for rec in logs if rec.getMessage().startswith("backend failure")]
    assert [rec.request_id for rec in failures] == ["log-1"]
    assert ray_text in failures[0].getMessage()  # the full text stays in the server's log
    server.backend.fail_with = RuntimeError("a bug")
    assert client.post(COMP, json=BODY, headers={"X-Request-Id": "log-2"}).status_code == 500
    unexpected = [rec for rec in logs if rec.getMessage().startswith("unexpected error")]
    assert [rec.request_id for rec in unexpected] == ["log-2"] and unexpected[0].exc_info is not None
    server.backend.fail_with = None
    logging.getLogger("coordinator").info("outside any request")
    assert logs[-1].request_id == "-"
