"""coordinator.api.reasoning.ReasoningSplit: vLLM's deepseek_r1 and qwen3 splits of an output into reasoning and
content, the same whether the text comes whole or in pieces cut anywhere (a tag split over tokens or chunks), and
the count of reasoning tokens."""

import random

import pytest

from coordinator.api.protocol import ChatCompletionRequest, parse
from coordinator.api.reasoning import ReasoningSplit, for_request, refuse_constraints
from coordinator.errors import APIError

CASES = [  # parser, output, (reasoning or None when no reasoning section, content)
    ("deepseek_r1", "abc</think>xyz", ("abc", "xyz")),
    ("deepseek_r1", "abc</think>", ("abc", "")),
    ("deepseek_r1", "all thinking, cut", ("all thinking, cut", "")),
    ("deepseek_r1", "<think>abc</think>xyz", ("abc", "xyz")),
    ("deepseek_r1", "a</think>b</think>c<think>d", ("a", "b</think>c<think>d")),
    ("deepseek_r1", "a </thin k> b</think", ("a </thin k> b</think", "")),
    ("qwen3", "<think>abc</think>xyz", ("abc", "xyz")),
    ("qwen3", "no thinking at all", (None, "no thinking at all")),
    ("qwen3", "pre<think>abc</think>post", ("abc", "prepost")),
    ("qwen3", "<think>cut short", ("cut short", "")),
    ("qwen3", "<thin", (None, "<thin")),
    ("qwen3", "</think>x", (None, "</think>x")),
]


def run(parser: str, pieces: list[str]) -> tuple[str | None, str]:
    split = ReasoningSplit(parser)
    reasoning, content = [], []
    for p in pieces:
        r, c = split.feed(p)
        reasoning.append(r)
        content.append(c)
    r, c = split.finish()
    return ("".join(reasoning) + r) if split.opened else None, "".join(content) + c


@pytest.mark.parametrize(("parser", "text", "want"), CASES)
def test_whole_and_every_split_agree(parser, text, want):
    assert run(parser, [text]) == want
    assert run(parser, list(text)) == want  # one character at a time: every tag split
    rng = random.Random(len(text))
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 4)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert run(parser, pieces) == want, pieces


def test_held_text_is_released_only_when_it_is_not_a_tag():
    split = ReasoningSplit("deepseek_r1")
    assert split.feed("abc</th") == ("abc", "")  # may be </think>: held
    assert split.feed("ink>x") == ("", "x")
    split = ReasoningSplit("deepseek_r1")
    assert split.feed("abc</th") == ("abc", "")
    assert split.feed("e") == ("</the", "")  # it was not


def test_reasoning_tokens_count_the_tags_and_what_is_between():
    split = ReasoningSplit("qwen3")
    for t in ["Hi", "<think>", "a", "b", "</", "think>", "x", "y"]:
        split.take_token(t)
    assert split.tokens == 5  # <think> a b </ think>
    split = ReasoningSplit("deepseek_r1")
    for t in ["a", "b", "</think>", "x"]:
        split.take_token(t)
    assert split.tokens == 3


def chat(**extra):
    return parse(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "q"}], **extra})


def test_thinking_off_turns_the_split_off():
    assert for_request("qwen3", chat()) is not None
    assert for_request(None, chat()) is None
    assert for_request("deepseek_r1", chat(chat_template_kwargs={"enable_thinking": False})) is None
    assert for_request("deepseek_r1", chat(chat_template_kwargs={"thinking": False})) is None


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_regex": "a+"}, "guided_regex"),
    ({"structured_outputs": {"choice": ["a"]}}, "structured_outputs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tool_choice"),
])
def test_constraints_are_refused_while_reasoning_is_parsed(extra, param):
    with pytest.raises(APIError) as e:
        refuse_constraints("qwen3", chat(**extra))
    assert e.value.status == 400 and e.value.param == param
    refuse_constraints(None, chat(**extra))  # no parser: allowed
    refuse_constraints("qwen3", chat(**extra, chat_template_kwargs={"enable_thinking": False}))  # thinking off
    refuse_constraints("qwen3", chat(response_format={"type": "text"}))
