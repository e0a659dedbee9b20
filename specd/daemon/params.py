"""All wire parsing: each method's params map in, a typed value out.

``parse_<method>`` takes the params map of a request and returns a frozen dataclass the
handler works with, or raises ``invalid_params`` with a message naming the parameter. Nothing
here looks at daemon state: whether a document is open, a position inside it or a text under
the size limit is the buffers' and the handlers' to say. The checkers below them (``get_*``,
``check_*``) take a map (or a value) and a name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterator, Union
from urllib.parse import unquote, urlparse

from specd.engine.types import CompletionRequest, ContextChunk
from specd.options_table import WIRE_OPTIONS, Option
from specd.protocol.errors import ErrorCode, RpcError
from specd.protocol.methods import ERROR_FORMATS, POSITION_ENCODINGS

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


# complete's options map: the options table's wire options (``specd.options_table``), each
# checked against its one range or choices, into CompletionRequest fields.
COMPLETE_OPTIONS = tuple(option.name for option in WIRE_OPTIONS)


def _option_value(options: dict[str, Any], option: Option) -> Any:
    name = option.name
    if option.type is bool:
        return get_bool(options, name)
    if option.type is int:
        return get_int(options, name, option.low, option.high)
    if option.type is float:
        return get_float(options, name, option.low, option.high)
    value = options.get(name)
    if value is not None and value not in option.choices:
        raise param_error(f"{name} must be one of {', '.join(option.choices)}, got {value!r}")
    return value


def completion_options(options: Any) -> dict[str, Any]:
    """Validate ``complete``'s options map into CompletionRequest keyword arguments."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise param_error("options must be a map")
    unknown = sorted(str(key) for key in options if key not in COMPLETE_OPTIONS)
    if unknown:
        raise param_error(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(COMPLETE_OPTIONS)}")
    out = {option.name: _option_value(options, option) for option in WIRE_OPTIONS}
    # Leave out what was not given, so the engine's and CompletionRequest's defaults apply.
    return {key: value for key, value in out.items() if value is not None}


# -- cursors and edits --------------------------------------------------------------------------
# Slotted: a change may carry many thousands of edits, each parsed into one of these.


@dataclass(frozen=True, slots=True)
class OffsetCursor:
    offset: int  # code points


@dataclass(frozen=True, slots=True)
class ByteCursor:
    byte_offset: int  # UTF-8 bytes from the start of the text


@dataclass(frozen=True, slots=True)
class LineCursor:
    line: int
    character: int  # in ``encoding`` units
    encoding: str


Cursor = Union[OffsetCursor, ByteCursor, LineCursor]


def parse_cursor(cursor: Any, encoding: Any = None) -> Cursor:
    """A cursor in any accepted form.

    Accepted: an integer (code-point offset); ``{"offset": n}``; ``{"byte_offset": n}``;
    ``{"line": l, "character": c}`` or ``{"line": l, "col": c}`` with an optional
    ``"encoding"`` (utf-32 default, utf-16, utf-8) that overrides ``encoding``.
    """
    if isinstance(cursor, int) and not isinstance(cursor, bool):
        return OffsetCursor(cursor)
    if not isinstance(cursor, dict):
        raise param_error("cursor must be an integer offset or a map (offset, byte_offset, or line + character)")
    encoding = check_encoding(cursor.get("encoding", encoding))
    if "offset" in cursor:
        return OffsetCursor(check_int(cursor["offset"], "cursor.offset"))
    if "byte_offset" in cursor:
        return ByteCursor(check_int(cursor["byte_offset"], "cursor.byte_offset"))
    if "line" in cursor:
        character = cursor.get("character", cursor.get("col"))
        if character is None:
            raise param_error("cursor with a line needs a character (or col)")
        return LineCursor(check_int(cursor["line"], "cursor.line"), check_int(character, "cursor.character"), encoding)
    raise param_error("cursor needs offset, byte_offset, or line + character")


@dataclass(frozen=True, slots=True)
class RangeEdit:
    """Replace from ``start`` to ``end``, positions in the text the edit applies to."""

    start: Cursor
    end: Cursor
    text: str


@dataclass(frozen=True, slots=True)
class OffsetEdit:
    """Replace code points ``[start, end)``."""

    start: int
    end: int
    text: str


@dataclass(frozen=True, slots=True)
class WholeText:
    """Replace the whole text."""

    text: str


Edit = Union[RangeEdit, OffsetEdit, WholeText]


def parse_edit(edit: Any, number: int, encoding: str) -> Edit:
    """``edits[number]`` of a change whose positions count in ``encoding``."""
    if not isinstance(edit, dict):
        raise param_error(f"edits[{number}] must be a map")
    text = edit.get("text")
    if not isinstance(text, str):
        raise param_error(f"edits[{number}].text must be a string")
    if "range" in edit:
        rng = edit["range"]
        if not isinstance(rng, dict) or not isinstance(rng.get("start"), dict) or not isinstance(rng.get("end"), dict):
            raise param_error(f"edits[{number}].range must be {{start: {{line, character}}, end: {{line, character}}}}")
        return RangeEdit(parse_cursor(rng["start"], encoding), parse_cursor(rng["end"], encoding), text)
    if "start" in edit or "end" in edit:
        start = check_int(edit.get("start"), f"edits[{number}].start")
        return OffsetEdit(start, check_int(edit.get("end", start), f"edits[{number}].end"), text)
    return WholeText(text)


class Edits:
    """A change's edits, each parsed when it is reached (``parse_edit``).

    A change may hold many thousands; the daemon applies them in steps and serves other clients
    in between, so parsing them goes in those steps too, and an edit is checked after the ones
    before it have been applied, as LSP's contentChanges are."""

    __slots__ = ("_raw", "encoding")

    def __init__(self, raw: list[Any], encoding: str):
        self._raw = raw
        self.encoding = encoding

    def __len__(self) -> int:
        return len(self._raw)

    def __getitem__(self, number: int) -> Edit:
        if number < 0:
            number += len(self._raw)
        return parse_edit(self._raw[number], number, self.encoding)

    def __iter__(self) -> Iterator[Edit]:
        return (self[number] for number in range(len(self._raw)))


def parse_edits(edits: Any, encoding: Any = None) -> Edits:
    if not isinstance(edits, list):
        raise param_error("edits must be an array")
    return Edits(edits, check_encoding(encoding))


# -- one parser a method ------------------------------------------------------------------------

MAX_VERSION = 2**63 - 1
MAX_MSGID = 2**32 - 1


@dataclass(frozen=True)
class HelloParams:
    client: str
    errors: str  # one of ERROR_FORMATS
    batch: bool = False  # this connection's completes are batch work (bench, eval, scripts)


def hello_token(params: dict[str, Any]) -> str | None:
    """The token a TCP connection's hello presents (anything but a string is no token)."""
    token = params.get("token")
    return token if isinstance(token, str) else None


def parse_hello(params: dict[str, Any]) -> HelloParams:
    client = params.get("client")
    errors = params.get("errors", "map")
    if errors not in ERROR_FORMATS:
        raise param_error(f"errors must be one of {', '.join(ERROR_FORMATS)}")
    return HelloParams(client if isinstance(client, str) else "", errors, bool(get_bool(params, "batch")))


@dataclass(frozen=True)
class OpenParams:
    uri: str
    text: str
    version: int
    language: str | None


def parse_open(params: dict[str, Any]) -> OpenParams:
    uri = get_uri(params)
    text = get_str(params, "text")
    version = get_int(params, "version", 0, MAX_VERSION) or 0
    return OpenParams(uri, text, version, get_str(params, "language", required=False))


@dataclass(frozen=True)
class ChangeParams:
    """Exactly one of ``text`` (the whole new text) and ``edits`` is set."""

    uri: str
    version: int | None  # None: one more than the document's
    text: str | None
    edits: Edits | None


def parse_change(params: dict[str, Any]) -> ChangeParams:
    uri = get_uri(params)
    version = get_int(params, "version", 0, MAX_VERSION)
    text = get_str(params, "text", required=False)
    edits = params.get("edits")
    if (text is None) == (edits is None):
        raise param_error("change needs exactly one of text (full) or edits (ranged)")
    if edits is None:
        check_encoding(params.get("encoding"))
        return ChangeParams(uri, version, text, None)
    return ChangeParams(uri, version, None, parse_edits(edits, params.get("encoding")))


@dataclass(frozen=True)
class CloseParams:
    uri: str


def parse_close(params: dict[str, Any]) -> CloseParams:
    return CloseParams(get_uri(params))


@dataclass(frozen=True)
class FocusParams:
    uri: str
    cursor: Cursor


def parse_focus(params: dict[str, Any]) -> FocusParams:
    if "cursor" not in params:
        raise param_error("focus needs a cursor")
    return FocusParams(get_uri(params), parse_cursor(params["cursor"], params.get("encoding")))


@dataclass(frozen=True)
class CompleteParams:
    """``request`` is the engine's request as the wire gave it: the open document ``uri`` when
    its ``text`` is None, else the stateless ``text``; its offset is None until the handler
    locates ``cursor`` in the text."""

    request: CompletionRequest
    cursor: Cursor
    stream: bool = False  # send the settled lines as they come (``progress`` notifications)
    batch: bool | None = None  # batch work (None: as the connection's hello said)


def parse_complete(params: dict[str, Any]) -> CompleteParams:
    uri = get_uri(params, required=False)
    text = get_str(params, "text", required=False)
    if text is None and uri is None:
        raise param_error("complete needs uri (an open document) or text")
    if "cursor" not in params:
        raise param_error("complete needs a cursor")
    cursor = parse_cursor(params["cursor"], params.get("encoding"))
    extra = params.get("extra_context") or []
    if not isinstance(extra, list):
        raise param_error("extra_context must be an array of {path, text}")
    chunks = []
    for number, item in enumerate(extra):
        if not isinstance(item, dict):
            raise param_error(f"extra_context[{number}] must be a map {{path, text}}")
        chunk_text = get_str(item, "text")
        chunks.append(ContextChunk(path=get_uri(item, "path"), text=chunk_text))
    request = CompletionRequest(uri=uri, text=text, path=get_uri(params, "path", required=False),
                                extra_context=chunks, **completion_options(params.get("options")))
    return CompleteParams(request, cursor, bool(get_bool(params, "stream")), get_bool(params, "batch"))


@dataclass(frozen=True)
class CancelParams:
    msgid: int | None  # of a complete on this connection
    uri: str | None  # of the document whose complete to cancel


def parse_cancel(params: dict[str, Any]) -> CancelParams:
    msgid = get_int(params, "msgid", 0, MAX_MSGID)
    uri = get_uri(params, required=False)
    if msgid is None and uri is None:
        raise param_error("cancel needs msgid (of a complete on this connection) or uri")
    return CancelParams(msgid, uri)


@dataclass(frozen=True)
class WorkspaceParams:
    """``folders`` replaces this connection's folders; ``add`` and ``remove`` change them."""

    folders: list[str] | None
    add: list[str] | None
    remove: list[str] | None


def parse_workspace(params: dict[str, Any]) -> WorkspaceParams:
    return WorkspaceParams(*(get_folders(params, name) for name in ("folders", "add", "remove")))


def no_params(params: dict[str, Any]) -> None:
    """Methods that take no parameters ignore whatever map they are sent."""
    return None
