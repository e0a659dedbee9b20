"""The socket API's wire format, knowing nothing of the engine.

Layers, after pynvim's msgpack_rpc: ``framing`` turns bytes into whole msgpack objects and
back; ``messages`` turns those objects into typed requests, responses and notifications;
``session`` runs a connection on asyncio (pending requests, a dispatch table); ``methods``
and ``errors`` hold the names and codes both ends share. Beside them, ``positions`` and
``documents``: the one document model (text, version, position index in the three encodings)
that specd-lsp and the daemon both keep their open documents in.
"""

from specd.protocol.errors import ErrorCode, RpcError
from specd.protocol.framing import FrameDecoder, FrameError, pack
from specd.protocol.messages import MessageType, Notification, Request, Response, parse_message
from specd.protocol.methods import PROTOCOL_VERSION, Method

__all__ = [
    "ErrorCode",
    "FrameDecoder",
    "FrameError",
    "Method",
    "MessageType",
    "Notification",
    "PROTOCOL_VERSION",
    "Request",
    "Response",
    "RpcError",
    "pack",
    "parse_message",
]
