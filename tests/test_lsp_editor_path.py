"""What a person's editor session meets: a stray SPECD_* variable in the environment, and
partial accepts (a word or a line of a suggestion) in the status counts."""

from __future__ import annotations

import pytest
from lsprotocol import types

from specd.client import Client
from lsp_helpers import link_options, lsp_session, server_env

pytestmark = pytest.mark.asyncio

URI = "file:///work/editor_path.py"


async def test_an_unknown_specd_variable_warns_once_and_completions_go_on(tmp_path):
    # SPECD_RENDERER names no config key: specd-lsp says so once and goes on; the daemon it
    # spawns (which inherits the environment) starts too, and the known variable still applies.
    env = server_env(tmp_path, "fake", extra={"SPECD_RENDERER": "native", "SPECD_ENGINE_MAX_TOKENS": "9"})
    async with lsp_session(env, {"daemon": {"spawn": True}, "debounceMs": 0}, ready_timeout=60) as session:
        await session.wait_for(lambda: session.messages, 10, "the warning")
        assert len(session.messages) == 1
        message = session.messages[0].message
        assert "SPECD_RENDERER" in message and "\n" not in message
        session.open(URI, "x = 1\n")
        assert [item.insert_text for item in await session.inline(URI, 0, 5)] == ["[x = 1]"]
        status = await session.status()
        assert status["state"] == "ready" and status["daemon"]["pid"] > 0
        assert len(session.messages) == 1
        with Client.connect_unix(tmp_path / "run" / "specd" / "specd.sock", timeout=5) as client:
            client.shutdown()  # the daemon this session spawned


async def test_partial_accepts_are_counted_and_the_item_stays_acceptable(fake_daemon, tmp_path):
    async with lsp_session(server_env(tmp_path), link_options(fake_daemon)) as session:
        session.open(URI, "x = 1\n")
        [item] = await session.inline(URI, 0, 5)
        command, [proposal_id] = item.command.command, item.command.arguments
        await session.client.workspace_execute_command_async(
            types.ExecuteCommandParams(command=command, arguments=[proposal_id, {"partialChars": 2}]))
        after = await session.wait_for(lambda: session.statuses[-1]["acceptedPartial"] == 1 and session.statuses[-1],
                                       5, "the partial accept counted")
        assert after["accepted"] == 0 and after["acceptedChars"] == 2
        await session.accept(item)  # the rest, later: an accept of the same item
        after = await session.wait_for(lambda: session.statuses[-1]["accepted"] == 1 and session.statuses[-1],
                                       5, "the accept counted")
        assert after["acceptedPartial"] == 1 and after["acceptedChars"] == 2 + len(item.insert_text)
