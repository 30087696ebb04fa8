"""The import structure of the product packages: no import cycle anywhere (every import counts: module level,
inside functions, under TYPE_CHECKING), the packages' dependency rule (coordinator -> pool_worker -> prefill_pool,
decode_pool ->
kvtransfer -> engine), and inside the coordinator the stages' rule stated in coordinator/__init__.py. A small AST
walk."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "kvtransfer", "prefill_pool", "decode_pool", "pool_worker", "coordinator", "benchclient")
# which top-level packages each may import
ALLOWED_TOP = {
    "engine": set(),
    "kvtransfer": {"engine"},
    "prefill_pool": {"kvtransfer", "engine"},
    "decode_pool": {"kvtransfer", "engine"},
    "pool_worker": {"prefill_pool", "decode_pool", "kvtransfer", "engine"},
    "coordinator": {"pool_worker", "prefill_pool", "decode_pool", "kvtransfer", "engine"},
    "benchclient": {"coordinator", "engine"},
}
# inside the coordinator: which of its parts each part may import (coordinator/__init__.py)
ALLOWED_PARTS = {
    "config": set(),
    "observability": {"config"},
    "client_text": set(),
    "errors": {"client_text"},
    "contract": {"observability", "config"},
    "admission": {"contract", "errors", "observability", "config"},
    "backend": {"admission", "contract", "errors", "observability", "config"},
    "api": {"admission", "contract", "errors", "client_text", "observability", "config"},
    "frontends": {"api", "admission", "contract", "errors", "observability", "config"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports, resolved to the most specific module that exists."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_packages_import_only_downwards():
    wrong = [(a, b) for a, targets in _graph().items() for b in targets
             if b.split(".")[0] != a.split(".")[0] and b.split(".")[0] not in ALLOWED_TOP[a.split(".")[0]]
             and not (a == "coordinator.cli" and b.split(".")[0] == "benchclient")]  # `pdserve bench`, `sweep`
    assert wrong == []


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "coordinator" and len(parts) > 1 else None


def test_coordinator_stages_import_only_what_their_rule_allows():
    wrong = []
    for a, targets in _graph().items():
        pa = _part(a)
        if pa is None or pa not in ALLOWED_PARTS:  # cli and serve (the top) may import any part
            continue
        for b in targets:
            pb = _part(b)
            if pb is not None and pb != pa and pb not in ALLOWED_PARTS[pa]:
                wrong.append((a, b))
    assert wrong == []


def test_the_walk_sees_cycles():
    """The check itself: a cycle made up here is found."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_environment_setting_is_listed_in_serve_help():
    """A setting read from the environment that no config holds is at least named in `pdserve serve --help`."""
    import re

    from coordinator.cli import ENVIRONMENT

    found = set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            found |= set(re.findall(r'"((?:PDSERVE|KVTRANSFER)_[A-Z_]+)"', path.read_text(encoding="utf-8")))
    assert found and {name for name in found if name not in ENVIRONMENT} == set()
