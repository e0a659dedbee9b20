"""msgpack-rpc messages, exactly as Neovim frames them.

    request       [0, msgid, method, params]
    response      [1, msgid, error, result]
    notification  [2, method, params]

``params`` is an array of arguments. specd's methods take one argument, a map, so a request
is ``[0, 7, "complete", [{"uri": ..., "cursor": ...}]]`` and Neovim's
``vim.rpcrequest(chan, "complete", {uri = ...})`` produces exactly that. An empty array means
an empty map; a bare map in the params slot is accepted too.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from specd.protocol.errors import ErrorCode, RpcError

MAX_MSGID = 2**32 - 1
MAX_METHOD_LEN = 128


class MessageType(IntEnum):
    REQUEST = 0
    RESPONSE = 1
    NOTIFICATION = 2


@dataclass(frozen=True)
class Request:
    msgid: int
    method: str
    params: dict[str, Any]

    def to_wire(self) -> list[Any]:
        return [MessageType.REQUEST, self.msgid, self.method, [self.params]]


@dataclass(frozen=True)
class Response:
    msgid: int
    error: dict[str, Any] | None
    result: Any

    def to_wire(self) -> list[Any]:
        return [MessageType.RESPONSE, self.msgid, self.error, self.result]


@dataclass(frozen=True)
class Notification:
    method: str
    params: dict[str, Any]

    def to_wire(self) -> list[Any]:
        return [MessageType.NOTIFICATION, self.method, [self.params]]


Message = Request | Response | Notification


class InvalidMessage(RpcError):
    """A msgpack value that is not a valid msgpack-rpc message.

    ``msgid`` is the request's id when one could be read, so the error can go back as that
    request's response; otherwise it is None and the error goes out as a notification.
    """

    def __init__(self, code: ErrorCode, message: str, msgid: int | None = None):
        super().__init__(code, message)
        self.msgid = msgid


def _is_msgid(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_MSGID


def _method(value: Any, msgid: int | None) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_METHOD_LEN:
        raise InvalidMessage(ErrorCode.INVALID_REQUEST, "method must be a non-empty string", msgid)
    return value


def _params(value: Any, msgid: int | None) -> dict[str, Any]:
    if isinstance(value, dict):
        params = value
    elif isinstance(value, (list, tuple)) and len(value) == 0:
        params = {}
    elif isinstance(value, (list, tuple)) and len(value) == 1 and isinstance(value[0], dict):
        params = value[0]
    else:
        raise InvalidMessage(
            ErrorCode.INVALID_PARAMS, "params must be an array holding one map of named arguments", msgid
        )
    if not all(isinstance(key, str) for key in params):
        raise InvalidMessage(ErrorCode.INVALID_PARAMS, "params keys must be strings", msgid)
    return params


def parse_message(obj: Any) -> Message:
    """Type a decoded msgpack value; raise InvalidMessage when it is not msgpack-rpc."""
    if not isinstance(obj, (list, tuple)) or not obj:
        raise InvalidMessage(ErrorCode.INVALID_REQUEST, "a message must be a non-empty array")
    kind = obj[0]
    if type(kind) is not int:  # msgpack-rpc types are integers: not 0.0, True or "0"
        raise InvalidMessage(ErrorCode.INVALID_REQUEST,
                             "message type must be the integer 0 (request), 1 (response) or 2 (notification)")
    if kind == MessageType.REQUEST:
        msgid = obj[1] if len(obj) > 1 and _is_msgid(obj[1]) else None
        if len(obj) != 4 or msgid is None:
            raise InvalidMessage(
                ErrorCode.INVALID_REQUEST, "a request is [0, msgid (uint32), method, params]", msgid
            )
        return Request(msgid, _method(obj[2], msgid), _params(obj[3], msgid))
    if kind == MessageType.RESPONSE:
        if len(obj) != 4 or not _is_msgid(obj[1]):
            raise InvalidMessage(ErrorCode.INVALID_REQUEST, "a response is [1, msgid, error, result]")
        return Response(obj[1], obj[2], obj[3])
    if kind == MessageType.NOTIFICATION:
        if len(obj) != 3:
            raise InvalidMessage(ErrorCode.INVALID_REQUEST, "a notification is [2, method, params]")
        return Notification(_method(obj[1], None), _params(obj[2], None))
    raise InvalidMessage(ErrorCode.INVALID_REQUEST, "message type must be 0 (request), 1 (response) or 2 (notification)")
