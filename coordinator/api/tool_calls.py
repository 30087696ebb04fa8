"""Tool calls on /v1/chat/completions: the `tools` / `tool_choice` / `parallel_tool_calls` fields, the structured
output that forces a call, and the parsers that turn a model's tool-call text into OpenAI `tool_calls`.

Owns: validation (a named tool_choice must name a tool; tool_choice needs tools), `forced_spec` (`required`: a JSON
array of {"name", "parameters"} objects, one per call, each `parameters` validated by that tool's schema (hoisted
under the combined root's `$defs` with its local `$ref`s rewritten to point there), at most one item when
parallel_tool_calls is false; a named function: its parameters object itself, the text being its
arguments), and `parse_calls`, which reads the finished text by mode: forced modes from their JSON, `auto` with the
parser of the model's chat-template family chosen by `server.tool_call_parser`
(coordinator.config.settings.TOOL_CALL_PARSERS: `llama3_json`, Llama 3.x's
`{"name": ..., "parameters": {...}}` possibly after `<|python_tag|>` and `;`-separated; `hermes`, Qwen 2.5/3 and
Hermes' `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`). Streaming is coordinator.api.tool_stream's.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.sampling.structured import StructuredSpec

_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_TOOLS = 128


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(pattern=_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ToolFields(BaseModel):
    """Mixed into the chat request body (coordinator.api.protocol)."""

    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _tool_choice(self) -> ToolFields:
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice: is only allowed when tools are given")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in {t.function.name for t in self.tools or []}:
                raise ValueError(f"tool_choice: names function {name[:64]!r}, which is not among the tools")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be distinct")
        return self

    @property
    def tool_mode(self) -> str:
        """none | auto | required | named: how the output is read (auto when tools are given without a choice)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (transformers' `tools=`), or None."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


def _params_schema(fn: FunctionDef) -> dict[str, Any]:
    return fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}


def forced_spec(req: ToolFields) -> tuple[str, StructuredSpec] | None:
    """The structured output that forces a valid call (tool_choice required or named), with the field it comes from."""
    mode = req.tool_mode
    if mode == "named":
        fn = next(t.function for t in req.tools if t.function.name == req.tool_choice.function.name)
        return "tool_choice", StructuredSpec.json_schema(_params_schema(fn))
    if mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                               "parameters": {"$ref": f"#/$defs/{t.function.name}"}},
              "required": ["name", "parameters"], "additionalProperties": False} for t in req.tools]
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                             "$defs": {t.function.name: _hoisted(_params_schema(t.function), t.function.name)
                                       for t in req.tools}}
    if req.parallel_tool_calls is False:
        array["maxItems"] = 1
    return "tools", StructuredSpec.json_schema(array)


_DATA_KEYS = frozenset({"const", "enum", "default", "examples"})  # JSON values, not schemas: a "$ref" there is data
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _hoisted(schema: Any, name: str) -> Any:
    """A tool's parameters schema as it reads at `#/$defs/<name>` of the combined `required` schema: every local
    `$ref` (`#`, `#/$defs/...`, `#/definitions/...`, any pointer into the tool's own schema) points into its copy
    there. The tool's `$id` and `$schema` are dropped, so its refs resolve against the combined root.
    (A function name is a safe JSON pointer segment: [a-zA-Z0-9_-].)"""

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
                out[key] = f"#/$defs/{name}{value[1:]}"
            elif key in _NAMED_SCHEMAS and isinstance(value, dict):  # keys are names (a property may be "enum")
                out[key] = {k: walk(v) for k, v in value.items()}
            else:
                out[key] = value if key in _DATA_KEYS else walk(value)
        return out

    hoisted = walk(schema)
    if isinstance(hoisted, dict):
        hoisted = {k: v for k, v in hoisted.items() if k not in ("$id", "$schema")}
    return hoisted


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(name: Any, args: Any) -> ToolCall | None:
    if not isinstance(name, str) or not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")


def parse_calls(mode: str, parser: str, text: str, named: str | None = None,
                parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output. Forced modes give calls when their grammar-made text is complete; a
    text cut short (by max_tokens) is no call but content, as vLLM answers it (finish_reason stays "length").
    `auto` gives the text back as content when it holds no well-formed call."""
    if mode in ("named", "required"):
        try:
            value = json.loads(text)
        except ValueError:
            return text, []
        if mode == "named":
            return (None, [ToolCall(named, text, f"call_{uuid.uuid4().hex[:24]}")]) if isinstance(value, dict) \
                else (text, [])
        items = value if isinstance(value, list) else []
        calls = [_call(c.get("name"), c.get("parameters")) for c in items if isinstance(c, dict)]
        return None, [c for c in calls if c is not None]
    if mode != "auto":
        return text, []
    content, calls = (_hermes if parser == "hermes" else _llama3_json)(text)
    if not calls:
        return text, []
    return content, calls if parallel else calls[:1]


def _llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return text, []
        call = _call(obj.get("name"), obj.get("parameters", obj.get("arguments"))) if isinstance(obj, dict) else None
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\n;":
            pos += 1
    return None, calls


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    calls = []
    for m in _HERMES.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        call = _call(obj.get("name"), obj.get("arguments", obj.get("parameters"))) if isinstance(obj, dict) else None
        if call is not None:
            calls.append(call)
    content = _HERMES.sub("", text).strip()
    return content or None, calls
