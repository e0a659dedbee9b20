"""Error codes: stable strings a client may branch on, each with a human message beside it.

On the wire an error is a map ``{"code": str, "message": str}`` plus an optional ``"data"``
map, in the ``error`` slot of a response ``[1, msgid, error, nil]``.
"""

from __future__ import annotations

from enum import Enum
from typing import Any


class ErrorCode(str, Enum):
    # Wire-level: the bytes or the message shape were wrong.
    PARSE_ERROR = "parse_error"  # bytes that are not msgpack; the connection is closed after it
    FRAME_TOO_LARGE = "frame_too_large"  # one message over daemon.max_frame_bytes; connection closed
    INVALID_REQUEST = "invalid_request"  # msgpack, but not a msgpack-rpc message
    METHOD_NOT_FOUND = "method_not_found"
    INVALID_PARAMS = "invalid_params"
    # Access.
    UNAUTHORIZED = "unauthorized"  # peer uid differs, or a TCP client without the token
    TOO_MANY_CONNECTIONS = "too_many_connections"
    # Documents.
    UNKNOWN_DOCUMENT = "unknown_document"
    DOCUMENT_TOO_LARGE = "document_too_large"
    TOO_MANY_DOCUMENTS = "too_many_documents"
    TOO_MANY_DOCUMENT_BYTES = "too_many_document_bytes"  # open documents' bytes over a budget (all, or a connection's)
    STALE_VERSION = "stale_version"  # a change whose version is not newer than the held one
    OUT_OF_RANGE = "out_of_range"  # a cursor or edit range outside the document
    # Completion.
    CANCELLED = "cancelled"  # by `cancel`, by a newer `complete` for the same document, or by disconnect
    BUSY = "busy"  # this connection already has as much queued as it may; retry once one is answered
    ENGINE_ERROR = "engine_error"
    MODEL_LOAD_ERROR = "model_load_error"
    SHUTTING_DOWN = "shutting_down"
    # Client side only: no answer came in time, the daemon went away, or none runs.
    TIMEOUT = "timeout"  # no answer in time (client side); a message left incomplete too long (daemon side, then closed)
    CONNECTION_LOST = "connection_lost"
    DAEMON_UNAVAILABLE = "daemon_unavailable"  # nothing answers at the socket (and none could be started)
    INTERNAL_ERROR = "internal_error"


class RpcError(Exception):
    """An error response, raised by handlers on the daemon side and by clients on theirs."""

    def __init__(self, code: ErrorCode | str, message: str, data: dict[str, Any] | None = None):
        super().__init__(message)
        self.code = code.value if isinstance(code, ErrorCode) else str(code)
        self.message = message
        self.data = data

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data:
            out["data"] = self.data
        return out

    def to_text(self) -> str:
        """The one-string form, for clients that can only show a string (Neovim's rpcrequest)."""
        return f"{self.code}: {self.message}"

    @classmethod
    def from_wire(cls, error: Any) -> RpcError:
        """Build from a response's error slot; tolerates Neovim's ``[type, message]`` shape."""
        if isinstance(error, dict):
            code = error.get("code", ErrorCode.INTERNAL_ERROR.value)
            message = error.get("message", "")
            data = error.get("data")
            return cls(str(code), str(message), data if isinstance(data, dict) else None)
        if isinstance(error, (list, tuple)) and len(error) == 2:
            return cls(ErrorCode.INTERNAL_ERROR, str(error[1]))
        if isinstance(error, str) and ": " in error and error.split(": ", 1)[0] in _CODES:
            code, message = error.split(": ", 1)
            return cls(code, message)
        return cls(ErrorCode.INTERNAL_ERROR, str(error))

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def __repr__(self) -> str:
        return f"RpcError({self.code!r}, {self.message!r})"


_CODES = frozenset(code.value for code in ErrorCode)
