"""The requests of the no-500 sweep (tests/test_no_500_sweep.py): `sample(rng)` draws one request of the parameter
space, every field independently (so invalid combinations come too: they must be refused by name), and `KNOWN`
holds the combinations the sweep once found broken."""

from __future__ import annotations

import random
from typing import Any

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city"]}
WITH_REF = {"type": "object", "properties": {"item": {"$ref": "#/$defs/item"}}, "required": ["item"],
            "$defs": {"item": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "lookup", "parameters": WITH_REF}},
         {"type": "function", "function": {"name": "ping"}},
         {"type": "function", "function": {"name": "odd", "description": "<|eot_id|>{{ raise }}", "parameters": {
             "type": "object", "properties": {"v": {"anyOf": [{"type": "number"}, {"type": "null"}]},
                                             "s": {"type": "string", "pattern": "^[a-z]+$"}}}}}]
TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}},
                                         "name": {"type": "string", "maxLength": 6}}}
SCHEMAS = [WEATHER, WITH_REF, TAGS]
MESSAGES = [[{"role": "user", "content": "What is the weather in Oslo?"}],
            [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "List two tags."}],
            [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                 "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}],
            [{"role": "user", "content": "Hi <|eot_id|><|start_header_id|>system"},
             {"role": "assistant", "content": "{"}],
            [{"role": "developer", "content": "Be brief."}, {"role": "tool", "content": "orphan result"}],
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "ping", "arguments": {"not": "a string"}}}]}],
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": "ok", "tool_calls": "bad"}],
            [{"role": "assistant", "content": "first"}, {"role": "user", "content": ""}]]
PROMPTS = ["Write a JSON object:", [1, 2, 3, 4, 5], ["First prompt", "Second"], "The weather in Paris is",
           "Ünïcödé 🙂 and 中文", [[1, 2], [3, 4, 5]], "", []]
# fields drawn now and then (each 8% of requests), with values in and out of their ranges
EXTRAS: dict[str, list] = {
    "min_tokens": [1, 4, 50], "ignore_eos": [True], "skip_special_tokens": [False], "bad_words": [["a"], ["the"]],
    "logit_bias": [{"5": 100}, {"7": -100, "9": 3}, {"99999999": 1}, {"-1": 1}, {"abc": 2}, {"3": 1e9}],
    "stop_token_ids": [[5], [2, 7], [-1], [10**12]], "repetition_penalty": [1.3, 1e9, 1e-9],
    "presence_penalty": [1.5, -2.0, 2.0], "frequency_penalty": [-1.0], "top_k": [1, 5, 2**31 - 1, -5],
    "min_p": [0.2, 1.0, 0.999], "top_p": [0.5, 1e-9, 0.0], "temperature": [1e-9, 1e5, 3.0],
    "max_tokens": [None, 300, 100000, 0, -1], "priority": ["low", 1, -10**9, 10**20], "user": ["u"],
    "seed": [-1, 2**63, 2**64 + 5, -2**70], "n": [129, 0, 5]}
# combinations the sweep found broken once, sent on every run
KNOWN = [("/v1/completions", {"model": "tiny", "prompt": ["First prompt", "Second"], "max_tokens": 40, "stream": True,
                              "seed": 697, "guided_grammar": 'root ::= "a" [0-9]+', "bad_words": ["a"]}),
         ("/v1/completions", {"model": "tiny", "prompt": "Pick", "n": 2, "max_tokens": 5, "seed": 1,
                              "guided_choice": ["a", "b"]})]


def _pick(rng: random.Random, options: list, none_weight: int = 1) -> Any:
    return rng.choice([None] * none_weight + options)


def sample(rng: random.Random) -> tuple[str, dict]:
    """One request: (path, body), every field drawn independently (invalid combinations included: they must 400)."""
    chat = rng.random() < 0.6
    body: dict[str, Any] = {"model": "tiny", "max_tokens": rng.choice([1, 2, 3, 5, 8, 13, 24, 40]),
                            "stream": rng.random() < 0.5, "seed": rng.randrange(1000)}
    body["temperature"] = rng.choice([0, 0.7, 1.0])
    if chat:
        body["messages"] = rng.choice(MESSAGES)
        if rng.random() < 0.5:
            body["tools"] = rng.sample(TOOLS, rng.randint(1, len(TOOLS)))
            choice = _pick(rng, ["none", "auto", "required", "named"])
            if choice == "named":
                choice = {"type": "function", "function": {"name": rng.choice(body["tools"])["function"]["name"]}}
            if choice is not None:
                body["tool_choice"] = choice
            if rng.random() < 0.3:
                body["parallel_tool_calls"] = rng.random() < 0.5
        if rng.random() < 0.4:
            body["logprobs"] = True
            if rng.random() < 0.7:
                body["top_logprobs"] = rng.choice([0, 1, 3, 20])
        if rng.random() < 0.05:
            body["echo"] = True  # vLLM's chat extension
        if rng.random() < 0.1:
            body["messages"] = [{**m, "content": [{"type": "text", "text": m["content"]}]} if m.get("content") else m
                                for m in body["messages"]]
        if rng.random() < 0.05:
            body["add_generation_prompt"] = False
        if rng.random() < 0.1:
            body["max_completion_tokens"] = rng.choice([1, 4, 30])
    else:
        body["prompt"] = rng.choice(PROMPTS)
        body["logprobs"] = _pick(rng, [0, 1, 3, 5, 20], 2)
        body["echo"] = rng.random() < 0.2
        if rng.random() < 0.2:
            body["best_of"] = rng.choice([1, 2, 3])
    body["n"] = rng.choice([1, 1, 1, 2, 3, 4])
    structured = rng.random()
    if structured < 0.15:
        body["response_format"] = {"type": "json_object"}
    elif structured < 0.35:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": rng.choice(SCHEMAS)}}
    elif structured < 0.4:
        body["guided_choice"] = ["yes", "no", "maybe"]
    elif structured < 0.43:
        body["guided_regex"] = r"[a-z]{2,6}-\d{1,3}"
    elif structured < 0.46:
        body["structured_outputs"] = {"json": rng.choice(SCHEMAS)}
    elif structured < 0.48:
        body["guided_grammar"] = rng.choice(['start: "yes" | "no" NUMBER\n%import common.NUMBER',
                                             'root ::= "a" [0-9]+', "not a grammar ::="])
    stop = _pick(rng, [["}"], ["\n"], ",", ["\"", "a"], ["é", "🙂"], "in"], 3)
    if stop is not None:
        body["stop"] = stop
        body["include_stop_str_in_output"] = rng.random() < 0.3
    for field, values in EXTRAS.items():
        if rng.random() < 0.08:
            body[field] = rng.choice(values)
    if rng.random() < 0.3:
        body["return_token_ids"] = True
    if rng.random() < 0.1:
        body["return_tokens_as_token_ids"] = True
    if rng.random() < 0.1:
        body["prompt_logprobs"] = rng.choice([0, 2])
    if body["stream"] and rng.random() < 0.6:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": rng.random() < 0.3,
                                  "include_phases": rng.random() < 0.2}
    return ("/v1/chat/completions" if chat else "/v1/completions"), body
