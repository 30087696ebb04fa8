"""Units of structured outputs and tools: engine.grammar's masks and matcher life cycle on `tiny`'s tokenizer, the
disaggregated hand-off (a decode engine continuing from a prefill engine's first token), the request fields'
translation and errors, and the tool-call parsers and stream deltas."""

import json
import random

import jsonschema
import pytest
import torch

from coordinator.api.engine_inputs import sampling_params
from coordinator.api.protocol import ChatCompletionRequest, CompletionRequest, parse
from coordinator.api.tool_calls import parse_calls
from coordinator.api.tool_stream import ToolStream
from coordinator.errors import APIError
from engine import LLM, SamplingParams
from engine.sampling.grammar import GrammarManager, apply_bitmask
from engine.sampling.structured import StructuredSpec, check
from tests.json_schemas import random_schema

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny")


def test_apply_bitmask_masks_only_the_given_rows():
    logits = torch.zeros(3, 70)
    mask = torch.zeros(1, 3, dtype=torch.int32)
    mask[0, 0] = 0b101  # tokens 0 and 2
    mask[0, 2] = 1 << 1  # token 65
    apply_bitmask(logits, mask, [1], torch.arange(32, dtype=torch.int32))
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0, 2, 65]
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()


def test_matcher_masks_advance_and_complete(llm):
    tok = llm.engine.tokenizer
    gm = GrammarManager(tok.to_json(), llm.engine.model_config.vocab_size, llm.engine.model_config.eos_token_ids,
                        torch.device("cpu"), 4)
    gm.attach("r", gm.make("r", StructuredSpec.choice(["yes", "no"]), []), 1)
    logits = torch.zeros(1, llm.engine.model_config.vocab_size)

    class Chunk:
        request_id, output_index, incarnation = "r", 0, 1

    before = logits.clone()
    stale = Chunk()
    stale.incarnation = 0  # a chunk of an earlier request of the id: never masked by this one's grammar
    gm.constrain([stale], logits, None)
    assert torch.equal(logits, before)
    gm.constrain([Chunk()], logits, None)
    allowed = {tok.decode([t]) for t in torch.isfinite(logits[0]).nonzero().flatten().tolist()}
    assert allowed and all("yes".startswith(a) or "no".startswith(a) for a in allowed)
    for i, t in enumerate(tok.encode("yes", add_special_tokens=False)):
        assert gm.finish_reason("r") is None
        gm.advance("r", i, t)
        gm.advance("r", i, t)  # the same output index again is a no-op (overlapped and plain paths both call it)
    assert gm.finish_reason("r") == "stop"
    with pytest.raises(ValueError, match="prior outputs"):
        gm.make("s", StructuredSpec.choice(["yes"]), tok.encode("no", add_special_tokens=False))



def test_a_grammar_prepared_at_start_serves_the_first_constrained_request():
    """Grammar machinery built ahead (prepare_grammar; a pool worker builds it on a thread of its own once it is
    routable: tests/test_grammar_loader.py) serves the first constrained request as built, and an unconstrained
    engine keeps no logits hook."""
    engine = LLM("tiny").engine
    assert engine.grammar is None and engine.prepare_grammar()
    built = engine.grammar
    assert engine.runner.logits_hook is None  # nothing constrained yet: steps pay nothing
    params = SamplingParams(max_tokens=8, temperature=0.0, structured=StructuredSpec.choice(["yes", "no"]))
    engine.add_request("r", [1, 2, 3], params)
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    out_text = engine.tokenizer.decode(tokens)
    assert engine.grammar is built and engine.runner.logits_hook is not None
    assert out_text in ("yes", "no")

def test_engine_random_schemas_valid_and_prefill_decode_handoff(llm):
    rng = random.Random(3)
    schemas = [random_schema(rng) for _ in range(12)]
    params = [SamplingParams(seed=i, max_tokens=400, structured=StructuredSpec.json_schema(s))
              for i, s in enumerate(schemas)]
    outs = llm.generate(["Data:"] * len(schemas), params)
    for out, schema in zip(outs, schemas, strict=True):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), schema)
    # a prefill-only engine samples token 0 under the grammar; a second engine resumes from it (as a migrated
    # request does; the KV hand-off itself, add_prefilled_request, runs in tests/test_structured_serving.py)
    decode = LLM("tiny").engine
    eng, p = llm.engine, params[0]
    prompt = llm.tokenizer.encode("Data:")
    eng.add_request("pf", prompt, p, prefill_only=True)
    first = [o for _ in range(4) for o in eng.step() if o.request_id == "pf"][0].new_token_ids[0]
    eng.release("pf")
    decode.add_request("dc", prompt, p, prior_output_ids=[first])
    tokens = [first]
    while decode.has_unfinished():
        for o in decode.step():
            tokens += o.new_token_ids
            finish = o.finish_reason
    assert finish == "stop" and tokens == outs[0].token_ids
    assert decode.grammar.finish_reason("dc") is None  # its matcher was dropped


def test_specs_check_and_request_fields():
    assert check(StructuredSpec.json_schema(SCHEMA)) is None
    assert check(StructuredSpec("regex", "(")) is not None
    assert check(StructuredSpec("grammar", 'root ::= "a" | "b"')) is None  # GBNF, converted to Lark
    body = {"model": "m", "prompt": "x", "guided_choice": ["a", "b"]}
    assert sampling_params(parse(CompletionRequest, body), 4, None).structured == StructuredSpec.choice(["a", "b"])
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    req = parse(ChatCompletionRequest, {**chat, "response_format": {"type": "text"}})
    assert sampling_params(req, 4, None).structured is None
    with pytest.raises(APIError) as e:
        parse(ChatCompletionRequest, {**chat, "tool_choice": "required"})
    assert e.value.param == "tool_choice"
    with pytest.raises(APIError) as e:
        sampling_params(parse(CompletionRequest, {**body, "guided_choice": ["a", ""]}), 4, None)
    assert e.value.param == "guided_choice"


def test_parsers_read_llama3_and_hermes_calls():
    content, calls = parse_calls("auto", "llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; '
                                 '{"name": "g", "parameters": {}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {})]
    assert parse_calls("auto", "llama3_json", "Hello {not json")[1] == []
    text = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": "y"}}\n</tool_call>'
    content, calls = parse_calls("auto", "hermes", text)
    assert content == "Let me check." and calls[0].name == "f" and json.loads(calls[0].arguments) == {"x": "y"}
    assert len(parse_calls("auto", "hermes", text + text, parallel=False)[1]) == 1
    _, calls = parse_calls("required", "hermes", '[{"name": "f", "parameters": {"k": 2}}]')
    assert calls[0].name == "f" and json.loads(calls[0].arguments) == {"k": 2}


def test_hermes_stream_sends_content_then_calls():
    stream = ToolStream("auto", "hermes", None, True)
    deltas = []
    for piece in ["Sure", ". <tool", '_call>{"name": "f", ', '"arguments": {}}</tool_call>']:
        deltas += stream.feed(piece)
    assert "".join(d["content"] for d in deltas) == "Sure. "
    final, reason = stream.finish("stop")
    assert reason == "tool_calls" and final[0]["tool_calls"][0]["function"]["name"] == "f"
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in final) == "{}"
    plain = ToolStream("auto", "llama3_json", None, True)
    assert plain.feed("Hi {") == [{"content": "Hi {"}] and plain.finish("stop") == ([], "stop")
