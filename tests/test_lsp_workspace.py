"""specd-lsp tells the daemon the editor's workspace folders: ``workspaceFolders`` (or
``rootUri``) at initialize, then every ``workspace/didChangeWorkspaceFolders``; the daemon lets
go of them when the editor goes away."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
from lsprotocol import types
from pytest_lsp import make_test_lsp_client

from lsp_helpers import Session, link_options, poll, server_env

pytestmark = pytest.mark.asyncio


def capabilities() -> types.ClientCapabilities:
    return types.ClientCapabilities(
        text_document=types.TextDocumentClientCapabilities(inline_completion=types.InlineCompletionClientCapabilities()),
        workspace=types.WorkspaceClientCapabilities(workspace_folders=True),
    )


@contextlib.asynccontextmanager
async def editor(env: dict[str, str], options: dict[str, Any], root_uri: str | None = None,
                 folders: list[Path] | None = None) -> AsyncIterator[Session]:
    client = make_test_lsp_client()
    session = Session(client)
    await client.start_io(sys.executable, "-m", "specd_lsp.server", "--log-level", "debug", env=env)
    try:
        session.init_result = await client.initialize_session(types.InitializeParams(
            capabilities=capabilities(), initialization_options=options, root_uri=root_uri,
            workspace_folders=[types.WorkspaceFolder(uri=f.as_uri(), name=f.name) for f in folders]
            if folders is not None else None))
        await session.wait_state("ready", 60)
        yield session
    finally:
        with contextlib.suppress(Exception):
            await client.shutdown_session()
        await client.stop()


def watched(daemon) -> set[str]:
    with daemon.client() as client:
        return set(client.status()["workspace"]["folders"])


async def test_folders_at_initialize_and_on_change_reach_the_daemon(fake_daemon, tmp_path):
    a, b, c = (tmp_path / name for name in ("alpha", "beta", "gamma"))
    for folder in (a, b, c):
        folder.mkdir()
    before = watched(fake_daemon)
    async with editor(server_env(tmp_path), link_options(fake_daemon), folders=[a, b]) as session:
        caps = session.init_result.capabilities.workspace
        assert caps.workspace_folders.supported and caps.workspace_folders.change_notifications
        await poll(_async(lambda: watched(fake_daemon) == before | {str(a), str(b)}), 10, what="alpha and beta")
        session.client.workspace_did_change_workspace_folders(types.DidChangeWorkspaceFoldersParams(
            event=types.WorkspaceFoldersChangeEvent(added=[types.WorkspaceFolder(uri=c.as_uri(), name="gamma")],
                                                    removed=[types.WorkspaceFolder(uri=a.as_uri(), name="alpha")])))
        await poll(_async(lambda: watched(fake_daemon) == before | {str(b), str(c)}), 10, what="beta and gamma")
    # The editor went away: so did its folders.
    await poll(_async(lambda: watched(fake_daemon) == before), 10, what="the folders to be released")


async def test_root_uri_alone_is_the_workspace_and_other_schemes_are_left_out(fake_daemon, tmp_path):
    root = tmp_path / "project"
    root.mkdir()
    before = watched(fake_daemon)
    async with editor(server_env(tmp_path), link_options(fake_daemon), root_uri=root.as_uri()):
        await poll(_async(lambda: watched(fake_daemon) == before | {str(root)}), 10, what="the root folder")
    async with editor(server_env(tmp_path), link_options(fake_daemon), root_uri="vscode-vfs://github/x/y") as session:
        assert session.statuses[-1]["state"] == "ready"
        assert watched(fake_daemon) == before


def _async(check):
    async def condition():
        return check()
    return condition
