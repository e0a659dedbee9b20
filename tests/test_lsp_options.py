"""Settings: typed and defaulted; from initializationOptions and workspace/didChangeConfiguration."""

from __future__ import annotations

import pytest
from lsprotocol import types

from lsp_helpers import inline_capabilities, link_options, lsp_session, server_env
from specd_lsp.options import Settings, parse_settings, to_dict

URI = "file:///work/options.py"


def test_defaults_and_both_spellings():
    settings, problems = parse_settings(None)
    assert settings == Settings() and problems == []
    settings, problems = parse_settings({"specd": {"maxTokens": 32, "single_line": True, "daemon": {"spawnTimeoutS": 5}}})
    assert (settings.max_tokens, settings.single_line, settings.daemon.spawn_timeout_s) == (32, True, 5.0)
    assert problems == []
    assert to_dict(settings)["daemon"]["spawnTimeoutS"] == 5.0


def test_invalid_values_fall_back_one_by_one():
    settings, problems = parse_settings({
        "maxTokens": "many", "triggerMode": "sometimes", "debounceMs": -1, "enable": 1, "colour": "red",
        "daemon": {"spawn": "yes", "socket": "/tmp/s.sock"}, "cache": 5, "singleLine": True,
    })
    assert settings.max_tokens == Settings().max_tokens and settings.trigger_mode == "automatic"
    assert settings.debounce_ms == Settings().debounce_ms and settings.enable is True
    assert settings.daemon.spawn is True and settings.daemon.socket == "/tmp/s.sock"  # the valid sibling stays
    assert settings.single_line is True
    assert [p.split(" ")[0] for p in problems] == [
        "maxTokens", "triggerMode", "debounceMs", "enable", "colour", "daemon.spawn", "cache"]


@pytest.mark.asyncio
async def test_invalid_options_give_one_message_and_defaults(fake_daemon, tmp_path):
    options = link_options(fake_daemon, maxTokens=0, triggerMode="sometimes")
    async with lsp_session(server_env(tmp_path), options) as session:
        await session.wait_for(lambda: session.messages, 10, "the settings message")
        [message] = session.messages
        assert message.type == types.MessageType.Warning
        assert "maxTokens" in message.message and "triggerMode" in message.message
        status = await session.status()
        assert status["settings"]["maxTokens"] == 64 and status["settings"]["triggerMode"] == "automatic"
        session.open(URI, "x = 1\n")
        assert await session.inline(URI, 0, 5)  # completions still work
        assert len(session.messages) == 1


@pytest.mark.asyncio
async def test_did_change_configuration_pushes_and_pulls(fake_daemon, tmp_path):
    capabilities = inline_capabilities(configuration=True)
    async with lsp_session(server_env(tmp_path), link_options(fake_daemon), capabilities) as session:
        session.open(URI, "x = 1\n")
        assert await session.inline(URI, 0, 5)
        # Pushed: manual trigger mode answers invoked requests only.
        session.client.workspace_did_change_configuration(
            types.DidChangeConfigurationParams(settings={"specd": {"triggerMode": "manual"}}))
        await session.wait_for(lambda: session.statuses and session.statuses[-1].get("requests") is not None, 5)
        assert (await session.status())["settings"]["triggerMode"] == "manual"
        assert await session.inline(URI, 0, 5) == []
        assert await session.inline(URI, 0, 5, invoked=True)
        # Pulled: settings null means "ask me" (workspace/configuration, section "specd").
        session.client.set_configuration({"enable": False}, section="specd")
        session.client.workspace_did_change_configuration(types.DidChangeConfigurationParams(settings=None))
        await session.wait_for(lambda: session.statuses[-1]["enabled"] is False, 5, "enable false")
        assert await session.inline(URI, 0, 5, invoked=True) == []
        # The init options' socket survives a configuration change that does not mention it.
        assert (await session.status())["settings"]["daemon"]["socket"] == str(fake_daemon.socket_path)
