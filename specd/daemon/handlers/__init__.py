"""The daemon's method handlers, one module per concern: ``documents`` (open, change, close),
``completion`` (complete, cancel, supersede), ``status`` (hello, status), ``folders``
(workspace).

Each handler is ``async (connection, params, msgid) -> answer map``, ``params`` already parsed
(``specd.daemon.params``) by the ``Route`` the daemon's dispatch table holds for its method.
Handlers know nothing of listeners or admission; errors are ``RpcError``s, which the session
turns into error responses carrying the request's msgid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from specd.daemon.admission import Connection

Handler = Callable[[Connection, Any, "int | None"], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class Route:
    """One method: how its params are parsed and what handles them."""

    parse: Callable[[dict[str, Any]], Any]
    handle: Handler

    async def __call__(self, conn: Connection, params: dict[str, Any], msgid: int | None) -> dict[str, Any]:
        return await self.handle(conn, self.parse(params), msgid)
