"""The one options table: every place that reads options is made from it (the config schema, the
engine's options, the request type, the wire's validation, specd-lsp's settings), so each default
and range agrees with itself everywhere; the local and the remote engine resolve a request
through one function; and a second copy of a default, a range or a list of choices fails here."""

from __future__ import annotations

import ast
import dataclasses
import sys
from collections import Counter
from pathlib import Path

import pytest

from specd.config import SCHEMA, ConfigError, _coerce, load_config
from specd.daemon.params import COMPLETE_OPTIONS, completion_options, parse_complete
from specd.engine.options import EngineOptions, resolve_request
from specd.engine.types import CompletionRequest, ContextChunk
from specd.options_table import (CONFIG_SECTIONS, ENGINE_OPTIONS, FIM_FAMILIES, FIM_LAYOUTS, LSP_OPTIONS, OPTIONS,
                                 REQUEST_OPTIONS, WIRE_OPTIONS, Option, config_reference, lsp_reference)
from specd.protocol.errors import RpcError
from specd.suggestion_rules import BoundaryRules
from specd_lsp.options import SETTINGS, Settings, parse_settings, to_dict, wire_options

ROOT = Path(__file__).resolve().parent.parent
NUMBERS = (int, float)


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def test_each_place_holds_each_option_once():
    config = [(option.config, option.name) for option in OPTIONS if option.config]
    assert len(config) == len(set(config))
    for place in (ENGINE_OPTIONS, REQUEST_OPTIONS, LSP_OPTIONS):
        names = [option.lsp if place is LSP_OPTIONS else option.name for option in place]
        assert len(names) == len(set(names)), Counter(names).most_common(1)
    assert all(option.request for option in WIRE_OPTIONS)  # the wire parses into the request
    assert all(option.config in ("model", "engine") for option in ENGINE_OPTIONS)
    for option in OPTIONS:
        assert option.config is None or option.config in CONFIG_SECTIONS, option
        assert option.config or option.request or option.lsp, f"{option.name} may be set nowhere"
        assert option.doc and option.doc == option.doc.strip(), option.name


@pytest.mark.parametrize("option", OPTIONS, ids=lambda option: option.lsp or f"{option.config}.{option.name}")
def test_each_default_is_in_its_own_range(option: Option):
    for default in {option.default, option.lsp_value} - {None, option.lsp_unset}:
        if isinstance(default, str) and default in option.words:
            continue
        assert isinstance(default, option.type), option
        assert option.problem(default) is None, (option, default)


def test_the_config_schema_is_the_table():
    assert list(SCHEMA) == list(CONFIG_SECTIONS)
    for section, keys in SCHEMA.items():
        assert list(keys.values()) == [option for option in OPTIONS if option.config == section]
    cfg = load_config(environ={})
    assert all(cfg[f"{option.config}.{option.name}"] == option.default for option in OPTIONS if option.config)


def test_the_engine_options_are_the_table():
    fields = _fields(EngineOptions)
    assert list(fields) == [option.name for option in ENGINE_OPTIONS]
    assert all(fields[option.name].default == option.default for option in ENGINE_OPTIONS)
    assert EngineOptions.from_config(load_config(environ={})) == EngineOptions()


def test_the_request_defaults_are_the_table():
    """A request's setting defaults to None where the engine has the option (the engine's
    applies), else to the option's own default."""
    fields = _fields(CompletionRequest)
    for option in REQUEST_OPTIONS:
        assert fields[option.name].default == (None if option.engine else option.default), option.name
    assert set(fields) - {option.name for option in REQUEST_OPTIONS} == {"uri", "text", "offset", "extra_context",
                                                                          "path"}


def test_the_lsp_settings_are_the_table():
    flat = {}

    def walk(obj, prefix: str) -> None:
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{field.name}.")
            else:
                flat[f"{prefix}{field.name}"] = value

    walk(Settings(), "")
    assert flat == {path: option.lsp_value for path, option in SETTINGS.items()}
    assert set(SETTINGS.values()) == set(LSP_OPTIONS)


def _edges(option: Option) -> tuple[list, list]:
    """Values just inside and just outside an option's range."""
    step = 1 if option.type is int else 1e-9
    inside, outside = [], []
    if option.low is not None:
        inside.append(option.low)
        outside.append(option.low - step)
    if option.high is not None:
        inside.append(option.high)
        outside.append(option.high + step)
    if option.above is not None:
        outside.append(option.above)
    if option.choices:
        inside += list(option.choices)
        outside.append("none of these")
    return inside, outside


@pytest.mark.parametrize("option", WIRE_OPTIONS, ids=lambda option: option.name)
def test_the_wire_takes_exactly_the_range(option: Option):
    assert option.name in COMPLETE_OPTIONS
    inside, outside = _edges(option)
    for value in inside:
        assert completion_options({option.name: value}) == {option.name: value}
    for value in outside:
        with pytest.raises(RpcError):
            completion_options({option.name: value})


@pytest.mark.parametrize("option", [option for option in OPTIONS if option.config and (option.low is not None
                                                                                        or option.choices)],
                         ids=lambda option: f"{option.config}.{option.name}")
def test_the_config_takes_exactly_the_range(option: Option):
    dotted = f"{option.config}.{option.name}"
    inside, outside = _edges(option)
    for value in inside:
        assert _coerce(dotted, option, value, "a test") == value
    for value in outside:
        with pytest.raises(ConfigError):
            _coerce(dotted, option, value, "a test")


@pytest.mark.parametrize("path", sorted(SETTINGS), ids=str)
def test_specd_lsp_takes_exactly_the_range(path: str):
    option = SETTINGS[path]
    inside, outside = _edges(option)
    *groups, leaf = path.split(".")

    def nest(value):
        raw = {leaf: value}
        for group in reversed(groups):
            raw = {group: raw}
        return raw

    for value in inside + ([option.lsp_unset] if option.lsp_unset is not None else []):
        settings, problems = parse_settings(nest(value))
        assert problems == [], (path, value)
    for value in outside:
        if value == option.lsp_unset:
            continue
        settings, problems = parse_settings(nest(value))
        assert len(problems) == 1 and settings == Settings(), (path, value)


def test_the_shared_knobs_agree_across_config_wire_and_lsp():
    """max_tokens, time_budget_ms and temperature: one range from the config file to the editor."""
    for name, lsp in (("max_tokens", "maxTokens"), ("time_budget_ms", "timeBudgetMs"), ("temperature", "temperature")):
        option = next(option for option in OPTIONS if option.name == name and option.request)
        assert option.lsp == lsp and option.wire
        assert SETTINGS[name] is option
        if option.config:
            assert SCHEMA[option.config][name] is option
    assert parse_settings({"maxTokens": 65536})[1] == [] and parse_settings({"maxTokens": 65537})[1]
    assert completion_options({"max_tokens": 65536}) == {"max_tokens": 65536}
    assert to_dict(Settings())["maxTokens"] == 64  # specd-lsp's own default: ghost text is short


def test_specd_lsp_asks_the_daemon_with_its_settings():
    assert wire_options(Settings()) == {"max_tokens": 64, "single_line": False, "temperature": 0.7}
    settings, _ = parse_settings({"maxTokens": 9, "timeBudgetMs": 250, "singleLine": True})
    options = wire_options(settings)
    assert options == {"max_tokens": 9, "time_budget_ms": 250, "single_line": True, "temperature": 0.7}
    assert completion_options(options) == options  # what specd-lsp may send, the daemon takes


def test_the_wire_parses_straight_into_the_engine_request():
    params = parse_complete({"uri": "file:///a.py", "cursor": {"line": 0, "character": 2}, "path": "a.py",
                             "extra_context": [{"path": "b.py", "text": "b = 1\n"}],
                             "options": {"max_tokens": 5, "multiline": "always", "temperature": 0.5}})
    request = params.request
    assert isinstance(request, CompletionRequest)
    assert request == CompletionRequest(uri="file:///a.py", path="a.py", max_tokens=5, multiline="always",
                                        temperature=0.5, extra_context=[ContextChunk("b.py", "b = 1\n")])
    stateless = parse_complete({"text": "x = 1", "cursor": 3}).request
    assert stateless.text == "x = 1" and stateless.uri is None and stateless.offset is None


def test_resolve_request_takes_the_request_over_the_engine_options():
    options = EngineOptions(max_tokens=20, time_budget_ms=700, use_lookup=False, stop_at_block_end=False,
                            token_healing=False)
    unset = resolve_request(CompletionRequest(text="x", offset=0), options)
    assert (unset.max_tokens, unset.time_budget_ms, unset.budget_s) == (20, 700, 0.7)
    assert (unset.use_lookup, unset.use_draft_model, unset.token_healing) == (False, True, False)
    assert unset.rules == BoundaryRules(repeated_line=True, suffix_line=True, block_end=False, multiline="blocks")
    assert unset.kv_reuse is False  # no document: nothing to reuse
    asked = resolve_request(CompletionRequest(uri="file:///a.py", max_tokens=0, use_lookup=True, multiline="always",
                                      stop_at_block_end=True, token_healing=True), options)
    assert (asked.max_tokens, asked.use_lookup, asked.token_healing, asked.kv_reuse) == (1, True, True, True)
    assert asked.rules == BoundaryRules(True, True, True, "always")
    # The suggestion rules' own defaults (a stdlib-only module, it cannot read the table) agree.
    assert resolve_request(CompletionRequest(), EngineOptions()).rules == BoundaryRules()


def test_the_fim_lists_are_the_front_templates():
    from specd.engine.front.prompt import LAYOUTS, TEMPLATES

    assert set(FIM_FAMILIES) == {"auto", *TEMPLATES}
    assert FIM_LAYOUTS == ("auto", *LAYOUTS)


@pytest.mark.parametrize("doc, reference", [("docs/config.md", config_reference), ("docs/lsp.md", lsp_reference)])
def test_the_docs_list_the_table(doc, reference):
    """The reference tables in the docs are the table's own rendering (``python -m
    specd.options_table [lsp]`` prints them)."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    assert f"\n{reference()}\n<!-- end of the generated table -->" in text


def test_the_vs_code_extension_declares_the_table_s_settings():
    """VS Code shows and checks its ``specd.*`` settings from package.json (JSON, so a copy):
    each one specd-lsp has declares the table's default, range and choices."""
    import json

    package = json.loads((ROOT / "editor-plugins" / "vscode" / "package.json").read_text(encoding="utf-8"))
    declared = package["contributes"]["configuration"]["properties"]
    shared = [option for option in LSP_OPTIONS if f"specd.{option.lsp}" in declared]
    assert {"maxTokens", "temperature", "triggerMode", "daemon.spawnTimeoutS"} <= {option.lsp for option in shared}
    for option in shared:
        setting = declared[f"specd.{option.lsp}"]
        assert setting["default"] == option.lsp_value, option.lsp
        assert setting.get("minimum") == option.low and setting.get("maximum") == option.high, option.lsp
        assert setting.get("exclusiveMinimum") == option.above, option.lsp
        assert tuple(setting.get("enum", ())) == (option.choices or ()), option.lsp


# -- no second copy -------------------------------------------------------------------------------

# Where options are read: the engine, the daemon, the config, the client, the CLI and specd-lsp (the
# bench, the demo's and the distiller's trainers have seeds and threads of their own).
SOURCES = [path for path in [*sorted((ROOT / "specd").rglob("*.py")), *sorted((ROOT / "lsp").rglob("*.py"))]
           if not path.relative_to(ROOT).as_posix().startswith(("specd/bench/", "specd/demo/", "specd/distill/"))]
# The modules whose lists are the originals the table takes.
ORIGINALS = {"specd/options_table.py", "specd/suggestion_rules.py"}
# Lists of choices still written again outside the table, each by where and what: the copy is to
# be replaced by the table's (``OPTIONS``'s choices) and its line taken out of here.
KNOWN_CHOICE_COPIES = Counter({
    ("specd/cli.py", "auto,bfloat16,float16,float32"): 1,  # --dtype
    ("specd/cli.py", "debug,error,info,warning"): 1,  # --log-level
    ("specd/cli.py", "anchored,auto,psm,spm"): 1,  # --fim-layout
    ("lsp/specd_lsp/server.py", "debug,error,info,warning"): 1,  # specd-lsp's --log-level
    ("specd/engine/forward/lean/forward.py", "auto,off,on"): 1,  # transposed_weights, numpy_products
    ("specd/engine/forward/lean/host.py", "auto,off,on"): 1,
})
# Fields outside the table that carry an option's name and its default again.
KNOWN_FIELD_COPIES = Counter({
    ("specd/engine/speculation/sampling.py", "SamplingParams.temperature"): 1,  # the sampler's own parameters
    ("specd/engine/speculation/sampling.py", "SamplingParams.top_p"): 1,
})
PER_REQUEST = {option.name for option in REQUEST_OPTIONS}
CHOICE_LISTS = {frozenset(option.choices) for option in OPTIONS if option.choices and len(option.choices) > 1}
CHECKERS = {"get_int", "get_float", "get_bool"}


def _copies() -> tuple[Counter, Counter, list[str]]:
    choices, fields, ranges = Counter(), Counter(), []
    for path in SOURCES:
        where = path.relative_to(ROOT).as_posix()
        if where in ORIGINALS:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List)) and len(node.elts) > 1 and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                words = frozenset(e.value for e in node.elts)
                if words in CHOICE_LISTS:
                    choices[(where, ",".join(sorted(words)))] += 1
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                            and item.target.id in PER_REQUEST and isinstance(item.value, ast.Constant)):
                        fields[(where, f"{node.name}.{item.target.id}")] += 1
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in CHECKERS
                  and any(isinstance(a, ast.Constant) and a.value in PER_REQUEST for a in node.args)
                  and any(isinstance(a, ast.Constant) and isinstance(a.value, NUMBERS) for a in node.args)):
                ranges.append(f"{where}:{node.lineno}")
    return choices, fields, ranges


def test_no_second_copy_of_a_default_a_range_or_a_list_of_choices():
    """A list of an option's choices, a field named for a per-request option with its default, or
    a wire check with an option's range written as numbers, anywhere but the table: each is a copy
    that can drift from it. The known ones are listed, so the list can only shrink."""
    choices, fields, ranges = _copies()
    assert choices == KNOWN_CHOICE_COPIES
    assert fields == KNOWN_FIELD_COPIES
    assert ranges == []


def test_the_copy_finder_finds_a_copy(tmp_path, monkeypatch):
    copy = tmp_path / "copy.py"
    copy.write_text('MODES = ("blocks", "always")\n\n\nclass Asked:\n    max_tokens: int = 128\n\n\n'
                    'def parse(options):\n    return get_int(options, "max_tokens", 1, 4096)\n')
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "SOURCES", [copy])
    choices, fields, ranges = _copies()
    assert choices == Counter({("copy.py", "always,blocks"): 1})
    assert fields == Counter({("copy.py", "Asked.max_tokens"): 1})
    assert ranges == ["copy.py:9"]
