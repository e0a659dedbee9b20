"""Position encodings end to end: UTF-16 by default, UTF-8 or UTF-32 when the client offers them,
on lines with emoji (astral: 2 UTF-16 units, 4 bytes) and CJK (3 bytes)."""

from __future__ import annotations

import asyncio

import pytest
from lsprotocol import types

from lsp_helpers import daemon_options, inline_capabilities, link_options, lsp_session, server_env
from specd_lsp.completion import context_at, postprocess
from specd_lsp.positions import TextIndex, units

pytestmark = pytest.mark.asyncio

URI = "file:///work/unicode.py"
DOC = "# 你好, 世界 😀\ngreeting = '😀 你好' + name\nsmile_count = 2 + 😀😀 * 3\nx = '日本' # 🎉\n"
OFFERS = {"utf-16": None, "utf-8": ["utf-8", "utf-16"], "utf-32": ["utf-32"]}


@pytest.mark.parametrize("encoding", list(OFFERS))
async def test_positions_are_negotiated_and_converted(fake_daemon, tmp_path, encoding):
    capabilities = inline_capabilities(OFFERS[encoding])
    async with lsp_session(server_env(tmp_path), link_options(fake_daemon), capabilities) as session:
        assert session.init_result.capabilities.position_encoding == encoding
        session.open(URI, DOC)
        index = TextIndex(DOC)
        # Edit right after an emoji and after CJK, in the client's units.
        line1 = index.line_text(1)
        after_emoji = units(line1[:line1.index("😀") + 1], encoding)
        session.edit(URI, (1, after_emoji), (1, after_emoji), "🎉")
        text = DOC.replace("'😀 ", "'😀🎉 ", 1)
        line3 = TextIndex(text).line_text(3)
        after_cjk = units(line3[:line3.index("本") + 1], encoding)
        session.edit(URI, (3, after_cjk), (3, after_cjk), "語")
        text = text.replace("日本", "日本語", 1)
        # Complete just after the astral characters on line 2: the daemon must see the same cursor.
        line2 = TextIndex(text).line_text(2)
        column = units(line2[:line2.index("😀😀") + 2], encoding)
        items = await session.inline(URI, 2, column)
        offset = text.index("😀😀") + 2
        assert [item.insert_text for item in items] == [f"[{text[offset - 12:offset]}]"]
        assert items[0].range == types.Range(types.Position(2, column), types.Position(2, column))
        status = await session.status()
        assert status["positionEncoding"] == encoding


async def test_utf16_positions_on_the_real_daemon(daemon, tmp_path):
    """The tiny model completes at the cursor the editor meant, on every non-ASCII line."""
    index = TextIndex(DOC)
    async with lsp_session(server_env(tmp_path), link_options(daemon)) as session:
        session.open(URI, DOC)
        for line in range(4):
            content = index.line_text(line)
            column = units(content, "utf-16")
            items = await session.inline(URI, line, column)
            offset = index.offset(line, column)
            assert offset == index.line_end(line)
            with daemon.client() as client:
                raw = await asyncio.to_thread(client.complete, uri=URI, text=DOC, cursor={"offset": offset},
                                              options=daemon_options())
            want = postprocess(raw["text"], context_at(DOC, offset))
            assert [item.insert_text for item in items] == ([want.insert_text] if want else [])
            for item in items:
                assert item.range.start == types.Position(line, column)
