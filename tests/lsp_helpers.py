"""Driving specd-lsp end to end: a pytest-lsp client talking to ``python -m specd_lsp.server``.

``lsp_session`` starts the server as a subprocess in a clean environment, initializes it with
the given capabilities and initializationOptions, records its ``specd/status`` notifications
and ``window/showMessage``s, and shuts it down afterwards. Tests wait on conditions
(``wait_status``), never on a fixed sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from lsprotocol import types
from pytest_lsp import LanguageClient, make_test_lsp_client

from daemon_helpers import base_env

STATUS = "specd/status"
ACCEPTED = "specd.accepted"


def server_env(root: Path, engine: str = "fake", config: dict[str, Any] | None = None,
               extra: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: private XDG dirs; a daemon it spawns runs ``engine``."""
    return base_env(root, engine, config, extra)


def inline_capabilities(encodings: list[str] | None = None, configuration: bool = False) -> types.ClientCapabilities:
    return types.ClientCapabilities(
        general=types.GeneralClientCapabilities(position_encodings=encodings) if encodings else None,
        text_document=types.TextDocumentClientCapabilities(
            inline_completion=types.InlineCompletionClientCapabilities(),
            synchronization=types.TextDocumentSyncClientCapabilities(),
        ),
        workspace=types.WorkspaceClientCapabilities(configuration=configuration),
        window=types.WindowClientCapabilities(),
    )


def plain(value: Any) -> Any:
    """A pygls custom-message payload (attribute object or dict) as plain dicts and lists."""
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return [plain(item) for item in value]
    if hasattr(value, "_asdict"):
        return {key: plain(item) for key, item in value._asdict().items()}
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return {key: plain(item) for key, item in vars(value).items()}
    return value


class Session:
    def __init__(self, client: LanguageClient):
        self.client = client
        self.statuses: list[dict[str, Any]] = []
        self.changed = asyncio.Event()
        self.versions: dict[str, int] = {}

        @client.feature(STATUS)
        def _status(params: Any) -> None:
            self.statuses.append(plain(params))
            self.changed.set()

    @property
    def messages(self) -> list[types.ShowMessageParams]:
        return self.client.messages

    async def wait_for(self, condition: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
        """Wait until ``condition()`` is truthy, waking on every notification (bounded polling too)."""
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}; last status: "
                                     f"{self.statuses[-1] if self.statuses else None}")
            self.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(left, 0.2))

    async def wait_state(self, state: str, timeout: float = 60.0) -> dict[str, Any]:
        return await self.wait_for(lambda: self.statuses and self.statuses[-1]["state"] == state and self.statuses[-1],
                                   timeout, f"state {state}")

    async def status(self) -> dict[str, Any]:
        return plain(await self.client.protocol.send_request_async(STATUS, {}))

    # -- documents -------------------------------------------------------------------------

    def open(self, uri: str, text: str, language: str = "python") -> None:
        self.versions[uri] = 1
        self.client.text_document_did_open(types.DidOpenTextDocumentParams(
            types.TextDocumentItem(uri=uri, language_id=language, version=1, text=text)))

    def edit(self, uri: str, start: tuple[int, int], end: tuple[int, int], text: str) -> None:
        self.versions[uri] += 1
        self.client.text_document_did_change(types.DidChangeTextDocumentParams(
            types.VersionedTextDocumentIdentifier(uri=uri, version=self.versions[uri]),
            [types.TextDocumentContentChangePartial(
                range=types.Range(types.Position(*start), types.Position(*end)), text=text)]))

    def close(self, uri: str) -> None:
        self.client.text_document_did_close(types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(uri=uri)))

    def inline_params(self, uri: str, line: int, character: int, invoked: bool = False,
                      selected: types.SelectedCompletionInfo | None = None) -> types.InlineCompletionParams:
        kind = types.InlineCompletionTriggerKind.Invoked if invoked else types.InlineCompletionTriggerKind.Automatic
        return types.InlineCompletionParams(
            context=types.InlineCompletionContext(trigger_kind=kind, selected_completion_info=selected),
            text_document=types.TextDocumentIdentifier(uri=uri),
            position=types.Position(line, character))

    async def inline(self, uri: str, line: int, character: int, invoked: bool = False,
                     selected: types.SelectedCompletionInfo | None = None) -> list[types.InlineCompletionItem]:
        result = await self.client.text_document_inline_completion_async(
            self.inline_params(uri, line, character, invoked, selected))
        if result is None:
            return []
        return list(result.items if isinstance(result, types.InlineCompletionList) else result)

    async def accept(self, item: types.InlineCompletionItem) -> None:
        assert item.command is not None and item.command.command == ACCEPTED
        await self.client.workspace_execute_command_async(
            types.ExecuteCommandParams(command=item.command.command, arguments=item.command.arguments))


@contextlib.asynccontextmanager
async def lsp_session(env: dict[str, str], options: dict[str, Any] | None = None,
                      capabilities: types.ClientCapabilities | None = None,
                      wait_ready: bool = True, ready_timeout: float = 60.0) -> AsyncIterator[Session]:
    client = make_test_lsp_client()
    session = Session(client)
    await client.start_io(sys.executable, "-m", "specd_lsp.server", "--log-level", "debug", env=env)
    try:
        result = await client.initialize_session(types.InitializeParams(
            capabilities=capabilities or inline_capabilities(),
            initialization_options=options or {},
            root_uri=None,
        ))
        session.init_result = result
        if wait_ready:
            await session.wait_state("ready", ready_timeout)
        yield session
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.shutdown_session(), 15)
        await client.stop()


def link_options(daemon: Any, **extra: Any) -> dict[str, Any]:
    """initializationOptions for a session on an already running test daemon. A streamed answer
    waits for its first settled line (``partialLineMs`` 0), so what a test is shown does not
    depend on how fast the machine writes that line; the tests of partial lines set their own."""
    daemon_settings = {"socket": str(daemon.socket_path), "spawn": False, "requestTimeoutMs": TIME_BUDGET_MS,
                       **extra.pop("daemon", {})}
    return {"daemon": daemon_settings, "debounceMs": 0, "partialLineMs": 0, "maxTokens": 16,
            "timeBudgetMs": TIME_BUDGET_MS, **extra}


# A time budget no test completion reaches, so results do not depend on the machine's load.
TIME_BUDGET_MS = 120_000


def daemon_options(max_tokens: int = 16, single_line: bool = False) -> dict[str, Any]:
    """The options specd-lsp sends for a greedy completion with those settings."""
    return {"max_tokens": max_tokens, "single_line": single_line, "temperature": 0.0, "time_budget_ms": TIME_BUDGET_MS}


async def poll(condition: Callable[[], Any], timeout: float = 30.0, interval: float = 0.05,
               what: str = "condition") -> Any:
    """Await ``condition()`` (a coroutine function) until it is truthy; bounded polling."""
    deadline = time.monotonic() + timeout
    while True:
        value = await condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)
