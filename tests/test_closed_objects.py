"""Objects a JSON schema constrains are closed unless the schema opens them (vLLM's default backend, xgrammar, treats
an absent `additionalProperties` as false when generating): tool-call arguments and `response_format: json_schema`
outputs of `tiny` with random weights hold only the properties the schema names (they grew gibberish keys until
max_tokens), while `additionalProperties: true` or a schema, and objects that meet in `allOf` or a `$ref` with
siblings, still take the keys their schemas allow."""

import itertools
import json

import llguidance
import pytest

from coordinator.api.engine_inputs import sampling_params
from coordinator.api.protocol import ChatCompletionRequest, parse
from coordinator.api.tool_calls import parse_calls
from engine import LLM
from engine.sampling.structured import StructuredSpec, grammar_text

pytestmark = pytest.mark.timeout(300)

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}}  # no additionalProperties
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
MESSAGES = [{"role": "user", "content": "Weather?"}]
SEEDS = range(8)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny")


def params(seed: int, **fields):
    req = parse(ChatCompletionRequest, {"model": "tiny", "messages": MESSAGES, "seed": seed, **fields})
    return sampling_params(req, 200, None)


def generate(llm, fields: dict) -> list:
    outs = llm.generate(["Weather in"] * len(SEEDS), [params(seed, **fields) for seed in SEEDS])
    assert all(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    return [o.text for o in outs]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_arguments_hold_only_the_named_properties(llm, choice):
    mode = "required" if choice == "required" else "named"
    for text in generate(llm, {"tools": TOOLS, "tool_choice": choice}):
        _, calls = parse_calls(mode, "llama3_json", text, "get_weather")
        assert calls, text
        for call in calls:
            args = json.loads(call.arguments)
            assert set(args) <= {"city"} and args.get("city", "Oslo") in ("Paris", "Oslo"), text


def test_response_format_objects_are_closed_at_every_depth(llm):
    schema = {"type": "object", "properties": {"where": WEATHER, "when": {"type": "object", "properties": {
        "day": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["day"]}}, "required": ["where"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    for text in generate(llm, {"response_format": fmt}):
        value = json.loads(text)
        assert set(value) <= {"where", "when"} and set(value["where"]) <= {"city"}, text
        assert set(value.get("when", {})) <= {"day"}, text


@pytest.fixture(scope="module")
def matcher(llm):
    tok = llm.engine.tokenizer
    lltok = llguidance.LLTokenizer(tok.to_json(), n_vocab=llm.engine.model_config.vocab_size,
                                   eos_token=list(llm.engine.model_config.eos_token_ids))

    def accepts(schema: dict, text: str) -> bool:
        """Whether the schema's grammar takes the JSON text with its top-level keys in some order (the grammar
        fixes one order, which this test does not pin down)."""
        value = json.loads(text)
        orders = itertools.permutations(value.items()) if isinstance(value, dict) else [None]
        for items in orders:
            m = llguidance.LLMatcher(lltok, grammar_text(StructuredSpec.json_schema(schema)))
            text = json.dumps(dict(items) if items is not None else value, separators=(",", ":"))
            if m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting():
                return True
        return False
    return accepts


def test_what_a_schema_opens_or_composes_stays_open(matcher):
    two = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}
    assert matcher(two, '{"a":1,"b":[2]}') and not matcher(two, '{"a":1,"b":2,"c":3}')  # required names are named
    assert matcher({**two, "additionalProperties": True}, '{"a":1,"b":2,"c":3}')
    assert matcher({**two, "additionalProperties": {"type": "integer"}}, '{"a":1,"b":2,"c":3}')
    assert not matcher({**two, "additionalProperties": {"type": "integer"}}, '{"a":1,"b":2,"c":"x"}')
    assert matcher({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, '{"x1":1}')
    assert not matcher({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, '{"y":1}')
    a, b = ({"type": "object", "properties": {k: {"type": "integer"}}} for k in "ab")
    assert matcher({"allOf": [a, b]}, '{"a":1,"b":2}')
    assert matcher({"$ref": "#/$defs/A", "properties": {"b": {"type": "integer"}}, "$defs": {"A": a}}, '{"a":1,"b":2}')
    assert matcher({"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [b]}, '{"a":1,"b":2}')
    either = {"anyOf": [a, b]}
    assert matcher(either, '{"a":1}') and not matcher(either, '{"a":1,"c":2}')
    assert not matcher({"not": {"type": "object", "properties": {"a": {}}}}, '{"a":1}')  # `not` is left as written
    assert matcher({"type": "array", "items": {"$ref": "#/$defs/A"}, "$defs": {"A": a}}, '[{"a":1}]')
    assert not matcher({"type": "array", "items": {"$ref": "#/$defs/A"}, "$defs": {"A": a}}, '[{"a":1,"z":1}]')
