"""Bad input and backend failures: OpenAI-shaped errors with the right status, and never a backend call for a
request the HTTP edge rejects (the in-process backend counts generate() calls)."""

import json

import httpx
import pytest

from coordinator.api.app import create_app
from coordinator.config.settings import ServerSettings
from coordinator.contract import BackendError, Overloaded
from engine import LLM
from tests.inprocess_backend import InProcessBackend, run_asgi

pytestmark = pytest.mark.timeout(60)
MAX_LEN = 64
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "Hi"}]
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def engine(checkpoints):
    return LLM(str(checkpoints.tiny()), max_model_len=MAX_LEN).engine


@pytest.fixture
def backend(engine, checkpoints):
    b = InProcessBackend(engine, checkpoints.tiny())
    yield b
    assert b.idle


def make_app(backend, **settings):
    return create_app(backend, ServerSettings(**settings))


def send(app, backend, method, path, **kwargs) -> httpx.Response:
    async def fn(client):
        return await client.request(method, path, **kwargs)
    return run_asgi(app, backend, fn)


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


BAD = [
    # (path, body, param): every one a 400 before any backend call
    (COMP, {"prompt": "x"}, "model"),
    (COMP, {"model": "tiny"}, "prompt"),
    (COMP, {"model": "tiny", "prompt": 5}, "prompt"),
    (COMP, {"model": "tiny", "prompt": "x", "temperature": "hot"}, "temperature"),
    (COMP, {"model": "tiny", "prompt": "x", "max_tokens": "8"}, "max_tokens"),
    (COMP, {"model": "tiny", "prompt": "x", "max_tokens": True}, "max_tokens"),
    (COMP, {"model": "tiny", "prompt": "x", "stream": "yes"}, "stream"),
    (COMP, {"model": "tiny", "prompt": "x", "stop": 7}, "stop"),
    (COMP, {"model": "tiny", "prompt": "x", "stop": [""]}, "stop"),
    (COMP, {"model": "tiny", "prompt": "x", "stop": ["a"] * 17}, "stop"),
    (COMP, {"model": "tiny", "prompt": "x", "stop_token_ids": ["a"]}, "stop_token_ids[0]"),
    (COMP, {"model": "tiny", "prompt": "x", "stop_token_ids": [2048]}, "stop_token_ids"),
    (COMP, {"model": "tiny", "prompt": "x", "temperature": -0.5}, "temperature"),
    (COMP, {"model": "tiny", "prompt": "x", "top_p": 0}, "top_p"),
    (COMP, {"model": "tiny", "prompt": "x", "top_p": 1.5}, "top_p"),
    (COMP, {"model": "tiny", "prompt": "x", "top_k": -2}, "top_k"),
    (COMP, {"model": "tiny", "prompt": "x", "top_k": 2**70}, "top_k"),
    (COMP, b'{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),  # a lone surrogate: valid JSON, not UTF-8
    (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
    (CHAT, {"model": "tiny", "messages": MSGS, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    (COMP, {"model": "tiny", "prompt": "x", "min_p": 2}, "min_p"),
    (COMP, {"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    (COMP, {"model": "tiny", "prompt": "x", "logprobs": 21}, "logprobs"),
    (COMP, {"model": "tiny", "prompt": "x", "seed": -1}, "seed"),
    (COMP, {"model": "tiny", "prompt": "x", "n": 0}, "n"),
    (COMP, {"model": "tiny", "prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    (COMP, {"model": "tiny", "prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    (COMP, {"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    (COMP, {"model": "tiny", "prompt": ["a"] * 129}, "prompt"),
    (COMP, {"model": "tiny", "prompt": [[1, 2]] * 65, "n": 2}, "n"),
    (COMP, {"model": "tiny", "prompt": []}, "prompt"),
    (COMP, {"model": "tiny", "prompt": [1, -1]}, "prompt"),
    (COMP, {"model": "tiny", "prompt": [1, 2048]}, "prompt"),
    (COMP, {"model": "tiny", "prompt": list(range(1, MAX_LEN + 1))}, "prompt"),
    (COMP, {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": MAX_LEN - 2}, "max_tokens"),
    (CHAT, {"model": "tiny"}, "messages"),
    (CHAT, {"model": "tiny", "messages": []}, "messages"),
    (CHAT, {"model": "tiny", "messages": "hi"}, "messages"),
    (CHAT, {"model": "tiny", "messages": [{"content": "hi"}]}, "messages[0].role"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "url": "x"}]}]},
     "messages[0].content"),
    (CHAT, {"model": "tiny", "messages": MSGS, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"model": "tiny", "messages": MSGS, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"model": "tiny", "messages": MSGS, "max_tokens": MAX_LEN}, "max_tokens"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "word " * MAX_LEN}]}, "messages"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD, ids=[f"{p[-11:]}-{param}-{i}" for i, (p, _, param)
                                                             in enumerate(BAD)])
def test_bad_request_is_a_400_naming_the_parameter_without_a_backend_call(backend, path, body, param):
    kwargs = {"content": body, "headers": JSON} if isinstance(body, bytes) else {"json": body}
    err = assert_openai_error(send(make_app(backend), backend, "POST", path, **kwargs), 400, param)
    assert err["type"] == "invalid_request_error"
    assert backend.generate_calls == 0


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b"", b"[" * 100_000 + b"]" * 100_000,
                                 b'{"model": "tiny", "prompt": "x", "temperature": NaN}',
                                 b'{"model": "tiny", "prompt": "x", "top_p": Infinity}'])
def test_malformed_body_is_a_400(backend, raw):
    r = send(make_app(backend), backend, "POST", COMP, content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400)
    assert backend.generate_calls == 0


def test_unknown_model_is_a_404(backend):
    r = send(make_app(backend), backend, "POST", CHAT, json={"model": "gpt-9", "messages": MSGS})
    assert assert_openai_error(r, 404, "model")["code"] == "model_not_found"
    long = send(make_app(backend), backend, "POST", CHAT, json={"model": "m" * 10_000, "messages": MSGS})
    message = assert_openai_error(long, 404, "model")["message"]
    assert len(message) < 300 and "(10000 characters)" in message  # not echoed back whole
    assert backend.generate_calls == 0


def test_served_model_name_replaces_the_backend_name(backend):
    app = make_app(backend, served_model_name="my-model")
    assert send(app, backend, "GET", "/v1/models").json()["data"][0]["id"] == "my-model"
    assert_openai_error(send(app, backend, "POST", COMP, json={"model": "tiny", "prompt": "x"}), 404)
    r = send(app, backend, "POST", COMP, json={"model": "my-model", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "my-model"


@pytest.mark.parametrize("auth", [None, "Bearer wrong", "Basic secret", "secret", "Bearer "])
def test_missing_or_wrong_api_key_is_a_401(backend, auth):
    app = make_app(backend, api_key="secret")
    headers = {} if auth is None else {"Authorization": auth}
    for method, path, kwargs in [("POST", COMP, {"json": {"model": "tiny", "prompt": "x"}}), ("GET", "/v1/models", {})]:
        r = send(app, backend, method, path, headers=headers, **kwargs)
        assert assert_openai_error(r, 401)["type"] == "authentication_error"
    assert backend.generate_calls == 0
    ok = send(app, backend, "POST", COMP, headers={"Authorization": "Bearer secret"},
              json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200 and backend.generate_calls == 1
    assert send(app, backend, "GET", "/health").status_code == 200  # probes need no key


def test_oversize_body_is_a_413_by_header_and_by_bytes_read(backend):
    app = make_app(backend, max_body_bytes=1000)
    big = json.dumps({"model": "tiny", "prompt": "x" * 2000}).encode()
    assert_openai_error(send(app, backend, "POST", COMP, content=big, headers=JSON), 413)

    async def chunked():  # no Content-Length: the limit applies to the bytes actually read
        for i in range(0, len(big), 100):
            yield big[i:i + 100]

    r = send(app, backend, "POST", COMP, content=chunked(), headers=JSON)
    assert "content-length" not in r.request.headers
    assert_openai_error(r, 413)
    assert backend.generate_calls == 0
    small = send(app, backend, "POST", COMP, json={"model": "tiny", "prompt": "x", "max_tokens": 1})
    assert small.status_code == 200


def test_unknown_route_and_wrong_method_are_openai_shaped(backend):
    assert_openai_error(send(make_app(backend), backend, "GET", "/v1/nothing"), 404)
    assert_openai_error(send(make_app(backend), backend, "GET", COMP), 405)


def test_overloaded_backend_is_a_503_with_retry_after(backend):
    backend.fail_with = Overloaded("admission queue full", retry_after_s=3)
    for stream in (False, True):
        r = send(make_app(backend), backend, "POST", COMP, json={"model": "tiny", "prompt": "x", "stream": stream})
        assert_openai_error(r, 503)
        assert r.headers["retry-after"] == "3"


def test_backend_failure_is_a_502_before_streaming_and_in_band_after(backend):
    app = make_app(backend)
    backend.fail_with = BackendError("worker died")
    r = send(app, backend, "POST", COMP, json={"model": "tiny", "prompt": "x"})
    assert "worker died" in assert_openai_error(r, 502)["message"]
    backend.fail_with = None
    backend.fail_stream_after = 2
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 10, "ignore_eos": True}
    assert_openai_error(send(app, backend, "POST", COMP, json=body), 502)
    r = send(app, backend, "POST", COMP, json={**body, "stream": True})
    assert r.status_code == 200
    events = [line[6:] for line in r.text.split("\n\n") if line]
    assert events[-1] == "[DONE]" and len(events) == 4  # two chunks, the error, [DONE]
    err = json.loads(events[-2])["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "backend_error"
    assert backend.aborted, "the failed request must be aborted in the engine"
    metrics = send(app, backend, "GET", "/metrics").text
    assert 'pdserve_errors_total{kind="backend"} 3' in metrics
    assert 'pdserve_requests_total{outcome="failed"} 3' in metrics


@pytest.mark.parametrize("faults", [{"transfer_stall_s": float("nan")}, {"transfer_stall_s": float("inf")},
                                    {"transfer_stall_s": 1e9}, {"transfer_stall_s": True}])
def test_bad_injected_faults_are_400s_and_change_nothing(backend, faults):
    """A NaN stall was a 500 (the reply could not be JSON) and stayed in force; no bound either."""
    app = make_app(backend, admin_api=True, admin_api_key="op")
    r = send(app, backend, "POST", "/admin/faults", content=json.dumps(faults),
             headers={"Content-Type": "application/json", "Authorization": "Bearer op"})
    assert "transfer_stall_s must be a number in [0, 600]" in assert_openai_error(r, 400)["message"]


@pytest.mark.parametrize("faults, message", [
    *[(f, "slow_step_s must be a number in [0, 10]") for f in
      ({"slow_step_s": float("nan")}, {"slow_step_s": -1}, {"slow_step_s": 10.5}, {"slow_step_s": "1"})],
    *[(f, "call_jitter_s must be a number in [0, 5]") for f in
      ({"call_jitter_s": float("nan")}, {"call_jitter_s": -0.1}, {"call_jitter_s": 6}, {"call_jitter_s": True})]])
def test_a_bad_injected_step_delay_or_call_jitter_is_a_400(backend, faults, message):
    app = make_app(backend, admin_api=True, admin_api_key="op")
    r = send(app, backend, "POST", "/admin/faults", content=json.dumps(faults),
             headers={"Content-Type": "application/json", "Authorization": "Bearer op"})
    assert message in assert_openai_error(r, 400)["message"]


def test_only_the_operators_key_opens_admin_routes_and_health_details(backend):
    """A client's key (server.api_key here; tenants' likewise) is not an operator's: /admin/* answers 403 to it
    (a known key, not allowed) and 401 to no key or an unknown one; /health shows pids, hosts and failures only to
    the operator."""
    app = make_app(backend, api_key="client", admin_api=True, admin_api_key="op")
    for headers, status in (({}, 401), ({"Authorization": "Bearer client"}, 403),
                            ({"Authorization": "Bearer op2"}, 401)):
        r = send(app, backend, "GET", "/admin/integrity", headers=headers)
        assert assert_openai_error(r, status)["code"] == ("invalid_api_key" if status == 401 else
                                                          "operator_key_required")
        routes = [("POST", f"/admin/workers/decode-0/{a}") for a in ("kill", "drain", "undrain", "revive", "role")]
        routes += [("POST", "/admin/workers/restart"), ("GET", "/admin/workers/restart"), ("POST", "/admin/faults"),
                   ("GET", "/admin/requests"), ("GET", "/admin/requests/x"), ("GET", "/admin/integrity")]
        for method, path in routes:
            assert send(app, backend, method, path, headers=headers).status_code == status, (method, path)
    # (the operator's own key reaching these routes is every serving suite's: tests/server_process.OPERATOR)
    with pytest.raises(ValueError, match="admin_api needs admin_api_key"):
        ServerSettings(admin_api=True)
    with pytest.raises(ValueError, match="other than api_key"):
        ServerSettings(api_key="same", admin_api_key="same")


def test_health_shows_internals_only_to_the_operator():
    from coordinator.api.admin import health_response

    class Pools:
        def health(self):
            return False, [{"name": "decode-0", "role": "decode", "state": "restarting", "restarts": 2, "pid": 4242,
                            "host": "gpu-7", "last_failure": "ray::Worker died (pid=4242, ip=10.0.0.7)"}]
    public = json.loads(health_response(Pools(), draining=False).body)
    assert public["workers"] == [{"name": "decode-0", "role": "decode", "state": "restarting", "restarts": 2}]
    operator = json.loads(health_response(Pools(), draining=False, operator=True).body)
    assert operator["workers"][0]["pid"] == 4242 and "last_failure" in operator["workers"][0]
