"""The coordinator's side of penalties, logit_bias, min_tokens, bad_words, include_stop_str_in_output and
skip_special_tokens: bodies mapped into SamplingParams, bad values a 400 naming the field (both endpoints, no
backend call), bad words tokenized as vLLM does, and the output text's stop-string and special-token options."""

import httpx
import pytest

from coordinator.api.app import create_app
from coordinator.api.engine_inputs import sampling_params
from coordinator.api.protocol import ChatCompletionRequest, CompletionRequest, parse
from coordinator.api.sampling_fields import bad_words_token_ids
from coordinator.api.text_output import TextOutput
from coordinator.config.settings import ServerSettings
from coordinator.errors import APIError
from engine import LLM
from engine.model.model_config import ModelConfig
from engine.text.tokenizer import Tokenizer
from engine.tiny import resolve_model_path
from tests.inprocess_backend import InProcessBackend, run_asgi

pytestmark = pytest.mark.timeout(60)
COMP, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_folder(resolve_model_path("tiny"))


@pytest.fixture(scope="module")
def engine(checkpoints):
    return LLM(str(checkpoints.tiny()), max_model_len=64).engine


def test_a_body_maps_every_field_into_sampling_params(tokenizer):
    body = {"model": "tiny", "presence_penalty": 0.5, "frequency_penalty": -1, "max_tokens": 9,
            "repetition_penalty": 1.2, "logit_bias": {"17": 5, "3": -100.0}, "min_tokens": 4, "bad_words": ["sea"]}
    for model, extra in ((CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, {"messages": MSGS})):
        p = sampling_params(parse(model, {**body, **extra}), 9, None, tokenizer, 2048)
        assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens) == (0.5, -1, 1.2, 4)
        assert p.logit_bias == ((3, -100.0), (17, 5.0))
        assert [list(w) for w in p.bad_words_token_ids] == bad_words_token_ids(["sea"], tokenizer, 2048)
    plain = sampling_params(parse(CompletionRequest, {"model": "tiny", "prompt": "x"}), 9, None, tokenizer, 2048)
    assert not plain.processes_logits


def test_bad_words_are_tokenized_as_vllm_does(tokenizer):
    [plain, spaced] = bad_words_token_ids(["  hello"], tokenizer, 2048)  # leading spaces stripped first
    assert plain == tokenizer.encode("hello", add_special_tokens=False)
    assert spaced == tokenizer.encode(" hello", add_special_tokens=False) and spaced[0] != plain[0]
    assert bad_words_token_ids(["sea"], tokenizer, 2048) == [[446, 64]]  # " sea" is one token: not a variant
    for word in ["a sea of", "x"]:
        got = bad_words_token_ids([word], tokenizer, 2048)
        plain, spaced = (tokenizer.encode(w, add_special_tokens=False) for w in (word, " " + word))
        assert got == [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])


BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": "high"}, "repetition_penalty"),
    ({"logit_bias": {"2048": 1}}, "logit_bias"),
    ({"logit_bias": {"12": 101}}, "logit_bias"),
    ({"logit_bias": {"12": "1"}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"min_tokens": 9}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"bad_words": [""]}, "bad_words[0]"),
    ({"bad_words": ["ok", " "]}, "bad_words[1]"),
    ({"bad_words": ["word " * 40]}, "bad_words[0]"),
    ({"bad_words": "sea"}, "bad_words"),
    ({"skip_special_tokens": 1}, "skip_special_tokens"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
]


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
@pytest.mark.parametrize("path", [COMP, CHAT])
def test_a_bad_value_is_a_400_naming_the_field_before_any_backend_call(engine, checkpoints, path, extra, param):
    backend = InProcessBackend(engine, checkpoints.tiny())
    body = {"model": "tiny", "max_tokens": 8, **({"prompt": "x"} if path == COMP else {"messages": MSGS}), **extra}

    async def post(client):
        return await client.post(path, json=body)
    r: httpx.Response = run_asgi(create_app(backend, ServerSettings()), backend, post)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert backend.generate_calls == 0


def test_a_non_finite_bias_is_a_400(tokenizer):
    req = parse(CompletionRequest, {"model": "tiny", "prompt": "x", "logit_bias": {"5": float("inf")}})
    with pytest.raises(APIError) as e:
        sampling_params(req, 4, None, tokenizer, 2048)
    assert e.value.param == "logit_bias"


def _feed(text: TextOutput, ids: list[int]) -> str:
    out = "".join(text.add_token(t) for t in ids if not text.stopped)
    return out + text.finish()


def test_stop_strings_with_and_without_the_stop_string_and_after_min_tokens(tokenizer):
    ids = tokenizer.encode("one two three two one", add_special_tokens=False)
    assert _feed(TextOutput(tokenizer, [1], ["two"]), ids) == "one "
    assert _feed(TextOutput(tokenizer, [1], ["two"], include_stop_str_in_output=True), ids) == "one two"
    upto_two = len(tokenizer.encode("one two", add_special_tokens=False))
    late = TextOutput(tokenizer, [1], ["two"], min_tokens=upto_two)  # the first "two" comes within min_tokens
    assert _feed(late, ids) == "one two three " and late.stopped


def test_special_tokens_are_kept_when_asked(tokenizer):
    eos = ModelConfig.from_folder(resolve_model_path("tiny")).eos_token_ids[0]
    ids = tokenizer.encode("hi", add_special_tokens=False) + [eos]
    assert _feed(TextOutput(tokenizer, [1], ()), ids) == "hi"
    kept = _feed(TextOutput(tokenizer, [1], (), skip_special_tokens=False), ids)
    assert kept == tokenizer.decode(ids, skip_special_tokens=False) != "hi"
