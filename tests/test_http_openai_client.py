"""The official `openai` Python client against the real server (uvicorn, in-process engine, API key on): completions
and chat, streamed and not, give the engine's greedy output; its errors map to the client's exception types."""

import openai
import pytest

from coordinator.api.app import create_app
from coordinator.config.settings import ServerSettings
from engine import LLM, SamplingParams
from tests.inprocess_backend import InProcessBackend, ServerThread

pytestmark = pytest.mark.timeout(60)
MESSAGES = [{"role": "user", "content": "Tell me about the harbor"}]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
EXTRA = {"ignore_eos": True}


@pytest.fixture(scope="module")
def ref(checkpoints):
    return LLM(str(checkpoints.tiny()), max_model_len=64)


@pytest.fixture(scope="module")
def server(checkpoints):
    backend = InProcessBackend(LLM(str(checkpoints.tiny()), max_model_len=64).engine, checkpoints.tiny())
    with ServerThread(create_app(backend, ServerSettings(api_key="sk-test")), backend) as srv:
        yield srv
    assert backend.idle


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0, timeout=30) as c:
        yield c


def test_models(client):
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_completions_stream_and_not(client, ref):
    [exp] = ref.generate(["Winter arrived quietly."], GREEDY)
    out = client.completions.create(model="tiny", prompt="Winter arrived quietly.", max_tokens=12, temperature=0,
                                    extra_body=EXTRA)
    assert out.choices[0].text == exp.text and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens == len(exp.prompt_token_ids)
    chunks = list(client.completions.create(model="tiny", prompt="Winter arrived quietly.", max_tokens=12,
                                            temperature=0, stream=True, extra_body=EXTRA))
    assert "".join(c.choices[0].text for c in chunks) == exp.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_stream_and_not(client, ref):
    [exp] = ref.chat([MESSAGES], GREEDY)
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                         extra_body=EXTRA)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == exp.text
    assert out.usage.prompt_tokens == len(exp.prompt_token_ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=12,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 logprobs=True, top_logprobs=2, extra_body=EXTRA))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == exp.text
    assert sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs) == 12
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_client_errors(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", temperature=-1)
    assert e.value.status_code == 400 and "temperature" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0, timeout=30) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
