"""`closed_objects`: a JSON schema as generation reads it, where an object holds only the properties its schema names.

JSON Schema lets an object without `additionalProperties` take any other key, and a grammar that allows that lets a
model add keys until max_tokens. vLLM's default backend (xgrammar) reads an absent `additionalProperties` as false
when generating, and so does this server: every object schema that does not set `additionalProperties` (or
`unevaluatedProperties`) gets `additionalProperties: false`, and a name its `required` lists but `properties` does
not is added to `properties` with any value (the schema named it). `true` or a schema there keeps the object open,
and `patternProperties` still admit their keys.

Left as written, because closing them would forbid keys the whole schema allows: an object whose schema meets
others by intersection (a member of `allOf`; a schema with `allOf`, `$ref`, `if`/`then`/`else` or
`dependentSchemas` beside its own keywords; the `anyOf`/`oneOf` members of a schema that names properties itself;
what a `$ref` in any of those positions points to), and everything under `not` and `if` (closing there would change
what they exclude or select). Nested objects below those (a property's own schema) are closed as usual.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

_COMPOSING = ("allOf", "anyOf", "oneOf", "$ref", "then", "else", "dependentSchemas")
_NAMING = ("properties", "required", "patternProperties")
_NAMED_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema, each in its own context
_SINGLE = ("items", "additionalProperties", "contains", "propertyNames", "unevaluatedItems")


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` with its objects closed as the module says (a boolean schema is returned as it is)."""
    if not isinstance(schema, dict):
        return schema
    shared: set[str] = set()
    while True:  # a shared target may itself share what it refers to: until nothing new is found
        found: set[str] = set()
        result = _walk(schema, "#", False, shared, found)
        if found <= shared:
            return result
        shared |= found


def _is_object(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    if kind is None:
        return any(k in node for k in _NAMING)
    return kind == "object" or (isinstance(kind, list) and "object" in kind)


def _pointer(base: str, *keys: str | int) -> str:
    for key in keys:
        base += "/" + str(key).replace("~", "~0").replace("/", "~1")
    return base


def _walk(node: Any, at: str, shared: bool, targets: set[str], found: set[str]) -> Any:
    """`node` (at JSON pointer `at`) with its objects closed; `shared`: it meets other schemas by intersection.
    Collects into `found` the pointers that local `$ref`s in a shared position refer to."""
    if not isinstance(node, dict):
        return node
    shared = shared or at in targets
    names_own = any(k in node for k in _NAMING)
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and (
            shared or names_own or any(k in node for k in _COMPOSING if k != "$ref")):
        found.add(unquote(ref))
    out = dict(node)
    members_shared = shared or names_own or any(k in node for k in ("allOf", "$ref"))
    for key, value in node.items():
        if key in _NAMED_MAPS and isinstance(value, dict):
            out[key] = {k: _walk(v, _pointer(at, key, k), False, targets, found) for k, v in value.items()}
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems", "items") and isinstance(value, list):
            meets = key == "allOf" or (key in ("anyOf", "oneOf") and members_shared)
            out[key] = [_walk(v, _pointer(at, key, i), meets, targets, found) for i, v in enumerate(value)]
        elif key in _SINGLE:
            out[key] = _walk(value, _pointer(at, key), False, targets, found)
        elif key in ("then", "else"):
            out[key] = _walk(value, _pointer(at, key), True, targets, found)
        elif key == "dependentSchemas" and isinstance(value, dict):
            out[key] = {k: _walk(v, _pointer(at, key, k), True, targets, found) for k, v in value.items()}
    if (not shared and _is_object(node) and not any(k in node for k in _COMPOSING)
            and "additionalProperties" not in node and "unevaluatedProperties" not in node):
        props = out.get("properties") if isinstance(out.get("properties"), dict) else {}
        required = node.get("required") if isinstance(node.get("required"), list) else []
        missing = {name: {} for name in required if isinstance(name, str) and name not in props}
        if missing:
            out["properties"] = {**props, **missing}
        out["additionalProperties"] = False
    return out
