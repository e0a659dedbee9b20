"""specd configuration: defaults < TOML file < SPECD_* environment < command-line flags.

The schema (``SCHEMA``) is made from the one options table (``specd.options_table``): every key
has a type, a default, a one-line help, a range or choices, and an optional check. Loading
validates everything and raises ``ConfigError`` whose message is one line naming the key, where
the bad value came from and what is allowed, so the CLI can print it and exit 2. Values are
checked for their form only (the table's checks): whether the device exists or the port is free
is for the daemon, the engine and ``specd doctor`` to say, so that this module imports neither
torch nor sockets.
"""

from __future__ import annotations

import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Re-exported: the address, device and path forms the CLI, the listeners and the tests name.
from specd.options_table import (CONFIG_SECTIONS, DEVICE_NAMES, DEVICE_TYPES, FIM_FAMILIES, FIM_LAYOUTS,  # noqa: F401
                                 LOG_LEVELS, PORTS, UNIX_PATH_MAX, Option, config_options, parse_host_port,
                                 parse_loopback_address)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


class ConfigError(Exception):
    """A bad config value; ``str(err)`` is one line naming the key and its source."""


# A config key is an option of the one table (``specd.options_table``) that names a section.
Key = Option

SCHEMA: dict[str, dict[str, Key]] = {
    section: {option.name: option for option in config_options(section)} for section in CONFIG_SECTIONS
}


def _xdg_base(variable: str) -> str | None:
    """An XDG base directory variable, or None when unset or relative (the basedir spec says a
    relative value is invalid and is to be ignored)."""
    value = os.environ.get(variable)
    return value if value and os.path.isabs(value) else None


def config_path() -> Path:
    base = _xdg_base("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "specd" / "config.toml"


def state_dir() -> Path:
    base = _xdg_base("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "specd"


def runtime_dir() -> Path:
    """Where the socket lives: $XDG_RUNTIME_DIR/specd, or the state dir when unset."""
    base = _xdg_base("XDG_RUNTIME_DIR")
    return Path(base) / "specd" if base else state_dir() / "run"


@dataclass
class Config:
    values: dict[str, dict[str, Any]]
    sources: dict[str, str] = field(default_factory=dict)  # "section.key" -> where it came from
    file: Path | None = None
    warnings: list[str] = field(default_factory=list)  # one line each: what loading skipped

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
    if isinstance(raw, str) and raw.strip().lower() in key.words:
        return raw.strip().lower()
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
            words = "".join(f" or {word}" for word in key.words)
            raise ConfigError(f"{where}: {raw!r} is not a valid {key.type.__name__}{words}") from None
    if key.type is float and isinstance(raw, int) and not isinstance(raw, bool):
        raw = float(raw)
    if not isinstance(raw, key.type) or (key.type is int and isinstance(raw, bool)):
        raise ConfigError(f"{where}: expected {key.type.__name__}, got {type(raw).__name__} {raw!r}")
    if isinstance(raw, str) and "\0" in raw:
        raise ConfigError(f"{where}: {raw!r} contains a NUL character")
    if key.choices and raw not in key.choices:
        raise ConfigError(f"{where}: {raw!r} is not one of {', '.join(key.choices)}")
    if key.convert:
        raw = key.convert(raw)
    if problem := key.range_problem(raw) or (key.check and key.check(raw)):
        raise ConfigError(f"{where}: {raw!r} {problem}")
    return raw


def _unknown_key(dotted: str, source: str) -> str:
    section, _, key = dotted.partition(".")
    if section in SCHEMA:
        known = ", ".join(f"{section}.{k}" for k in SCHEMA[section])
    else:
        known = "sections " + ", ".join(SCHEMA)
    return f"unknown config key {dotted!r} in {source} (known: {known})"


def _set(cfg: Config, dotted: str, raw: Any, source: str) -> None:
    section, _, key = dotted.partition(".")
    if section not in SCHEMA or key not in SCHEMA[section]:
        raise ConfigError(_unknown_key(dotted, source))
    cfg.values[section][key] = _coerce(dotted, SCHEMA[section][key], raw, source)
    cfg.sources[dotted] = source


def _environment_key(name: str) -> str | None:
    """SPECD_ENGINE_MAX_TOKENS -> 'engine.max_tokens'; None for the variables that are not config keys."""
    if not name.startswith("SPECD_") or name == "SPECD_CONFIG" or name.startswith("SPECD_TEST"):
        return None
    section, _, key = name[len("SPECD_"):].lower().partition("_")
    return f"{section}.{key}"


def unknown_environment(environ: dict[str, str] | None = None) -> list[str]:
    """One line per SPECD_* variable that names no config key (what load_config skips with a warning)."""
    environ = os.environ if environ is None else environ
    lines = []
    for name in sorted(environ):
        dotted = _environment_key(name)
        section, _, key = (dotted or "").partition(".")
        if dotted is not None and (section not in SCHEMA or key not in SCHEMA[section]):
            lines.append(f"ignoring environment variable {name}: not a config key "
                         f"(SPECD_<SECTION>_<KEY>; sections: {', '.join(SCHEMA)})")
    return lines


def _read_file(path: Path) -> str:
    """The config file's text; anything but a readable regular file is one line, never a hang
    (a FIFO would block a plain read until a writer came) or a traceback (a directory)."""
    try:
        mode = path.stat().st_mode
    except OSError as err:
        raise ConfigError(f"config file {path}: {err.strerror or err}") from None
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise ConfigError(f"config file {path} is {kind}; it must be a TOML file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: not UTF-8 ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise ConfigError(f"config file {path}: {err.strerror or err}") from None


def load_config(
    path: Path | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
    strict_environment: bool = False,
) -> Config:
    """Build the effective config. ``overrides`` are CLI flags as {"section.key": value}.

    A SPECD_* variable that names no key is skipped with a line in ``Config.warnings`` (the
    environment is shared with other programs, and a stray variable must not cost an editor its
    completions); ``strict_environment`` makes it a ConfigError instead. A bad value for a known
    key is always an error.
    """
    environ = os.environ if environ is None else environ
    cfg = Config({s: {k: key.default for k, key in keys.items()} for s, keys in SCHEMA.items()})
    path_given = path is not None
    explicit = path_given or bool(environ.get("SPECD_CONFIG"))
    # Absolute: a daemon this process spawns is handed the file's path and runs in another directory.
    path = Path(path or environ.get("SPECD_CONFIG") or config_path()).absolute()
    if os.path.lexists(path):
        cfg.file = path
        try:
            data = tomllib.loads(_read_file(path))
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML: {err}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"unknown config key {section!r} in {path} (top level holds sections: {', '.join(SCHEMA)})")
            for key, raw in table.items():
                _set(cfg, f"{section}.{key}", raw, str(path))
    elif explicit:
        named_by = "command line --config" if path_given else "environment SPECD_CONFIG"
        raise ConfigError(f"config file {path} (from {named_by}) does not exist")
    unknown = unknown_environment(environ)
    if unknown and strict_environment:
        raise ConfigError(unknown[0].replace("ignoring environment variable", "unknown environment variable", 1))
    cfg.warnings.extend(unknown)
    for name, raw in sorted(environ.items()):
        dotted = _environment_key(name)
        section, _, key = (dotted or "").partition(".")
        if dotted is not None and section in SCHEMA and key in SCHEMA[section]:
            _set(cfg, dotted, raw, f"environment {name}")
    for dotted, raw in (overrides or {}).items():
        if raw is not None:
            _set(cfg, dotted, raw, "command line")
    _check_together(cfg)
    return cfg


def _check_together(cfg: Config) -> None:
    """The rules that read two keys (each key alone was checked when it was set)."""
    if cfg["daemon.tcp"] and not cfg["daemon.tcp_token"]:
        raise ConfigError(f"daemon.tcp (from {cfg.sources['daemon.tcp']}) is set but daemon.tcp_token is empty; "
                          f"a TCP listener needs a token (or leave daemon.tcp empty)")
    if cfg["model.backend"] == "remote" and not cfg["model.remote_url"]:
        raise ConfigError(f"model.backend (from {cfg.sources['model.backend']}) is remote but model.remote_url is "
                          f"empty; set it to the server's base URL, e.g. http://gpu-box:8000")
