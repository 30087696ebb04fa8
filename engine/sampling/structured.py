"""StructuredSpec: what a request's output must match (JSON schema, any JSON object, regex, one of some choices, a
grammar), as a small frozen torch-free value that travels in SamplingParams from the coordinator to every worker.

Owns the translation of a spec into llguidance's grammar text (`grammar_text`) and its validation without a
tokenizer (`check`, used by the coordinator to answer 400 before any actor call). The library is imported lazily,
so importing this module needs neither torch nor llguidance. Compiling against a vocabulary, the matchers and the
masks are engine.grammar's.

JSON output is compact (`,` and `:` separators, no free whitespace): a model cannot spin on whitespace, and a
schema's own `x-guidance` options may still override that. Objects hold only the properties their schema names
unless it opens them (`additionalProperties` absent reads as false, as vLLM's default backend generates:
engine.sampling.json_schema), so a model cannot add keys until max_tokens either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from engine.sampling.json_schema import closed_objects

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
MAX_SPEC_CHARS = 1 << 20  # a spec larger than this is refused before compiling


@dataclass(frozen=True)
class StructuredSpec:
    """`value` by kind: json_schema: the schema as JSON text; json_object: ""; regex: the pattern (the whole output
    must match it); choice: a JSON list of the allowed strings; grammar: Lark, or GBNF (llguidance converts it)."""

    kind: Kind
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"StructuredSpec.kind must be one of {list(KINDS)}, got {self.kind!r}")
        if not isinstance(self.value, str) or len(self.value) > MAX_SPEC_CHARS:
            raise ValueError(f"StructuredSpec.value must be a string of at most {MAX_SPEC_CHARS} characters")

    @classmethod
    def json_schema(cls, schema: dict | bool) -> StructuredSpec:
        """The spec of a JSON schema, its objects closed (engine.sampling.json_schema.closed_objects)."""
        return cls("json_schema", json.dumps(closed_objects(schema), sort_keys=True, separators=(",", ":")))

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredSpec:
        return cls("choice", json.dumps(list(choices), separators=(",", ":")))

    @property
    def key(self) -> tuple[str, str]:
        """Equal specs compile to the same grammar: the engine's cache key."""
        return (self.kind, self.value)


def grammar_text(spec: StructuredSpec) -> str:
    """llguidance's grammar for the spec (not yet checked: see `check`)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if spec.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_OPTIONS)
    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        choices = json.loads(spec.value)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choices must be a non-empty list of non-empty strings")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    return LLMatcher.grammar_from_lark(any_to_lark(spec.value))


def check(spec: StructuredSpec) -> str | None:
    """None when the spec compiles, else the compiler's message (schema, regex or grammar errors)."""
    try:
        from llguidance import LLMatcher

        error = LLMatcher.validate_grammar(grammar_text(spec))
    except RecursionError:
        return "nested too deeply"
    except Exception as e:  # noqa: BLE001 - the library's parse errors are the client's input problems
        return str(e) or f"does not compile ({type(e).__name__})"
    return error or None
