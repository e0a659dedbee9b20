"""textDocument/inlineCompletion end to end: specd-lsp on a real daemon running the tiny model.

The expected text is what the daemon itself answers for the same document and cursor
(greedy decoding is deterministic), passed through the same post-processing.
"""

from __future__ import annotations

import pytest
from lsprotocol import types

from lsp_helpers import ACCEPTED, daemon_options, inline_capabilities, link_options, lsp_session, server_env
from specd_lsp.alternatives import EXTRA_DRAWS
from specd_lsp.completer import Completer
from specd_lsp.completion import context_at, postprocess
from specd_lsp.documents import DocumentStore
from specd_lsp.options import parse_settings
from specd_lsp.positions import TextIndex
from specd_lsp.proposals import INVOKED, CompletionQuery

pytestmark = pytest.mark.asyncio

URI = "file:///work/greet.py"
DOC = (
    "import os\n"
    "\n"
    "\n"
    "def greet(name):\n"
    "    message = 'hello ' + name\n"
    "    return message\n"
    "\n"
    "\n"
    "def add(a, b):\n"
    "    return a + b\n"
)


def expected(daemon, text: str, offset: int, uri: str = URI, **options):
    with daemon.client() as client:
        raw = client.complete(uri=uri, text=text, cursor={"offset": offset}, options=daemon_options(**options))["text"]
    return postprocess(raw, context_at(text, offset))


async def test_an_item_from_the_real_daemon(daemon, tmp_path):
    index = TextIndex(DOC)
    async with lsp_session(server_env(tmp_path), link_options(daemon)) as session:
        caps = session.init_result.capabilities
        assert caps.inline_completion_provider is not None and caps.completion_provider is None
        assert caps.text_document_sync.change == types.TextDocumentSyncKind.Incremental
        assert ACCEPTED in caps.execute_command_provider.commands
        session.open(URI, DOC)
        shown = 0
        for line in (0, 3, 4, 5, 8, 9):
            character = len(index.line_text(line))
            items = await session.inline(URI, line, character)
            want = expected(daemon, DOC, index.offset(line, character))
            if want is None:
                assert items == []
                continue
            shown += 1
            assert [item.insert_text for item in items] == [want.insert_text]
            assert items[0].range == types.Range(types.Position(line, character),
                                                  types.Position(line, character + want.replace_chars))
            assert items[0].command.command == ACCEPTED
        assert shown >= 1, "the tiny model should complete at least one of these lines"
        status = await session.status()
        assert status["state"] == "ready" and status["daemon"]["models"]["target"].endswith("target")
        assert status["daemonRequests"] == 6 and status["lastLatencyMs"] is not None
        assert status["acceptance"], "per-source acceptance from the daemon's results"


async def test_invoked_returns_distinct_alternatives_greedy_first(daemon, tmp_path):
    line, character = 9, len("    return a + b")
    async with lsp_session(server_env(tmp_path), link_options(daemon, alternatives=3)) as session:
        session.open(URI, DOC)
        automatic = await session.inline(URI, line, character)
        invoked = await session.inline(URI, line, character, invoked=True)
        assert len(invoked) <= 3
        assert len({item.insert_text for item in invoked}) == len(invoked)
        if automatic:  # the automatic answer may be the greedy one's first line (streamed)
            assert invoked and invoked[0].insert_text.startswith(automatic[0].insert_text)
        status = await session.status()
        # one greedy, then greedy + two sampled, + up to two more where a sample showed as one
        # drawn before or as nothing; all of those only when fewer than three items came
        drawn = status["daemonRequests"] - 1
        assert 3 <= drawn <= 3 + EXTRA_DRAWS and (drawn == 3 + EXTRA_DRAWS or len(invoked) == 3), (drawn, invoked)


async def test_alternatives_that_repeat_are_drawn_again_a_bounded_number_of_times(fake_daemon, tmp_path):
    # The fake engine answers the same text whatever the seed: every sample repeats the greedy one.
    async with lsp_session(server_env(tmp_path), link_options(fake_daemon, alternatives=3)) as session:
        session.open(URI, DOC)
        invoked = await session.inline(URI, 9, len("    return a + b"), invoked=True)
        assert len(invoked) == 1, invoked
        status = await session.status()
        assert status["daemonRequests"] == 3 + EXTRA_DRAWS


class SeededLink:
    """A daemon link whose completion is ``texts[seed]`` (the greedy one: seed None)."""

    def __init__(self, texts: dict[int | None, str]):
        self.texts = texts
        self.seeds: list[int | None] = []

    async def complete(self, params, timeout):
        seed = params["options"].get("seed")
        self.seeds.append(seed)
        return {"text": self.texts[seed]}


async def test_alternatives_that_would_show_as_one_drawn_before_or_as_nothing_are_drawn_again():
    # Texts that differ only past a control character (where post-processing cuts them) show the
    # same item; a blank one shows nothing. A peaked random model answers so at any temperature.
    texts = {None: "li\x08)hunks", 1: "li\x08ns game", 2: "   ", 3: "other"}
    link = SeededLink(texts | {seed: "li\x08x" for seed in range(4, 3 + EXTRA_DRAWS)} | {3 + EXTRA_DRAWS: "third"})
    documents = DocumentStore()
    documents.open(URI, DOC, 1)
    settings, _ = parse_settings({"alternatives": 3})
    completer = Completer(documents, link, lambda: settings)
    proposals = await completer.propose(CompletionQuery(URI, len(DOC), INVOKED))
    assert [p.insert_text for p in proposals] == ["li", "other"]  # "third" is one draw too far
    assert link.seeds == [None, *range(1, 3 + EXTRA_DRAWS)]


async def test_the_rest_of_the_line_is_replaced_when_it_is_only_closers(fake_daemon, tmp_path):
    text = "print(value_of_thing)\n"
    async with lsp_session(server_env(tmp_path), link_options(fake_daemon)) as session:
        session.open(URI, text)
        items = await session.inline(URI, 0, 20)
        # The fake engine answers "[<12 characters before the cursor>]"; the ")" after the cursor is carried.
        assert [item.insert_text for item in items] == ["[lue_of_thing])"]
        assert items[0].range == types.Range(types.Position(0, 20), types.Position(0, 21))


async def test_selected_completion_info_extends_the_selected_item(fake_daemon, tmp_path):
    text = "import os\nos.pa\n"
    selected = types.SelectedCompletionInfo(range=types.Range(types.Position(1, 3), types.Position(1, 5)), text="path")
    async with lsp_session(server_env(tmp_path), link_options(fake_daemon)) as session:
        session.open(URI, text)
        items = await session.inline(URI, 1, 5, selected=selected)
        # Completed as if "path" were in place: the fake echoes the 12 characters before that cursor.
        assert [item.insert_text for item in items] == ["path[t os\nos.path]"]
        assert items[0].range == selected.range


async def test_completion_fallback_for_clients_without_inline_completion(fake_daemon, tmp_path):
    capabilities = types.ClientCapabilities(text_document=types.TextDocumentClientCapabilities(
        completion=types.CompletionClientCapabilities()))
    async with lsp_session(server_env(tmp_path), link_options(fake_daemon), capabilities) as session:
        assert session.init_result.capabilities.completion_provider is not None
        session.open(URI, "x = 1\ny = \n")
        result = await session.client.text_document_completion_async(types.CompletionParams(
            text_document=types.TextDocumentIdentifier(uri=URI), position=types.Position(1, 4)))
        assert result.is_incomplete and len(result.items) == 1
        item = result.items[0]
        assert item.text_edit.new_text == "[x = 1\ny = ]"
        assert item.text_edit.range == types.Range(types.Position(1, 4), types.Position(1, 4))
        assert item.label_details.description == "specd" and item.command.command == ACCEPTED


async def test_inline_completion_capable_clients_get_no_completion_provider_unless_asked(fake_daemon, tmp_path):
    options = link_options(fake_daemon, completionFallback="always")
    async with lsp_session(server_env(tmp_path), options, inline_capabilities()) as session:
        assert session.init_result.capabilities.completion_provider is not None
