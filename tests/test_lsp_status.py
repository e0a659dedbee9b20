"""The specd/status notification and request, for plugins' status displays."""

from __future__ import annotations

import pytest

from lsp_helpers import link_options, lsp_session, server_env

pytestmark = pytest.mark.asyncio

URI = "file:///work/status.py"


async def test_status_follows_the_link_and_the_completions(fake_daemon, tmp_path):
    async with lsp_session(server_env(tmp_path), link_options(fake_daemon)) as session:
        ready = session.statuses[-1]
        assert ready["state"] == "ready" and ready["message"] == ""
        assert ready["daemon"]["pid"] > 0 and ready["daemon"]["models"] == {"target": "fake-target", "draft": "fake-draft"}
        session.open(URI, "x = 1\n")
        [item] = await session.inline(URI, 0, 5)
        await session.accept(item)
        after = await session.wait_for(lambda: session.statuses[-1]["accepted"] == 1 and session.statuses[-1], 5,
                                       "the status after the accept")
        assert after["shown"] == 1 and after["lastLatencyMs"] is not None and after["lastStopReason"] == "max_tokens"
        assert after["acceptance"]["lookup"]["proposed"] >= 2
        status = await session.status()
        assert status["daemon"]["latencyMs"]["count"] >= 1 and status["settings"]["maxTokens"] == 16
        assert status["documents"] == 1 and status["positionEncoding"] == "utf-16"
