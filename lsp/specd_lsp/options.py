"""specd-lsp's settings: typed, every one defaulted, read from initializationOptions and
workspace/didChangeConfiguration.

Keys are camelCase as LSP clients write them (snake_case is accepted too); they may sit at the
top level or under a ``"specd"`` section. A value of the wrong type or out of range falls back
to its default and is named in one message to the user, never an error: a typo in an editor
config must not cost the user their completions.

    {"enable": true, "triggerMode": "automatic", "maxTokens": 64, "singleLine": false,
     "debounceMs": 75, "alternatives": 3, "temperature": 0.7, "stream": true, "completionFallback": "auto",
     "daemon": {"socket": "", "spawn": true, "spawnTimeoutS": 60, "requestTimeoutMs": 10000},
     "cache": {"typeThrough": true, "prefetch": true},
     "log": {"level": "info", "file": ""}}
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Callable

TRIGGER_MODES = ("automatic", "manual")
FALLBACK_MODES = ("auto", "always", "never")
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class DaemonSettings:
    socket: str = ""  # '' = specd's own config (SPECD_DAEMON_SOCKET, config file, $XDG_RUNTIME_DIR)
    spawn: bool = True  # start `specd serve` when nothing answers at the socket
    spawn_timeout_s: float = 60.0  # for the spawned daemon's socket to answer
    request_timeout_ms: int = 10_000  # most a completion may take before we give up on it


@dataclass(frozen=True)
class CacheSettings:
    type_through: bool = True  # answer from the last completion while the user types it
    prefetch: bool = True  # after an accept, compute the next suggestion ahead of time
    size: int = 64  # completions kept for type-through, over all documents


@dataclass(frozen=True)
class LogSettings:
    level: str = "info"
    file: str = ""  # '' = stderr only


@dataclass(frozen=True)
class Settings:
    enable: bool = True
    trigger_mode: str = "automatic"  # manual: only explicitly invoked completions
    max_tokens: int = 64
    single_line: bool = False
    debounce_ms: int = 75  # automatic requests wait this long for the user to stop typing
    alternatives: int = 3  # items for an explicitly invoked completion (first greedy, rest sampled)
    temperature: float = 0.7  # for the sampled alternatives
    time_budget_ms: int = 0  # per completion on the daemon (0 = the daemon's default)
    stream: bool = True  # answer an automatic request with its first line, the rest into the cache
    completion_fallback: str = "auto"  # textDocument/completion: auto = when the client lacks inline completion
    daemon: DaemonSettings = field(default_factory=DaemonSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    log: LogSettings = field(default_factory=LogSettings)


def _positive(value: Any) -> bool:
    return value > 0


def _non_negative(value: Any) -> bool:
    return value >= 0


# (type, check, what the check demands) per field; fields not listed are nested sections.
CHECKS: dict[str, tuple[type, Callable[[Any], bool] | None, str]] = {
    "enable": (bool, None, ""),
    "trigger_mode": (str, TRIGGER_MODES.__contains__, f"one of {', '.join(TRIGGER_MODES)}"),
    "max_tokens": (int, lambda v: 1 <= v <= 4096, "between 1 and 4096"),
    "single_line": (bool, None, ""),
    "debounce_ms": (int, lambda v: 0 <= v <= 10_000, "between 0 and 10000"),
    "alternatives": (int, lambda v: 1 <= v <= 10, "between 1 and 10"),
    "temperature": (float, lambda v: 0.0 <= v <= 2.0, "between 0 and 2"),
    "time_budget_ms": (int, _non_negative, ">= 0"),
    "stream": (bool, None, ""),
    "completion_fallback": (str, FALLBACK_MODES.__contains__, f"one of {', '.join(FALLBACK_MODES)}"),
    "socket": (str, None, ""),
    "spawn": (bool, None, ""),
    "spawn_timeout_s": (float, _positive, "> 0"),
    "request_timeout_ms": (int, _positive, "> 0"),
    "type_through": (bool, None, ""),
    "prefetch": (bool, None, ""),
    "size": (int, lambda v: 0 <= v <= 10_000, "between 0 and 10000"),
    "level": (str, LOG_LEVELS.__contains__, f"one of {', '.join(LOG_LEVELS)}"),
    "file": (str, None, ""),
}


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _coerce(value: Any, kind: type) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _build(cls: type, raw: Any, base: Any, path: str, problems: list[str]) -> Any:
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
            values[name] = _build(type(current), value, current, where, problems)
            continue
        kind, check, demand = CHECKS[name]
        value = _coerce(value, kind)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            problems.append(f"{where} (expected {kind.__name__}, got {value!r})")
        elif check is not None and not check(value):
            problems.append(f"{where} (must be {demand}, got {value!r})")
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
