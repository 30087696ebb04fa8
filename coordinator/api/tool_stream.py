"""Tool calls in chat responses, whole and streamed, as OpenAI shapes them.

Owns: `shape_response` (a chat.completion body's message gets `tool_calls` and content null, finish_reason
"tool_calls"; a forced call cut short by max_tokens, `tool_calls: []`) and `ToolStream`, which turns a chat
stream's text pieces into chunk deltas: each call's first delta carries its `index`, `id`, `type` and
`function.name` with empty arguments, the following ones `function.arguments` fragments. A named tool_choice streams
its arguments as they are generated; `required` and a parsed `auto` call are sent once the text is complete (their
JSON names the function only mid-way). In `auto`, text that cannot begin a call streams as content at once; text
that might (Llama 3 JSON: output starting with `{` or `<|python_tag|>`; Hermes: from `<tool_call>` on) is held back
until the end and sent as calls, or as content if it holds none.
"""

from __future__ import annotations

import uuid
from typing import Any

from coordinator.api.reasoning import FIELDS as REASONING_FIELDS
from coordinator.api.tool_calls import ToolCall, parse_calls

ARGUMENT_FRAGMENT_CHARS = 64
_HERMES_TAG = "<tool_call>"


def tool_stream_for(req: Any, parser: str) -> ToolStream | None:
    """How a chat request's text becomes tool calls, one ToolStream per choice; None when it uses no tools."""
    if req.tool_mode == "none":
        return None
    named = req.tool_choice.function.name if req.tool_mode == "named" else None
    return ToolStream(req.tool_mode, parser, named, req.parallel_tool_calls is not False)


def shape_response(body: dict[str, Any], mode: str, parser: str, named: str | None, parallel: bool) -> dict:
    """Rewrite a chat.completion body's single choice for the request's tool mode (in place; returned)."""
    shape_choice(body["choices"][0], mode, parser, named, parallel)
    return body


def shape_choice(choice: dict[str, Any], mode: str, parser: str, named: str | None, parallel: bool) -> dict:
    """Rewrite one choice of a chat.completion body (its message and finish_reason) for the tool mode, in place.
    A forced call (`required` or named) always answers a `tool_calls` list: empty when max_tokens cut it short
    (finish_reason "length", the text as content), as vLLM's test_max_tokens_with_tool_choice_required reads it."""
    forced = mode in ("required", "named")
    if choice["message"]["content"] is None:  # all reasoning (coordinator.api.reasoning): no call to read
        if forced:
            choice["message"]["tool_calls"] = []
        return choice
    content, calls = parse_calls(mode, parser, choice["message"]["content"], named, parallel)
    choice["message"]["content"] = content
    if calls or forced:
        choice["message"]["tool_calls"] = [c.as_dict() for c in calls]
    if calls and choice["finish_reason"] == "stop" and mode != "named":
        choice["finish_reason"] = "tool_calls"
    return choice


class ToolStream:
    def __init__(self, mode: str, parser: str, named: str | None, parallel: bool) -> None:
        self.mode, self.parser, self.named, self.parallel = mode, parser, named, parallel
        self.text = ""   # everything generated so far
        self.sent = 0    # characters of it already sent as content (auto) or as arguments (named)
        self.held = False  # auto: a call may have started; the rest waits for the end
        self.started = False  # named: the call's first delta went out
        self.named_id = f"call_{uuid.uuid4().hex[:24]}"

    def feed(self, piece: str) -> list[dict[str, Any]]:
        """Deltas for a new text piece (possibly none)."""
        self.text += piece
        if self.mode == "named":
            head = [] if self.started else [self._header(0, ToolCall(self.named, "", self.named_id))]
            self.started = True
            new, self.sent = self.text[self.sent:], len(self.text)
            return head + ([self._args(0, new)] if new else [])
        if self.mode != "auto" or self.held:
            return []
        upto = self._safe_end()
        new, self.sent = self.text[self.sent:upto], max(self.sent, upto)
        return [{"content": new}] if new else []

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The last deltas and the finish reason to send with them."""
        if self.mode == "named":
            return self.feed(""), finish_reason
        if self.mode == "auto":
            _, calls = parse_calls("auto", self.parser, self.text[self.sent:], None, self.parallel)
            if not calls:
                rest, self.sent = self.text[self.sent:], len(self.text)
                return ([{"content": rest}] if rest else []), finish_reason
        else:
            content, calls = parse_calls(self.mode, self.parser, self.text, None, self.parallel)
            if not calls:  # `required` cut short: what was generated goes out as content (nothing was sent yet)
                return ([{"content": content}] if content else []), finish_reason
        deltas = []
        for i, call in enumerate(calls):
            deltas.append(self._header(i, call))
            args = call.arguments
            deltas += [self._args(i, args[j:j + ARGUMENT_FRAGMENT_CHARS])
                       for j in range(0, len(args), ARGUMENT_FRAGMENT_CHARS)]
        return deltas, ("tool_calls" if calls and finish_reason == "stop" else finish_reason)

    def _safe_end(self) -> int:
        """auto: how much of the text may go out as content now (sets `held` once a call may have begun)."""
        if self.parser == "hermes":
            at = self.text.find(_HERMES_TAG, self.sent)
            if at >= 0:
                self.held = True
                return at
            for k in range(len(_HERMES_TAG) - 1, 0, -1):  # a tail that may grow into the tag stays back
                if self.text.endswith(_HERMES_TAG[:k]):
                    return len(self.text) - k
            return len(self.text)
        stripped = self.text.lstrip()
        if not stripped:
            return self.sent
        if self.sent == 0 and (stripped.startswith("{") or stripped.startswith("<")):
            self.held = True  # `<` may be <|python_tag|>: decided at the end
            return 0
        return len(self.text)

    @staticmethod
    def _header(index: int, call: ToolCall) -> dict[str, Any]:
        return {"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": ""}}]}

    @staticmethod
    def _args(index: int, fragment: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}


def tool_chunks(base: dict[str, Any], tools: ToolStream, text: str, finish_reason: str | None,
                first: bool) -> list[dict[str, Any]]:
    """The stream chunks for one piece, from `base` (the Formatter's chunk for it): one per delta, the role (and
    return_token_ids' prompt_token_ids) on the first chunk of the stream, the finish reason (and the piece's logprobs
    and token_ids: [] before) on the last one; a piece whose text is held back still sends its logprobs and ids."""
    deltas = tools.feed(text)
    if finish_reason is not None:
        more, finish_reason = tools.finish(finish_reason)
        deltas += more
    own = base["choices"][0]
    thought = {k: v for k, v in own["delta"].items() if k in REASONING_FIELDS}  # the piece's reasoning, if any
    if not deltas and (first or finish_reason is not None or own.get("logprobs") or own.get("token_ids") or thought):
        deltas = [{}]
    if thought:
        deltas[0] = thought | deltas[0]
    chunks = []
    for i, delta in enumerate(deltas):
        last = i == len(deltas) - 1
        choice = {**own, "delta": ({"role": "assistant"} if first and i == 0 else {}) | delta,
                  "finish_reason": finish_reason if last else None}
        if not last:
            choice["logprobs"] = None
            if "token_ids" in choice:
                choice["token_ids"] = []
        chunk = {**base, "choices": [choice]}
        if i > 0:
            chunk.pop("prompt_token_ids", None)
        chunks.append(chunk)
    return chunks
