"""The type-through cache and prefetch after accept.

The fake engine answers "[<12 characters before the cursor>]", so a test knows what the daemon
would say anywhere; a cached answer shows as a cache hit with no new daemon request.
"""

from __future__ import annotations

import pytest

from lsp_helpers import link_options, lsp_session, poll, server_env

URI = "file:///work/cache.py"


@pytest.mark.asyncio
async def test_typing_what_was_suggested_is_answered_from_the_cache(fake_daemon, tmp_path):
    async with lsp_session(server_env(tmp_path), link_options(fake_daemon)) as session:
        session.open(URI, "value = \n")
        first = await session.inline(URI, 0, 8)
        assert [item.insert_text for item in first] == ["[value = ]"]
        for typed, column in (("[", 9), ("v", 10), ("al", 12)):
            session.edit(URI, (0, column - len(typed)), (0, column - len(typed)), typed)
            items = await session.inline(URI, 0, column)
            assert [item.insert_text for item in items] == ["[value = ]"[column - 8:]]
        status = await session.status()
        assert status["daemonRequests"] == 1 and status["cacheHits"] == 3
        # Typing something else is a miss: the daemon is asked again.
        session.edit(URI, (0, 12), (0, 12), "X")
        assert [item.insert_text for item in await session.inline(URI, 0, 13)] == ["[alue = [valX]"]
        assert (await session.status())["daemonRequests"] == 2


@pytest.mark.asyncio
async def test_cache_can_be_turned_off(fake_daemon, tmp_path):
    async with lsp_session(server_env(tmp_path), link_options(fake_daemon, cache={"typeThrough": False})) as session:
        session.open(URI, "value = \n")
        await session.inline(URI, 0, 8)
        session.edit(URI, (0, 8), (0, 8), "[")
        await session.inline(URI, 0, 9)
        status = await session.status()
        assert status["daemonRequests"] == 2 and status["cacheHits"] == 0


@pytest.mark.asyncio
async def test_accepting_prefetches_the_next_suggestion(fake_daemon, tmp_path):
    async with lsp_session(server_env(tmp_path), link_options(fake_daemon)) as session:
        session.open(URI, "x = \n")
        [item] = await session.inline(URI, 0, 4)
        assert item.insert_text == "[x = ]"
        # As an editor does: insert the text, then run the item's command.
        session.edit(URI, (0, 4), (0, 4), item.insert_text)
        await session.accept(item)
        status = await poll(lambda: _status_if(session, lambda s: s["prefetches"] == 1), 10, what="the prefetch")
        assert status["accepted"] == 1 and status["acceptedChars"] == len(item.insert_text)
        assert status["daemonRequests"] == 2
        # The next request, at the end of the accepted text, is served from the prefetch.
        items = await session.inline(URI, 0, 10)
        assert [i.insert_text for i in items] == ["[x = [x = ]]"]
        status = await session.status()
        assert status["daemonRequests"] == 2 and status["cacheHits"] == 1


@pytest.mark.asyncio
async def test_prefetch_works_before_the_editor_applied_the_accept(fake_daemon, tmp_path):
    async with lsp_session(server_env(tmp_path), link_options(fake_daemon)) as session:
        session.open(URI, "x = \n")
        [item] = await session.inline(URI, 0, 4)
        await session.accept(item)  # the command arrives before the edit
        await poll(lambda: _status_if(session, lambda s: s["prefetches"] == 1), 10, what="the prefetch")
        session.edit(URI, (0, 4), (0, 4), item.insert_text)
        assert [i.insert_text for i in await session.inline(URI, 0, 10)] == ["[x = [x = ]]"]
        assert (await session.status())["cacheHits"] == 1


async def _status_if(session, predicate):
    status = await session.status()
    return status if predicate(status) else None


def test_the_cache_keeps_the_last_few_completions_per_document():
    from specd_lsp.cache import PER_DOCUMENT, TypeThroughCache

    cache = TypeThroughCache(size=64)
    for number in range(10):
        cache.put("file:///a.py", f"text {number} ", 7, [f"more{number}"])
    cache.put("file:///b.py", "b = ", 4, ["1"])
    assert len(cache) == PER_DOCUMENT + 1
    assert cache.lookup("file:///a.py", "text 9 m", 8) == ["ore9"]
    assert cache.lookup("file:///a.py", "text 0 m", 8) is None  # evicted
    assert cache.lookup("file:///b.py", "b = ", 4) == ["1"]
