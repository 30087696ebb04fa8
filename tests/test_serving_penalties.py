"""Penalties, logit_bias, min_tokens, bad_words and the output-text options end to end with the openai client, on
the real server in disaggregated mode (prefill samples the first token, decode the rest: both must apply the
request's parameters and count the first token) and collocated mode: the same tokens and text as the offline
engine, streamed or not, on both endpoints."""

import openai
import pytest

from coordinator.api.sampling_fields import bad_words_token_ids
from engine import LLM, SamplingParams
from tests.server_process import HALF_CPU, running_server, wait_for_idle_workers

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
# the body's extension fields and the SamplingParams they must give
BODY = {"presence_penalty": 1.2, "frequency_penalty": 0.8, "logit_bias": {"42": 8.0, "300": -100},
        "extra_body": {"repetition_penalty": 1.4, "min_tokens": 5, "bad_words": ["the", "hello"]}}


@pytest.fixture(scope="module", params=["disaggregated", "collocated"])
def server(request, tmp_path_factory):
    mode = request.param
    config = {"model": "tiny", "mode": mode, "decode": HALF_CPU}
    if mode == "disaggregated":
        config |= {"prefill": HALF_CPU, "transfer": {"backends": ["ucx"]}}
    with running_server(tmp_path_factory.mktemp(f"penalties_{mode}"), config) as server:
        yield server
        wait_for_idle_workers(server.url)


@pytest.fixture(scope="module")
def reference():
    return LLM("tiny")


def _params(llm: LLM, max_tokens: int, **kw) -> SamplingParams:
    extra = BODY["extra_body"]
    return SamplingParams(max_tokens=max_tokens, presence_penalty=BODY["presence_penalty"],
                          frequency_penalty=BODY["frequency_penalty"], repetition_penalty=extra["repetition_penalty"],
                          logit_bias={int(k): v for k, v in BODY["logit_bias"].items()}, min_tokens=extra["min_tokens"],
                          bad_words_token_ids=bad_words_token_ids(extra["bad_words"], llm.tokenizer, 2048), **kw)


def test_completions_equal_the_engine_streamed_or_not(server, reference):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60)
    for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 7}):
        [want] = reference.generate([PROMPT], _params(reference, 12, **sampling))
        plain = reference.generate([PROMPT], SamplingParams(max_tokens=12, **sampling))[0]
        assert want.token_ids != plain.token_ids  # the parameters matter for this prompt
        got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, **sampling, **BODY)
        assert (got.choices[0].text, got.usage.completion_tokens) == (want.text, len(want.token_ids))
        stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, stream=True, **sampling,
                                           **BODY)
        assert "".join(c.choices[0].text for c in stream if c.choices) == want.text


def test_chat_equals_the_engine_streamed_or_not(server, reference):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60)
    [want] = reference.chat([MESSAGES], _params(reference, 10, temperature=0.7, seed=3))
    got = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0.7, seed=3,
                                         **BODY)
    assert got.choices[0].message.content == want.text
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0.7, seed=3,
                                            stream=True, **BODY)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.text


def test_stop_string_options_and_special_tokens(server, reference):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60)
    eos = reference.engine.model_config.eos_token_ids[0]
    # min_tokens holds the EOS that logit_bias makes certain back for 4 tokens: then EOS, whose text is kept
    held = reference.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, min_tokens=4,
                                                       logit_bias={eos: 100}))[0]
    assert held.token_ids[-1] == eos and len(held.token_ids) == 5
    kept = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                     logit_bias={str(eos): 100},
                                     extra_body={"min_tokens": 4, "skip_special_tokens": False})
    assert kept.choices[0].text == reference.tokenizer.decode(held.token_ids, skip_special_tokens=False)
    assert kept.choices[0].finish_reason == "stop" and kept.choices[0].text != held.text
    text = reference.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    with_stop = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                          extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
                                          stream=True)
    assert "".join(c.choices[0].text for c in with_stop if c.choices) == text[:text.index(stop) + len(stop)]
