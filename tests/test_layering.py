"""The house's dependency directions (docs/architecture.md), read off the source: no import
circles anywhere in specd or specd_lsp, and each room of the engine imports only rooms below it.
Every import counts, also those inside functions (a lazy import is still a dependency)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"specd": ROOT / "specd", "specd_lsp": ROOT / "lsp" / "specd_lsp"}

# Inside specd.engine, from the top down: a room may import the rooms after it, never before.
ENGINE_ROOMS = ["loading", "engine", "remote", "front", "speculation", "caches", "forward"]
# Foundations any room may import.
ENGINE_FOUNDATIONS = {"types", "options", "models", "compat", "lookup", "builtin"}
# What the engine, a plain library, never reaches.
OUTSIDE_THE_ENGINE = ("specd.daemon", "specd.protocol", "specd.cli", "specd.client", "specd_lsp", "specd.bench")


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The project modules ``name`` imports (``from pkg import mod`` names the module ``mod``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        out.update(t for t in targets if t in MODULES and t != name)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in GRAPH[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles():
    assert _cycles() == []


def test_the_cycle_finder_finds_a_circle(monkeypatch):
    """The check above can fail: two modules that import each other are found."""
    monkeypatch.setitem(GRAPH, "specd.engine.types", GRAPH["specd.engine.types"] | {"specd.engine.engine"})
    assert any("specd.engine.types" in cycle and "specd.engine.engine" in cycle for cycle in _cycles())


def _room(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["specd", "engine"] else None


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _room(n)))
def test_engine_rooms_import_only_downward(name):
    room = _room(name)
    for target in GRAPH[name]:
        assert not target.startswith(OUTSIDE_THE_ENGINE), f"{name} imports {target}"
        other = _room(target)
        if other is None or other == room or other in ENGINE_FOUNDATIONS:
            continue
        if room in ENGINE_FOUNDATIONS:
            pytest.fail(f"the foundation {name} imports the room {target}")
        assert ENGINE_ROOMS.index(other) > ENGINE_ROOMS.index(room), f"{name} imports upward: {target}"


def test_the_protocol_knows_nothing_of_the_engine():
    for name in (n for n in MODULES if n.startswith("specd.protocol")):
        assert not any(t.startswith(("specd.engine", "specd.daemon")) for t in GRAPH[name]), name


def test_the_suggestion_rules_import_only_the_standard_library():
    """specd.suggestion_rules is shared by the engine, the daemon and specd-lsp, so it imports
    nothing of specd and nothing any of them could not load."""
    name = "specd.suggestion_rules"
    assert GRAPH[name] == set()
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert {module.partition(".")[0] for module in imported} <= set(sys.stdlib_module_names)
