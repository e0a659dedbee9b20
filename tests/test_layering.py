"""The house's dependency directions (docs/architecture.md), read off the source: no import
circles anywhere in specd or specd_lsp; each room of the engine imports only rooms below it, and
the front no model machinery; the engine, the daemon, the bench and the protocol import only
what the doc's code map lets them. Every import counts, also those inside functions (a lazy
import is still a dependency); where the doc says a module loads without torch, a fresh
interpreter checks it. specd-lsp's rules are in test_lsp_layering.py."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"specd": ROOT / "specd", "specd_lsp": ROOT / "lsp" / "specd_lsp"}

# Inside specd.engine, from the top down: a room may import the rooms after it, never before.
ENGINE_ROOMS = ["loading", "engine", "completion", "idle", "resident", "remote", "front", "speculation", "head_state",
                "caches", "forward"]
# Foundations any room may import.
ENGINE_FOUNDATIONS = {"types", "options", "models", "compat", "lookup", "builtin", "cold_start", "feature_head"}
# What the engine, a plain library, never reaches.
OUTSIDE_THE_ENGINE = ("specd.daemon", "specd.protocol", "specd.cli", "specd.client", "specd_lsp", "specd.bench")
# What of specd outside itself the engine may import.
ENGINE_MAY_IMPORT = ("specd.engine", "specd.llamacpp", "specd.suggestion_rules", "specd.options_table", "specd.demo")
# The rooms and foundations that run models: the front knows tokenizers and text, never these.
MODEL_MACHINERY = {"speculation", "head_state", "caches", "forward", "models", "compat", "feature_head"}
# What of specd the daemon may import; of the engine only its torch-free types, and its loader
# lazily (inside a function: the worker thread calls it, after the loop has started).
DAEMON_MAY_IMPORT = ("specd.daemon", "specd.protocol", "specd.config", "specd.logs", "specd.client",
                     "specd.systemd_units", "specd.suggestion_rules", "specd.options_table", "specd.engine.types")
DAEMON_LAZY_ONLY = ("specd.engine.loading",)
# What of specd the draft trainer (``specd train-draft``) may import: the engine as a library,
# llama.cpp's files, the demo trainer's schedule, the logs; never the daemon, the wire or the bench.
DISTILL_MAY_IMPORT = ("specd.distill", "specd.engine", "specd.llamacpp", "specd.demo", "specd.logs")
HEAVY = ("torch", "transformers", "numpy", "tokenizers", "llama_cpp")
# A class longer than this many lines says in its docstring what its one concern is: the
# docstring begins "One concern:" (docs/architecture.md).
CLASS_LINES_WITHOUT_A_CONCERN = 300
CONCERN_MARK = "One concern:"


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


def _import_nodes(name: str, path: Path) -> list[tuple[str, bool]]:
    """Every import in ``name``'s source: (the module, whether the import is inside a function).
    A project module is named as in ``MODULES`` (``from pkg import mod`` names the module
    ``mod``); anything else by its absolute dotted name."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    in_function = {id(inner) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for inner in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        out.extend((target, id(node) in in_function) for target in targets if target != name)
    return out


NODES = {name: _import_nodes(name, path) for name, path in MODULES.items()}


def _imports(name: str) -> set[str]:
    """The project modules ``name`` imports."""
    return {target for target, _lazy in NODES[name] if target in MODULES}


def _outside_imports(name: str) -> set[str]:
    """The top-level names of what ``name`` imports from outside the project."""
    return {target.partition(".")[0] for target, _lazy in NODES[name]
            if target not in MODULES and not target.startswith(("specd.", "specd_lsp."))} - {"specd", "specd_lsp"}


def _loads(module: str) -> list[str]:
    """The heavy libraries and the specd.engine modules that importing ``module`` loads, in a
    fresh interpreter."""
    code = (f"import json, sys, {module}; "
            f"print(json.dumps(sorted(m for m in sys.modules if m in {HEAVY!r})"
            f" + sorted(m for m in sys.modules if m.startswith('specd.engine'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout)


GRAPH = {name: _imports(name) for name in MODULES}


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


def test_the_engine_imports_only_what_the_map_allows():
    for name in (n for n in MODULES if n.startswith("specd.engine")):
        for target in GRAPH[name]:
            assert target.startswith(ENGINE_MAY_IMPORT), f"{name} imports {target}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _room(n) == "front"))
def test_the_front_knows_no_models(name):
    """The front knows tokenizers and text: it never imports the rooms and foundations that run
    models (speculation, caches, forward passes, model loading, transformers' calls)."""
    for target in GRAPH[name]:
        assert _room(target) not in MODEL_MACHINERY, f"{name} imports {target}"


@pytest.mark.parametrize("module", ["specd.engine.front.engine_front", "specd.engine.front.stops",
                                    "specd.engine.options", "specd.engine.builtin", "specd.engine.types",
                                    "specd.engine.lookup", "specd.engine.cold_start"])
def test_what_the_map_says_loads_without_torch_does(module):
    loaded = _loads(module)
    assert not {"torch", "transformers", "tokenizers", "llama_cpp"} & set(loaded), loaded


def test_the_engine_loads_without_transformers_model_machinery():
    """transformers' model machinery (``modeling_utils`` and what it pulls in) takes seconds to
    import and serves only a torch model: importing the engine leaves it for a load that needs
    it, so a GGUF model on llama.cpp's forward never pays for it."""
    code = "import json, sys, specd.engine.engine; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    loaded = set(json.loads(done.stdout))
    assert "specd.engine.engine" in loaded and "torch" in loaded
    assert "transformers.modeling_utils" not in loaded


def test_the_daemon_imports_only_what_the_map_allows():
    for name in (n for n in MODULES if n.startswith("specd.daemon")):
        for target, lazy in NODES[name]:
            if target.partition(".")[0] not in ("specd", "specd_lsp") or target == "specd":
                continue  # the standard library, third parties, and specd's own version
            if lazy and target.startswith(DAEMON_LAZY_ONLY):
                continue
            assert target.startswith(DAEMON_MAY_IMPORT), f"{name} imports {target}{' (lazily)' if lazy else ''}"


def test_the_daemon_starts_without_the_engine():
    """The daemon's loop starts before torch loads: the server and the CLI's serve command import
    nothing of the engine and no heavy library."""
    for module in ("specd.daemon.server", "specd.daemon.commands"):
        loaded = set(_loads(module))
        assert not loaded & {"torch", "transformers", "tokenizers", "llama_cpp"}, (module, loaded)
        assert loaded <= {"numpy", "specd.engine", "specd.engine.types"}, (module, loaded)


def test_the_bench_never_imports_the_daemon():
    """The bench may import the engine (and specd-lsp's post-processing, to score what an editor
    shows), never the daemon, the socket or the CLI."""
    for name in (n for n in MODULES if n.startswith("specd.bench")):
        for target in GRAPH[name]:
            assert not target.startswith(("specd.daemon", "specd.protocol", "specd.client", "specd.cli")), \
                f"{name} imports {target}"
            if target.startswith("specd_lsp"):
                assert target == "specd_lsp.completion", f"{name} imports {target}"


def test_the_draft_trainer_imports_only_what_the_map_allows():
    for name in (n for n in MODULES if n.startswith("specd.distill")):
        for target in GRAPH[name]:
            assert target.startswith(DISTILL_MAY_IMPORT), f"{name} imports {target}"


@pytest.mark.parametrize("module", ["specd.distill.train", "specd.demo.options"])
def test_the_trainers_options_load_without_torch(module):
    """``specd --help`` builds every subcommand's parser: the trainers' options come from these
    modules, which must not load torch or transformers to give them."""
    assert not set(_loads(module)) & {"torch", "transformers", "tokenizers", "llama_cpp"}


def test_the_protocol_knows_nothing_of_the_engine():
    """The wire format imports only itself, the standard library and msgpack."""
    for name in (n for n in MODULES if n.startswith("specd.protocol")):
        assert all(t.startswith("specd.protocol") for t in GRAPH[name]), (name, GRAPH[name])
        assert _outside_imports(name) <= set(sys.stdlib_module_names) | {"msgpack"}, name


def test_the_layering_checks_can_fail(monkeypatch):
    """The checks above read the graph they are given: an engine module importing the daemon,
    the front importing a forward path, and the daemon importing the engine on its loop fail."""
    monkeypatch.setitem(GRAPH, "specd.engine.front.prompt", GRAPH["specd.engine.front.prompt"] | {"specd.engine.forward.path"})
    with pytest.raises(AssertionError):
        test_the_front_knows_no_models("specd.engine.front.prompt")
    monkeypatch.setitem(GRAPH, "specd.engine.types", GRAPH["specd.engine.types"] | {"specd.daemon.params"})
    with pytest.raises(AssertionError):
        test_the_engine_imports_only_what_the_map_allows()
    monkeypatch.setitem(NODES, "specd.daemon.params", [*NODES["specd.daemon.params"], ("specd.engine.loading", False)])
    with pytest.raises(AssertionError):
        test_the_daemon_imports_only_what_the_map_allows()


def test_the_suggestion_rules_import_only_the_standard_library():
    """specd.suggestion_rules is shared by the engine, the daemon and specd-lsp, so it imports
    nothing of specd and nothing any of them could not load."""
    name = "specd.suggestion_rules"
    assert GRAPH[name] == set()
    assert _outside_imports(name) <= set(sys.stdlib_module_names)


def test_the_options_table_imports_only_the_standard_library_and_the_suggestion_rules():
    """specd.options_table is read by the engine, the daemon on its loop, the CLI and specd-lsp,
    so it imports nothing any of them could not load."""
    name = "specd.options_table"
    assert GRAPH[name] <= {"specd.suggestion_rules"}
    assert _outside_imports(name) <= set(sys.stdlib_module_names)


def _long_classes_without_a_concern(source: str) -> list[str]:
    """The classes in ``source`` over CLASS_LINES_WITHOUT_A_CONCERN lines whose docstring does not
    begin with CONCERN_MARK, as "Name (N lines)"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            lines = node.end_lineno - node.lineno + 1
            if lines > CLASS_LINES_WITHOUT_A_CONCERN and not (ast.get_docstring(node) or "").startswith(CONCERN_MARK):
                found.append(f"{node.name} ({lines} lines)")
    return found


def test_long_classes_name_their_one_concern():
    unnamed = {name: found for name, path in MODULES.items()
               if (found := _long_classes_without_a_concern(path.read_text(encoding="utf-8")))}
    assert unnamed == {}


def test_the_class_length_check_can_fail():
    """A class one line over the limit is found, unless its docstring names its concern; one at the limit is not."""
    body = [f"    x{n} = {n}\n" for n in range(CLASS_LINES_WITHOUT_A_CONCERN)]
    assert _long_classes_without_a_concern("class Long:\n" + "".join(body)) == [
        f"Long ({CLASS_LINES_WITHOUT_A_CONCERN + 1} lines)"]
    assert _long_classes_without_a_concern(f'class Long:\n    """{CONCERN_MARK} counting."""\n' + "".join(body)) == []
    assert _long_classes_without_a_concern("class Short:\n" + "".join(body[1:])) == []
