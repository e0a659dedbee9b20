"""specd-lsp's settings: typed, every one defaulted, read from initializationOptions and
workspace/didChangeConfiguration.

Keys are camelCase as LSP clients write them (snake_case is accepted too); they may sit at the
top level or under a ``"specd"`` section. A value of the wrong type or out of range falls back
to its default and is named in one message to the user, never an error: a typo in an editor
config must not cost the user their completions. Each setting's type, range and default are its
option's in specd's one options table (``specd.options_table``), where the daemon's are too.

    {"enable": true, "triggerMode": "automatic", "maxTokens": 64, "singleLine": false,
     "debounceMs": 75, "alternatives": 3, "temperature": 0.7, "stream": true, "completionFallback": "auto",
     "daemon": {"socket": "", "spawn": true, "spawnTimeoutS": 60, "requestTimeoutMs": 10000},
     "cache": {"typeThrough": true, "prefetch": true},
     "log": {"level": "info", "file": ""}}
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import field, make_dataclass
from typing import Any

from specd.options_table import LSP_OPTIONS, Option


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


# Each setting is an option of the one table (specd.options_table) that names an ``lsp`` path:
# its type and range are the option's, its default the option's or, where an editor wants
# another than the daemon's, its ``lsp_default``. Keyed by snake_case path ("daemon.spawn_timeout_s").
SETTINGS: dict[str, Option] = {
    ".".join(snake(part) for part in option.lsp.split(".")): option for option in LSP_OPTIONS
}


def _settings_class(name: str, group: str, nested: dict[str, type] | None = None) -> type:
    """The frozen, fully defaulted dataclass of one group of settings ("" = the top level)."""
    members: list[tuple[str, Any, Any]] = []
    for path, option in SETTINGS.items():
        where, _, leaf = path.rpartition(".")
        if where == group:
            kinds = option.type.__name__ if option.lsp_value is not None else f"{option.type.__name__} | None"
            members.append((leaf, kinds, field(default=option.lsp_value)))
    members += [(sub, cls.__name__, field(default_factory=cls)) for sub, cls in (nested or {}).items()]
    return make_dataclass(name, members, frozen=True, namespace={"__module__": __name__})


DaemonSettings = _settings_class("DaemonSettings", "daemon")
CacheSettings = _settings_class("CacheSettings", "cache")
LogSettings = _settings_class("LogSettings", "log")
Settings = _settings_class("Settings", "", {"daemon": DaemonSettings, "cache": CacheSettings, "log": LogSettings})


def _demand(option: Option) -> str:
    """What a setting's value must be; the value that leaves it to the daemon is allowed too."""
    demand = option.demand()
    return demand if option.lsp_unset is None else f"{option.lsp_unset} or {demand}"


def _allowed(option: Option, value: Any) -> bool:
    return (option.lsp_unset is not None and value == option.lsp_unset) or option.problem(value) is None


def _coerce(value: Any, kind: type) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _build(cls: type, raw: Any, base: Any, path: str, problems: list[str], group: str = "") -> Any:
    if not isinstance(raw, dict):
        if raw is not None:
            problems.append(f"{path or 'settings'} (expected an object)")
        return base
    known = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = snake(str(key))
        where = f"{path}.{camel(name)}" if path else camel(name)
        if name not in known:
            problems.append(f"{where} (unknown)")
            continue
        current = getattr(base, name)
        if dataclasses.is_dataclass(current):
            values[name] = _build(type(current), value, current, where, problems, name)
            continue
        option = SETTINGS[f"{group}.{name}" if group else name]
        kind = option.type
        value = _coerce(value, kind)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            problems.append(f"{where} (expected {kind.__name__}, got {value!r})")
        elif not _allowed(option, value):
            problems.append(f"{where} (must be {_demand(option)}, got {value!r})")
        else:
            values[name] = value
    return dataclasses.replace(base, **values)


def parse_settings(raw: Any, base: Settings | None = None) -> tuple[Settings, list[str]]:
    """Settings from a client's map over ``base`` (defaults when None), and what was ignored."""
    base = base or Settings()
    if isinstance(raw, dict) and isinstance(raw.get("specd"), dict):
        raw = raw["specd"]
    problems: list[str] = []
    settings = _build(Settings, raw, base, "", problems)
    return settings, problems


def wire_options(settings: Settings) -> dict[str, Any]:
    """The settings that are also ``complete`` options, as the daemon takes them; one at its
    "not set here" value is left out, so the daemon's own applies."""
    options = {}
    for path, option in SETTINGS.items():
        if option.wire:
            value = settings
            for part in path.split("."):
                value = getattr(value, part)
            if option.lsp_unset is None or value != option.lsp_unset:
                options[option.name] = value
    return options


def problems_message(problems: list[str]) -> str:
    """The one message that tells the user which settings fell back to their defaults."""
    return "specd: ignored invalid settings, using defaults for: " + "; ".join(problems)


def to_dict(settings: Settings) -> dict[str, Any]:
    """The settings as camelCase JSON, as specd/status reports them."""

    def convert(obj: Any) -> Any:
        if dataclasses.is_dataclass(obj):
            return {camel(f.name): convert(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return obj

    return convert(settings)
