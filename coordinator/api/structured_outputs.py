"""The request fields that constrain the output, and their translation into one engine StructuredSpec.

Owns: `response_format` (OpenAI: text | json_object | json_schema {name, schema, strict}) on both endpoints, vLLM's
`structured_outputs` {json, regex, choice, grammar, json_object} and its older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`; at most one of them may constrain a request (400 naming the second otherwise).
`structured_spec()` compiles the spec once (llguidance, without a vocabulary: milliseconds, bounded by the library's
parser limits) so an invalid schema, regex or grammar is a 400 naming its field before any actor call. Tools that
force a call (coordinator.api.tool_calls) produce their spec the same way. Options vLLM has and this server does not
(`whitespace_pattern`, `structural_tag`, `guided_whitespace_pattern`, `guided_decoding_backend`) are refused.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from coordinator.client_text import describe
from coordinator.errors import invalid_request
from engine.sampling.structured import StructuredSpec, check

MAX_CHOICES = 1024


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_present(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format.json_schema: is required when type is json_schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"response_format.json_schema: only allowed when type is json_schema, not {self.type}")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its current name for the guided_* fields)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, max_length=MAX_CHOICES)
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(BaseModel):
    """Mixed into both request bodies (coordinator.api.protocol)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, max_length=MAX_CHOICES)
    guided_grammar: str | None = None


def _schema(value: dict[str, Any] | str, field: str) -> StructuredSpec:
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as e:
            raise invalid_request(f"{field}: is not valid JSON: {describe(e)}", field) from None
    if not isinstance(value, (dict, bool)):
        raise invalid_request(f"{field}: a JSON schema must be an object", field)
    return StructuredSpec.json_schema(value)


def requested(req: StructuredFields) -> list[tuple[str, StructuredSpec]]:
    """Every constraint the request sets, as (field, spec); checked for count and validity by structured_spec."""
    found: list[tuple[str, StructuredSpec]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", StructuredSpec("json_object")))
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}
        found.append(("response_format.json_schema.schema", _schema(schema, "response_format.json_schema.schema")))
    so = req.structured_outputs
    so_items = [] if so is None else [
        ("structured_outputs.json", so.json_, lambda v: _schema(v, "structured_outputs.json")),
        ("structured_outputs.regex", so.regex, lambda v: StructuredSpec("regex", v)),
        ("structured_outputs.choice", so.choice, StructuredSpec.choice),
        ("structured_outputs.grammar", so.grammar, lambda v: StructuredSpec("grammar", v)),
        ("structured_outputs.json_object", so.json_object or None, lambda v: StructuredSpec("json_object"))]
    guided = [("guided_json", req.guided_json, lambda v: _schema(v, "guided_json")),
              ("guided_regex", req.guided_regex, lambda v: StructuredSpec("regex", v)),
              ("guided_choice", req.guided_choice, StructuredSpec.choice),
              ("guided_grammar", req.guided_grammar, lambda v: StructuredSpec("grammar", v))]
    for field, value, make in [*so_items, *guided]:
        if value is None:
            continue
        if field.endswith("choice") and (not value or any(not c for c in value)):
            raise invalid_request(f"{field}: must be a non-empty list of non-empty strings", field)
        try:
            found.append((field, make(value)))
        except ValueError as e:
            raise invalid_request(f"{field}: {e}", field) from None
    return found


def structured_spec(req: StructuredFields, forced: tuple[str, StructuredSpec] | None = None) -> StructuredSpec | None:
    """The request's one constraint (or `forced`, a tool call the request requires), compiled once: a 400 naming
    the field if it does not compile or if two are set."""
    found = requested(req) + ([forced] if forced is not None else [])
    if len(found) > 1:
        raise invalid_request(f"{found[1][0]}: only one structured output constraint per request (also got "
                              f"{found[0][0]})", found[1][0])
    if not found:
        return None
    field, spec = found[0]
    error = check(spec)
    if error is not None:
        raise invalid_request(f"{field}: invalid: {describe(error)}", field)
    return spec
