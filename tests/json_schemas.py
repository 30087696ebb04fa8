"""Seeded random JSON schemas (and instances that satisfy them) for the structured-output tests and benchmark.

Owns: `random_schema(rng)`, a strict schema (objects with `additionalProperties: false` and some required fields,
arrays with item bounds, enums, integers and numbers with bounds, strings with length bounds, booleans, nesting),
and `random_instance(rng, schema)`, one valid value of it (the benchmark feeds its tokens to the matchers).
Every string, array and number is bounded, so a model forced by the schema always reaches the end.
"""

from __future__ import annotations

import random
import string
from typing import Any

_WORDS = ["id", "name", "age", "tags", "score", "items", "kind", "ok", "user", "city", "price", "notes", "level",
          "count", "flag", "meta", "title", "value", "unit", "code"]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema at the top; nested values up to depth 2."""
    if depth == 0:
        return _object(rng, depth)
    kinds = ["string", "integer", "number", "boolean", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "object":
        return _object(rng, depth)
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": lo,
                "maxItems": lo + rng.randint(0, 2)}
    if kind == "string":
        lo = rng.randint(0, 3)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 8)}
    if kind == "integer":
        lo = rng.randint(-100, 100)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if kind == "number":
        return {"type": "number", "minimum": -1000, "maximum": 1000, "multipleOf": 0.25}  # bounds its digits
    if kind == "boolean":
        return {"type": "boolean"}
    values = rng.sample(["red", "green", "blue", "small", "large", "yes", "no"], rng.randint(1, 4))
    return {"enum": values if rng.random() < 0.7 else [*values[:1], rng.randint(0, 9)]}


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(_WORDS, rng.randint(1, 4 if depth else 5))
    props = {n: random_schema(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def random_instance(rng: random.Random, schema: dict[str, Any]) -> Any:
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "object":
        return {k: random_instance(rng, s) for k, s in schema["properties"].items()
                if k in schema["required"] or rng.random() < 0.5}
    if kind == "array":
        return [random_instance(rng, schema["items"])
                for _ in range(rng.randint(schema["minItems"], schema["maxItems"]))]
    if kind == "string":
        n = rng.randint(schema["minLength"], schema["maxLength"])
        return "".join(rng.choice(string.ascii_letters + " ") for _ in range(n))
    if kind == "integer":
        return rng.randint(schema["minimum"], schema["maximum"])
    if kind == "number":
        return rng.randint(-1000, 1000)  # whole: llguidance's multipleOf grammar takes "0.5" but not "0.50"
    return rng.random() < 0.5
