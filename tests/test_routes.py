"""Every socket method the protocol defines has a route in the daemon's dispatch table, hello
advertises exactly those, and a name outside the table is refused with ``method_not_found``.

A new socket method touches: ``specd/protocol/methods.py`` (its ``Method`` name),
``specd/daemon/params.py`` (its params' parser, or ``no_params``), its handler in
``specd/daemon/handlers/`` and one ``Route(parse, handle)`` line in ``Daemon.methods``
(``specd/daemon/server.py``); ``specd/client.py`` adds a facade method where callers want one.
These tests fail when the name is added without its route."""

from __future__ import annotations

import asyncio

import pytest

from specd.daemon.admission import Connection
from specd.daemon.handlers import Route
from specd.protocol.errors import ErrorCode, RpcError
from specd.protocol.messages import Notification, Request
from specd.protocol.methods import Method


@pytest.fixture
def daemon(tmp_path):
    """A daemon built but never run: its dispatch table exists, nothing listens or loads."""
    from fake_engine import FakeEngine
    from specd.config import load_config
    from specd.daemon.server import Daemon

    cfg = load_config(environ={"SPECD_DAEMON_SOCKET": str(tmp_path / "run" / "specd.sock")})
    return Daemon(cfg, engine_factory=lambda: FakeEngine(cfg))


def _client() -> Connection:
    return Connection(id=1, pending=False)  # a Unix client that has spoken: admission lets it through


def test_every_protocol_method_has_a_route(daemon):
    assert set(daemon.methods) == set(Method)
    for method, route in daemon.methods.items():
        assert isinstance(route, Route), method
        assert callable(route.parse) and callable(route.handle), method


def test_hello_advertises_exactly_the_routed_methods(daemon):
    hello = asyncio.run(daemon.methods[Method.HELLO](_client(), {"client": "test_routes"}, 1))
    assert sorted(hello["methods"]) == sorted(method.value for method in daemon.methods)


@pytest.mark.parametrize("name", ["nope", "", "Hello", "specd/status", "progress"])
def test_an_unknown_method_has_no_route(daemon, name):
    assert name not in daemon.methods
    with pytest.raises(RpcError) as info:
        asyncio.run(daemon._dispatch(_client(), Request(7, name, {})))
    assert info.value.code == ErrorCode.METHOD_NOT_FOUND
    assert all(method.value in info.value.message for method in Method)  # it names what is known


def test_an_unknown_notification_is_ignored(daemon):
    asyncio.run(daemon._notification(_client(), Notification("nope", {})))  # no answer, no error
