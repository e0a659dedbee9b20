"""specd configuration: defaults < TOML file < SPECD_* environment < command-line flags.

The schema is data (``SCHEMA``): every key has a type, a default, a one-line help and an
optional check. Loading validates everything and raises ``ConfigError`` whose message is one
line naming the key and where the bad value came from, so the CLI can print it and exit 2.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


class ConfigError(Exception):
    """A bad config value; ``str(err)`` is one line naming the key and its source."""


@dataclass(frozen=True)
class Key:
    type: type
    default: Any
    help: str
    check: Callable[[Any], str | None] | None = None  # returns an error text or None
    choices: tuple[str, ...] | None = None


def _positive(value: Any) -> str | None:
    return None if value > 0 else "must be > 0"


def _non_negative(value: Any) -> str | None:
    return None if value >= 0 else "must be >= 0"


def _probability(value: Any) -> str | None:
    return None if 0.0 <= value <= 1.0 else "must be between 0 and 1"


LOG_LEVELS = ("debug", "info", "warning", "error")
FIM_FAMILIES = ("auto", "qwen", "starcoder", "deepseek", "codellama", "codestral", "demo", "plain")
# auto: suffix-first when the family was trained on it, else anchored prefix-suffix-middle.
FIM_LAYOUTS = ("auto", "psm", "spm", "anchored")

SCHEMA: dict[str, dict[str, Key]] = {
    "model": {
        "target": Key(str, "", "target model: local directory or hub id ('' = the embedded demo pair)"),
        "draft": Key(str, "", "draft model sharing the target's tokenizer ('' = none, or the demo draft)"),
        "device": Key(str, "auto", "torch device: auto, cpu, cuda, cuda:N, mps"),
        "dtype": Key(str, "auto", "weights dtype", choices=("auto", "float32", "bfloat16", "float16")),
        "trust_remote_code": Key(bool, False, "allow model repos to run their own Python code"),
        "fim_family": Key(str, "auto", "FIM prompt template", choices=FIM_FAMILIES),
        "fim_layout": Key(str, "auto", "prompt order: psm (prefix-suffix-middle), spm (suffix first), anchored "
                                       "(psm whose prefix ends at a stable anchor; the typed text rides after "
                                       "the middle token, so keystrokes re-prefill only that span)",
                          choices=FIM_LAYOUTS),
    },
    "engine": {
        "max_tokens": Key(int, 128, "default completion length limit, in tokens", _positive),
        "prefix_tokens": Key(int, 1536, "prompt budget for text before the cursor, in tokens", _positive),
        "suffix_tokens": Key(int, 512, "prompt budget for text after the cursor, in tokens", _non_negative),
        "use_draft_model": Key(bool, True, "draft with the draft model"),
        "use_lookup": Key(bool, True, "draft by prompt lookup over buffers and workspace"),
        "kv_reuse": Key(bool, True, "reuse each document's KV-cache prefix across requests"),
        "token_healing": Key(bool, True, "end the prompt a token before the cursor and re-type it, so a fresh "
                                         "indented line or a half-typed word is not a token the model never saw"),
        "fast_forward": Key(bool, True, "lean static-cache forward for Llama-family models (Llama, Qwen2, "
                                        "Mistral, StarCoder2); off = transformers' own forward"),
        "draft_max": Key(int, 8, "most tokens the draft model proposes per step", _positive),
        "lookup_max": Key(int, 16, "most tokens prompt lookup proposes per step", _positive),
        "draft_confidence": Key(float, 0.3, "draft model stops a chain below this probability", _probability),
        "cache_budget_mb": Key(int, 2048, "memory for per-document KV caches, MiB", _positive),
        "time_budget_ms": Key(int, 5000, "wall-clock limit per completion, ms", _positive),
        "threads": Key(int, 0, "CPU threads for torch (0 = auto: half the cores, at most 4)", _non_negative),
        "context_tokens": Key(int, 512, "prompt budget for other files' chunks (repo-level context), tokens", _non_negative),
        "auto_context": Key(bool, True, "fill that budget from open buffers and nearby workspace files"),
    },
    "daemon": {
        "socket": Key(str, "", "Unix socket path ('' = $XDG_RUNTIME_DIR/specd/specd.sock)"),
        "idle_unload_s": Key(int, 1800, "release models after this many idle seconds (0 = never)", _non_negative),
        "max_frame_bytes": Key(int, 16 * 1024 * 1024, "largest accepted message, bytes", _positive),
        "max_document_bytes": Key(int, 8 * 1024 * 1024, "largest accepted document, bytes", _positive),
        "max_documents": Key(int, 256, "most open documents held", _positive),
        "max_connections": Key(int, 64, "most simultaneous clients", _positive),
        "tcp": Key(str, "", "optional loopback TCP listener HOST:PORT ('' = none)"),
        "tcp_token": Key(str, "", "token a TCP client must present in hello"),
    },
    "workspace": {
        "enabled": Key(bool, True, "watch workspace folders and index their files for lookup and context"),
        "folders": Key(str, "", "folders to watch from the start, separated by ':' (editors add theirs)"),
        "ignore": Key(str, ".git,.hg,.svn,node_modules,__pycache__,.venv,venv,.tox,.mypy_cache,.pytest_cache,"
                           ".ruff_cache,.idea,.vscode,dist,build,target,*.min.js,*.min.css,*.map,*.lock,*.log",
                      "gitignore-style patterns never indexed, comma-separated (on top of .gitignore)"),
        "max_file_bytes": Key(int, 1024 * 1024, "larger files are skipped, bytes", _positive),
        "max_total_bytes": Key(int, 16 * 1024 * 1024, "most bytes indexed over all folders", _positive),
    },
    "log": {
        "level": Key(str, "info", "log level", choices=LOG_LEVELS),
        "file": Key(str, "", "log file ('' = $XDG_STATE_HOME/specd/specd.log)"),
    },
}


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "specd" / "config.toml"


def state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "specd"


def runtime_dir() -> Path:
    """Where the socket lives: $XDG_RUNTIME_DIR/specd, or the state dir when unset."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    return Path(base) / "specd" if base else state_dir() / "run"


@dataclass
class Config:
    values: dict[str, dict[str, Any]]
    sources: dict[str, str] = field(default_factory=dict)  # "section.key" -> where it came from
    file: Path | None = None

    def __getitem__(self, dotted: str) -> Any:
        section, key = dotted.split(".", 1)
        return self.values[section][key]

    def section(self, name: str) -> dict[str, Any]:
        return dict(self.values[name])

    @property
    def socket_path(self) -> Path:
        return Path(self["daemon.socket"]) if self["daemon.socket"] else runtime_dir() / "specd.sock"

    @property
    def log_file(self) -> Path:
        return Path(self["log.file"]) if self["log.file"] else state_dir() / "specd.log"

    def rows(self) -> list[tuple[str, Any, str]]:
        """(dotted key, value, source) for every key, in schema order."""
        return [
            (f"{s}.{k}", self.values[s][k], self.sources.get(f"{s}.{k}", "default"))
            for s, keys in SCHEMA.items()
            for k in keys
        ]


def _coerce(dotted: str, key: Key, raw: Any, source: str) -> Any:
    """Turn a raw TOML/env/CLI value into the key's type, or raise a one-line ConfigError."""
    where = f"{dotted} (from {source})"
    if isinstance(raw, str) and key.type is not str:
        text = raw.strip().lower()
        try:
            if key.type is bool:
                if text not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError(raw)
                raw = text in ("1", "true", "yes", "on")
            else:
                raw = key.type(text)
        except ValueError:
            raise ConfigError(f"{where}: {raw!r} is not a valid {key.type.__name__}") from None
    if key.type is float and isinstance(raw, int) and not isinstance(raw, bool):
        raw = float(raw)
    if not isinstance(raw, key.type) or (key.type is int and isinstance(raw, bool)):
        raise ConfigError(f"{where}: expected {key.type.__name__}, got {type(raw).__name__} {raw!r}")
    if key.choices and raw not in key.choices:
        raise ConfigError(f"{where}: {raw!r} is not one of {', '.join(key.choices)}")
    if key.check and (problem := key.check(raw)):
        raise ConfigError(f"{where}: {raw!r} {problem}")
    return raw


def _set(cfg: Config, dotted: str, raw: Any, source: str) -> None:
    section, _, key = dotted.partition(".")
    if section not in SCHEMA or key not in SCHEMA[section]:
        known = ", ".join(f"{s}.{k}" for s in SCHEMA for k in SCHEMA[s] if s == section) or ", ".join(SCHEMA)
        raise ConfigError(f"unknown config key {dotted!r} in {source} (known: {known})")
    cfg.values[section][key] = _coerce(dotted, SCHEMA[section][key], raw, source)
    cfg.sources[dotted] = source


def load_config(
    path: Path | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> Config:
    """Build the effective config. ``overrides`` are CLI flags as {"section.key": value}."""
    environ = os.environ if environ is None else environ
    cfg = Config({s: {k: key.default for k, key in keys.items()} for s, keys in SCHEMA.items()})
    explicit = path is not None or bool(environ.get("SPECD_CONFIG"))
    path = Path(path or environ.get("SPECD_CONFIG") or config_path())
    if path.exists():
        cfg.file = path
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"{path}: not valid TOML: {err}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"unknown config key {section!r} in {path} (top level holds sections: {', '.join(SCHEMA)})")
            for key, raw in table.items():
                _set(cfg, f"{section}.{key}", raw, str(path))
    elif explicit:
        raise ConfigError(f"config file {path} does not exist")
    for name, raw in sorted(environ.items()):
        if not name.startswith("SPECD_") or name in ("SPECD_CONFIG",) or name.startswith("SPECD_TEST"):
            continue
        section, _, key = name[len("SPECD_"):].lower().partition("_")
        _set(cfg, f"{section}.{key}", raw, f"environment {name}")
    for dotted, raw in (overrides or {}).items():
        if raw is not None:
            _set(cfg, dotted, raw, "command line")
    return cfg
