"""Request parameter checkers: one set, used by the handlers and by the buffer store.

Each takes the params map (or a value) and a name, and returns the value in the type the
handler wants, or raises ``invalid_params`` with a message naming the parameter.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import unquote, urlparse

from specd.protocol.errors import ErrorCode, RpcError
from specd.protocol.methods import POSITION_ENCODINGS

# A URI names a document; no editor makes one this long (Linux paths stop at 4,096 bytes), and
# every open document, queued job and status line holds its URI.
MAX_URI_CHARS = 8192


def param_error(message: str) -> RpcError:
    return RpcError(ErrorCode.INVALID_PARAMS, message)


def check_int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise param_error(f"{name} must be an integer")
    return value


def check_encoding(value: Any) -> str:
    if value is None:
        return "utf-32"
    if value not in POSITION_ENCODINGS:
        raise param_error(f"encoding must be one of {', '.join(POSITION_ENCODINGS)}")
    return value


def get_str(params: dict[str, Any], name: str, required: bool = True) -> str | None:
    value = params.get(name)
    if value is None and not required:
        return None
    if isinstance(value, bytes):  # tolerate msgpack bin from clients that do not mark strings
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise param_error(f"{name} is not valid UTF-8") from None
    if not isinstance(value, str):
        raise param_error(f"{name} must be a string")
    return value


def get_uri(params: dict[str, Any], name: str = "uri", required: bool = True) -> str | None:
    uri = get_str(params, name, required)
    if uri is not None and len(uri) > MAX_URI_CHARS:
        raise param_error(f"{name} is {len(uri)} characters, over the limit of {MAX_URI_CHARS}")
    return uri


def get_int(params: dict[str, Any], name: str, low: int | None = None, high: int | None = None) -> int | None:
    value = params.get(name)
    if value is None:
        return None
    check_int(value, name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise param_error(f"{name} must be between {low} and {high}")
    return value


def get_bool(params: dict[str, Any], name: str) -> bool | None:
    value = params.get(name)
    if value is not None and not isinstance(value, bool):
        raise param_error(f"{name} must be a boolean")
    return value


def get_float(params: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = params.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (low <= value <= high):
        raise param_error(f"{name} must be a number between {low} and {high}")
    return float(value)


def get_folders(params: dict[str, Any], name: str) -> list[str] | None:
    """A list of folders, each an absolute path or a file:// URI, as absolute paths."""
    value = params.get(name)
    if value is None:
        return None
    if not isinstance(value, list):
        raise param_error(f"{name} must be an array of folder paths or file:// URIs")
    out = []
    for number, item in enumerate(value):
        folder = get_uri({f"{name}[{number}]": item}, f"{name}[{number}]")
        if folder.startswith("file://"):
            folder = unquote(urlparse(folder).path)
        if not os.path.isabs(folder):
            raise param_error(f"{name}[{number}] must be an absolute path or a file:// URI, got {folder!r}")
        out.append(folder)
    return out


COMPLETE_OPTIONS = (
    "max_tokens", "single_line", "stop_at_block_end", "temperature", "top_p", "seed",
    "time_budget_ms", "use_draft_model", "use_lookup", "kv_reuse",
)
MAX_TOKENS_LIMIT = 4096


def completion_options(options: Any) -> dict[str, Any]:
    """Validate ``complete``'s options map into CompletionRequest keyword arguments."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise param_error("options must be a map")
    unknown = sorted(str(key) for key in options if key not in COMPLETE_OPTIONS)
    if unknown:
        raise param_error(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(COMPLETE_OPTIONS)}")
    out: dict[str, Any] = {
        "max_tokens": get_int(options, "max_tokens", 1, MAX_TOKENS_LIMIT),
        "seed": get_int(options, "seed", 0, 2**63 - 1),
        "time_budget_ms": get_int(options, "time_budget_ms", 1, 600_000),
        "temperature": get_float(options, "temperature", 0.0, 100.0),
        "top_p": get_float(options, "top_p", 0.0, 1.0),
    }
    for name in ("single_line", "stop_at_block_end", "use_draft_model", "use_lookup", "kv_reuse"):
        out[name] = get_bool(options, name)
    # Leave out what was not given, so the engine's and CompletionRequest's defaults apply.
    return {key: value for key, value in out.items() if value is not None}
