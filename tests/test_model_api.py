"""/tokenize, /detokenize, /version and /v1/models in vLLM's shapes, on the app with the in-process backend: token
ids equal to what the completion and chat endpoints feed the engine, detokenize inverting tokenize, the same API
key as /v1, OpenAI-shaped 400s naming the field and 404 for another model."""

from importlib import metadata

import httpx
import openai
import pytest

from coordinator.api.app import create_app, load_tokenizer
from coordinator.config.settings import ServerSettings
from engine import LLM
from tests.inprocess_backend import InProcessBackend, ServerThread, run_asgi

pytestmark = pytest.mark.timeout(120)
MAX_LEN = 64
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|eot_id|> there"}]


@pytest.fixture(scope="module")
def engine(checkpoints):
    return LLM(str(checkpoints.tiny()), max_model_len=MAX_LEN).engine


@pytest.fixture
def backend(engine, checkpoints):
    b = InProcessBackend(engine, checkpoints.tiny())
    yield b
    assert b.idle


@pytest.fixture(scope="module")
def tok(checkpoints):
    return load_tokenizer(str(checkpoints.tiny()))


def call(backend, requests: list[tuple[str, str, dict | None]], **settings) -> list[httpx.Response]:
    async def fn(client):
        return [await client.request(method, path, json=body) for method, path, body in requests]
    return run_asgi(create_app(backend, ServerSettings(**settings)), backend, fn)


def error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return err


def test_tokenize_a_prompt_as_the_completion_endpoint_encodes_it_and_detokenize_inverts_it(backend, tok):
    text = "The harbor at dusk, naïve café 🙂"
    tok_r, plain_r, strs_r = call(backend, [
        ("POST", "/tokenize", {"model": "tiny", "prompt": text}),
        ("POST", "/tokenize", {"prompt": text, "add_special_tokens": False}),  # model may be left out
        ("POST", "/tokenize", {"prompt": text, "return_token_strs": True})])
    got = tok_r.json()
    assert got == {"count": len(tok.encode(text)), "max_model_len": MAX_LEN, "tokens": tok.encode(text),
                   "token_strs": None}
    assert plain_r.json()["tokens"] == tok.encode(text, add_special_tokens=False) != got["tokens"]  # BOS or not
    strs = strs_r.json()["token_strs"]
    assert strs == [tok.id_to_token(i) for i in got["tokens"]] and all(isinstance(s, str) and s for s in strs)
    (back,) = call(backend, [("POST", "/detokenize", {"model": "tiny", "tokens": plain_r.json()["tokens"]})])
    assert back.json() == {"prompt": text}
    (with_bos,) = call(backend, [("POST", "/detokenize", {"tokens": got["tokens"]})])
    assert with_bos.json()["prompt"] == tok.decode(got["tokens"], skip_special_tokens=False)  # specials kept


def test_tokenize_messages_gives_the_chat_endpoints_prompt(backend, tok):
    want = tok.encode_chat(MSGS, add_generation_prompt=True)  # special-token text in content stays text
    assert want != tok.encode(tok.apply_chat_template(MSGS), add_special_tokens=False)
    r, no_gen = call(backend, [("POST", "/tokenize", {"model": "tiny", "messages": MSGS}),
                               ("POST", "/tokenize", {"messages": MSGS, "add_generation_prompt": False})])
    assert r.json()["tokens"] == want and r.json()["count"] == len(want)
    assert no_gen.json()["tokens"] == tok.encode_chat(MSGS, add_generation_prompt=False) != want
    # the chat endpoint reports exactly that many prompt tokens
    (chat,) = call(backend, [("POST", "/v1/chat/completions", {"model": "tiny", "messages": MSGS, "max_tokens": 1})])
    assert chat.json()["usage"]["prompt_tokens"] == len(want)


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "x", "add_special_token": True}, 400, "add_special_token"),  # typo: unknown field
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": MSGS}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/tokenize", {"messages": MSGS, "add_special_tokens": True}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": MSGS, "chat_template_kwargs": {"evil": True}}, 400, "chat_template_kwargs"),
    ("/tokenize", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, 400, "skip_special_tokens"),
    ("/detokenize", {"model": "gpt-9", "tokens": [1]}, 404, "model"),
])
def test_bad_input_is_an_openai_error_naming_the_field(backend, path, body, status, param):
    (r,) = call(backend, [("POST", path, body)])
    error(r, status, param)


def test_same_api_key_as_v1_and_version_answers_anyone(backend):
    key = {"Authorization": "Bearer sekret"}

    async def fn(client):
        out = [await client.post(p, json=b) for p, b in (("/tokenize", {"prompt": "x"}),
                                                          ("/detokenize", {"tokens": [1]}))]
        out += [await client.get("/v1/models"), await client.get("/version")]
        out += [await client.post("/tokenize", json={"prompt": "x"}, headers=key), await client.get("/v1/models",
                                                                                                    headers=key)]
        return out
    *refused, version, ok_tok, ok_models = run_asgi(create_app(backend, ServerSettings(api_key="sekret")), backend, fn)
    for r in refused:
        assert r.status_code == 401 and r.json()["error"]["type"], r.text
    assert version.status_code == 200 and version.json() == {"version": metadata.version("pdserve")}
    assert ok_tok.status_code == 200 and ok_models.status_code == 200
    assert backend.generate_calls == 0


def test_models_and_tokenize_through_the_openai_client_on_a_real_http_server(engine, checkpoints):
    backend = InProcessBackend(engine, checkpoints.tiny())
    with ServerThread(create_app(backend, ServerSettings(served_model_name="my-model")), backend) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none")
        (card,) = client.models.list().data
        assert (card.id, card.object, card.owned_by) == ("my-model", "model", "pdserve")
        assert card.model_extra["max_model_len"] == MAX_LEN and card.model_extra["root"] == "tiny"
        r = httpx.post(f"{srv.url}/tokenize", json={"model": "my-model", "prompt": "Hello"}, timeout=10)
        assert r.status_code == 200 and r.json()["max_model_len"] == MAX_LEN
        assert httpx.post(f"{srv.url}/tokenize", json={"model": "tiny", "prompt": "x"}, timeout=10).status_code == 404
