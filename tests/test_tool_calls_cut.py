"""Forced tool calls (`tool_choice: required` or a named function) whose output max_tokens cut short: no tool call
(`tool_calls: []`, a list as vLLM's test_max_tokens_with_tool_choice_required reads it, not null) and finish_reason
"length", the generated text as content (it was a 500, or a call with arguments `{`); complete ones still give their
calls."""

from coordinator.api.tool_calls import parse_calls
from coordinator.api.tool_stream import ToolStream, shape_response


def _body(text: str, finish: str) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}]}


def test_a_cut_required_call_is_content_with_finish_length():
    cut = '[{"name": "get_weather", "parameters": {"city": "Os'
    body = shape_response(_body(cut, "length"), "required", "llama3_json", None, True)
    choice = body["choices"][0]
    assert choice["message"]["tool_calls"] == [] and choice["message"]["content"] == cut  # a list, as vLLM's
    assert choice["finish_reason"] == "length"
    whole = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    done = shape_response(_body(whole, "stop"), "required", "llama3_json", None, True)["choices"][0]
    assert done["finish_reason"] == "tool_calls" and done["message"]["content"] is None
    assert done["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_a_named_call_cut_after_one_token_is_no_call():
    choice = shape_response(_body("{", "length"), "named", "llama3_json", "get_weather", True)["choices"][0]
    assert choice["message"]["tool_calls"] == [] and choice["message"]["content"] == "{"
    assert choice["finish_reason"] == "length"
    assert parse_calls("named", "llama3_json", '{"city": "Oslo"}', "get_weather")[1][0].name == "get_weather"


def test_a_streamed_required_call_cut_short_ends_as_content():
    stream = ToolStream("required", "llama3_json", None, True)
    assert stream.feed('[{"name": "get_') == []
    deltas, finish = stream.finish("length")
    assert deltas == [{"content": '[{"name": "get_'}] and finish == "length"
    whole = ToolStream("required", "llama3_json", None, True)
    whole.feed('[{"name": "f", "parameters": {}}]')
    deltas, finish = whole.finish("stop")
    assert finish == "tool_calls" and deltas[0]["tool_calls"][0]["function"]["name"] == "f"
