"""What a JSON-RPC message must be before pygls sees it, and the one-line error when it is not.

pygls structures a decoded body by its ``method`` and ``id`` and logs a traceback for whatever
its converter refuses (a numeric ``method``, an ``id`` that is a map, params of the wrong
shape), or fails on what is not an object at all (a JSON array: JSON-RPC's batches, which LSP
does not have). So each body is checked here first, then structured the way pygls does, with
every refusal turned into a ``BadMessage``: a JSON-RPC error code and a one-line message, and
the request's id when it has a usable one (a notification's fault is logged, not answered).
"""

from __future__ import annotations

from typing import Any

import cattrs
from lsprotocol.types import ResponseErrorMessage
from pygls.protocol.json_rpc import JsonRPCNotification, JsonRPCRequestMessage, JsonRPCResponseMessage

INVALID_REQUEST = -32600
INVALID_PARAMS = -32602
REASON_CHARS = 300  # of a converter's complaint, in the one line


class BadMessage(Exception):
    """A body that is JSON but not an LSP message. ``answer``: whether to send an error back
    (requests, and what cannot be told from one; never a notification)."""

    def __init__(self, code: int, message: str, msgid: int | str | None = None, answer: bool = True):
        super().__init__(message)
        self.code = code
        self.message = message
        self.msgid = msgid
        self.answer = answer

    def response(self) -> dict[str, Any]:
        return {"jsonrpc": "2.0", "id": self.msgid, "error": {"code": self.code, "message": self.message}}


def _usable_id(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or isinstance(value, str)


def check(data: Any) -> None:
    """Raise BadMessage unless ``data`` has the shape of a request, notification or response."""
    if isinstance(data, list):
        raise BadMessage(INVALID_REQUEST, "a JSON array (a JSON-RPC batch): LSP sends one message at a time")
    if not isinstance(data, dict):
        raise BadMessage(INVALID_REQUEST, f"a JSON {type(data).__name__}, not a message object")
    has_id = "id" in data
    msgid = data.get("id")
    if has_id and not _usable_id(msgid) and not (msgid is None and "method" not in data):
        raise BadMessage(INVALID_REQUEST, f"id must be an integer or a string, not {type(msgid).__name__}")
    answerable = msgid if has_id and _usable_id(msgid) else None
    is_request = "method" in data and has_id
    if data.get("jsonrpc") != "2.0":
        raise BadMessage(INVALID_REQUEST, 'no "jsonrpc": "2.0"', answerable, answer=is_request or not has_id)
    if "method" in data:
        method = data["method"]
        if not isinstance(method, str) or not method:
            raise BadMessage(INVALID_REQUEST, f"method must be a non-empty string, not {type(method).__name__}",
                             answerable, answer=is_request)
        params = data.get("params")
        if params is not None and not isinstance(params, (dict, list)):
            raise BadMessage(INVALID_PARAMS, f"{method}: params must be an object or an array, "
                             f"not {type(params).__name__}", answerable, answer=is_request)
    elif not has_id or not ("result" in data or "error" in data):
        raise BadMessage(INVALID_REQUEST, "neither a request (method) nor a response (id with result or error)")


def structure(protocol: Any, data: dict[str, Any]) -> Any:
    """``data`` (checked) as pygls's message classes, chosen as pygls's ``structure_message``
    chooses them; a converter's refusal becomes BadMessage with its first complaints."""
    method = data.get("method")
    if "id" in data:
        if "error" in data:
            kind = ResponseErrorMessage
        elif method is not None:
            kind = protocol.get_message_type(method) or JsonRPCRequestMessage
        else:
            kind = protocol._result_types.pop(data["id"], None) or JsonRPCResponseMessage
    else:
        kind = protocol.get_message_type(method) or JsonRPCNotification
    if kind in (JsonRPCRequestMessage, JsonRPCNotification) and "params" not in data:
        data = {**data, "params": None}  # JSON-RPC lets params be left out; pygls's classes need it
    try:
        return protocol._converter.structure(data, kind)
    except Exception as err:  # noqa: BLE001 - any refusal by the converter is the same fault
        complaints = cattrs.transform_error(err) if isinstance(err, cattrs.BaseValidationError) else [str(err)]
        reason = "; ".join(complaints)[:REASON_CHARS]
        request = method is not None and "id" in data
        raise BadMessage(INVALID_PARAMS, f"{method or 'a response'}: {reason}",
                         data.get("id") if request else None, answer=request) from None
