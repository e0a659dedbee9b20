"""Extra-context chunks: which are chosen, that they stay put across keystrokes, that a new set is
warmed off the request path, and that completions with them are still the target's own output."""

from __future__ import annotations

import pytest

from engine_helpers import assert_lossless, make_engine
from specd.engine import CompletionRequest, ContextChunk
from specd.engine.front.context import (
    MIN_CHUNK_LINES,
    PROMPT_OVERHEAD_TOKENS,
    QUERY_CHARS_BEFORE,
    REGION_LINES,
    Candidate,
    ContextSelector,
    display_path,
    nearby,
)

MAX_TOKENS = 16
CURRENT = (
    "from inventory import Item\n\n\n"
    "def restock_report(items, threshold):\n"
    "    low = [item for item in items if item.quantity < threshold]\n"
    "    low.sort(key=lambda item: item.quantity)\n"
)
RELEVANT = (
    "def reorder_quantity(item, threshold, batch):\n"
    "    missing = threshold - item.quantity\n"
    "    return max(batch, missing)\n\n\n"
    "def restock(items, threshold, batch=10):\n"
    "    for item in items:\n"
    "        if item.quantity < threshold:\n"
    "            item.quantity += reorder_quantity(item, threshold, batch)\n"
)
UNRELATED = "import socket\n\n\ndef serve(port):\n    listener = socket.socket()\n    listener.bind(('', port))\n"


def fake_encode(text: str) -> list[int]:
    return list(range(len(text) // 4 + 1))  # about 4 characters a token


def test_choose_takes_relevant_windows_within_the_budget_most_relevant_last():
    """Related files in, unrelated out, a text already in the document or already taken out."""
    selector = ContextSelector(budget_tokens=400)
    candidates = [
        Candidate("/p/src/net.py", UNRELATED, 1.0),
        Candidate("/p/src/stock.py", RELEVANT, 0.8),
        Candidate("/p/src/copy.py", CURRENT[:120], 1.0),  # already in the current file: no use
        Candidate("/p/lib/stock_again.py", RELEVANT, 0.8),  # the same text again: once
        Candidate("/p/src/helpers.py", "def item_threshold(items):\n    return min(i.quantity for i in items)\n", 1.0),
    ]
    chunks = selector.choose(CURRENT, len(CURRENT), "/p/src/report.py", candidates, fake_encode)
    assert sorted(c.path for c in chunks) == ["helpers.py", "stock.py"]
    assert RELEVANT in [c.text for c in chunks]
    # Most relevant last: it is the one kept when the budget fits only it.
    best = chunks[-1]
    only = ContextSelector(budget_tokens=len(fake_encode(f"{best.path}\n{best.text}\n")) + 1 + PROMPT_OVERHEAD_TOKENS)
    assert only.choose(CURRENT, len(CURRENT), "/p/src/report.py", candidates, fake_encode) == [best]
    # A window longer than what is left keeps its first lines (at least MIN_CHUNK_LINES).
    tight = ContextSelector(budget_tokens=PROMPT_OVERHEAD_TOKENS + 45)
    cut = tight.choose(CURRENT, len(CURRENT), "/p/src/report.py", [Candidate("/p/src/stock.py", RELEVANT, 1.0)],
                       fake_encode)
    assert len(cut) == 1 and RELEVANT.startswith(cut[0].text) and cut[0].text != RELEVANT
    assert len(cut[0].text.splitlines()) >= MIN_CHUNK_LINES
    # Nothing related, nothing chosen; no identifiers near the cursor, nothing either.
    assert selector.choose(CURRENT, len(CURRENT), "/p/src/report.py", candidates[:1], fake_encode) == []
    assert selector.choose("\n\n", 1, "/p/src/empty.py", candidates, fake_encode) == []


def test_long_files_give_windows_and_overlapping_windows_are_taken_once():
    filler = "".join(f"def unrelated_{i}(x):\n    return x + {i}\n" for i in range(60))
    long_file = filler + RELEVANT + filler
    selector = ContextSelector(budget_tokens=4000)
    chunks = selector.choose(CURRENT, len(CURRENT), "/p/report.py", [Candidate("/p/long.py", long_file, 1.0)],
                             fake_encode)
    assert chunks and all(len(c.text.splitlines()) <= 40 for c in chunks)
    assert any("reorder_quantity(item, threshold, batch)" in c.text for c in chunks)
    starts = sorted(long_file.index(c.text) for c in chunks)
    assert all(b - a >= len("".join(long_file.splitlines(True)[:40])) // 2 for a, b in zip(starts, starts[1:]))


def test_nearby_files_same_directory_first_then_the_parent_subtree():
    names = ["/r/a/b/x.py", "/r/a/b/y.txt", "/r/a/c/z.py", "/r/a/b/sub/w.py", "/r/other/q.py", "/elsewhere/e.py"]
    assert nearby("/r/a/b/cur.py", names, 10) == ["/r/a/b/x.py", "/r/a/b/y.txt", "/r/a/b/sub/w.py", "/r/a/c/z.py",
                                                  "/r/other/q.py"]
    assert nearby("/r/a/b/cur.py", names, 2) == ["/r/a/b/x.py", "/r/a/b/y.txt"]
    assert nearby("/top.py", names, 10) == []  # never "everything under /"
    assert nearby("untitled:1", names, 10) == []
    assert display_path("/r/a/c/z.py", "/r/a/b/cur.py") == "c/z.py"
    assert display_path("/r/a/b/x.py", "/r/a/b/cur.py") == "x.py"


# -- with the engine ----------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from more threads, and on a busy machine lose a lot to them."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engine(llama_pair):
    target, draft = llama_pair
    return make_engine(target, draft, prefix_tokens=256, suffix_tokens=64, context_tokens=256)


def idle(engine) -> int:
    """What the daemon's worker does between jobs: background slices until none is left."""
    slices = 0
    while engine.index_pending_corpus(0.05) or engine.warm_context(0.05):
        slices += 1
        assert slices < 200
    return slices


def complete(engine, uri: str, text: str, offset: int | None = None, **options):
    request = CompletionRequest(uri=uri, text=text, offset=len(text) if offset is None else offset,
                                max_tokens=MAX_TOKENS, stop_at_block_end=False, **options)
    result = engine.complete(request)
    assert_lossless(engine, result, MAX_TOKENS)  # the context changes the prompt, never the decoding
    return result


def repo_header(engine) -> int:
    return engine.prompts.special(engine.template.repo_name)[0]


def test_a_new_chunk_set_is_warmed_in_idle_time_then_stays_across_keystrokes(engine):
    uri, helper = "file:///proj/src/report.py", "file:///proj/src/stock.py"
    engine.open_document(helper, RELEVANT)
    try:
        first = complete(engine, uri, CURRENT)
        assert repo_header(engine) not in first.prompt_ids  # no set was warmed yet: none is used
        switches = engine.stats()["context"]["switches"]
        assert idle(engine) > 0
        stats = engine.stats()["context"]
        assert stats["switches"] == switches + 1 and stats["recent_chunks"] == ["stock.py"]
        # The next keystroke finds the warmed cache: only its own tail is computed.
        typed = CURRENT + "    "
        second = complete(engine, uri, typed)
        assert second.prompt_ids[:2] == [repo_header(engine), *second.prompt_ids[1:2]]
        context_length = second.prompt_ids.index(engine.prompts.special("<|fim_prefix|>")[0])
        assert second.prefill_reused > context_length
        assert second.prefill_computed < 10
        # Typing on in the same region: same chunks, same cached head, nothing new to warm.
        third = complete(engine, uri, typed + "return")
        assert third.prompt_ids[:context_length] == second.prompt_ids[:context_length]
        assert idle(engine) == 0
    finally:
        engine.close_document(helper)
        engine.close_document(uri)


def test_a_moved_cursor_keeps_the_old_set_until_the_new_one_is_warm(engine):
    uri, helper, other = "file:///proj/b/main.py", "file:///proj/b/stock.py", "file:///proj/b/net.py"
    far = CURRENT + "\n" * max(REGION_LINES * 2, QUERY_CHARS_BEFORE + 10) + "def serve_forever(port):\n    listener = socket.socket()\n"
    engine.open_document(helper, RELEVANT)
    engine.open_document(other, UNRELATED)
    try:
        complete(engine, uri, far, offset=len(CURRENT))
        idle(engine)
        assert engine.stats()["context"]["recent_chunks"] == ["stock.py"]
        before = complete(engine, uri, far, offset=len(CURRENT))
        moved = complete(engine, uri, far)  # another region: still the old chunks, head reused
        assert moved.prompt_ids[:5] == before.prompt_ids[:5]
        assert moved.prefill_reused > 0
        idle(engine)
        assert engine.stats()["context"]["recent_chunks"] == ["net.py"]
        after = complete(engine, uri, far)
        assert after.prefill_computed < 10  # the warmed state was swapped in
    finally:
        for name in (helper, other, uri):
            engine.close_document(name)


def test_an_edited_buffer_refreshes_its_chunk(engine):
    uri, helper = "file:///proj/c/main.py", "file:///proj/c/stock.py"
    engine.open_document(helper, RELEVANT)
    try:
        complete(engine, uri, CURRENT)
        idle(engine)
        engine.update_document(helper, RELEVANT.replace("batch", "lot_size"))
        idle(engine)
        result = complete(engine, uri, CURRENT + " ")
        assert "lot_size" in engine.pair.tokenizer.decode(result.prompt_ids)
    finally:
        engine.close_document(helper)
        engine.close_document(uri)


def test_workspace_files_near_the_document_become_context(engine):
    uri = "file:///proj/d/main.py"
    engine.set_corpus_file("/proj/d/stock.py", RELEVANT)
    engine.set_corpus_file("/far/away/stock.py", RELEVANT.replace("restock", "far_restock"))
    try:
        complete(engine, uri, CURRENT)
        idle(engine)
        assert engine.stats()["context"]["recent_chunks"] == ["stock.py"]
        text = engine.pair.tokenizer.decode(complete(engine, uri, CURRENT + " ").prompt_ids)
        assert "def restock(" in text and "far_restock" not in text
    finally:
        engine.set_corpus_file("/proj/d/stock.py", None)
        engine.set_corpus_file("/far/away/stock.py", None)
        engine.close_document(uri)


@pytest.mark.parametrize("mode", [dict(use_draft_model=True, use_lookup=True), dict(use_draft_model=False)])
def test_explicit_extra_context_is_lossless_and_overrides_the_automatic_set(engine, mode):
    chunks = [ContextChunk("lib/stock.py", RELEVANT), ContextChunk("lib/net.py", UNRELATED)]
    result = complete(engine, "file:///proj/e/main.py", CURRENT, extra_context=chunks, **mode)
    text = engine.pair.tokenizer.decode(result.prompt_ids)
    assert "lib/stock.py" in text and "lib/net.py" in text


def test_auto_context_off_leaves_the_prompt_alone(llama_pair):
    target, draft = llama_pair
    engine = make_engine(target, draft, prefix_tokens=256, suffix_tokens=64, auto_context=False)
    engine.open_document("file:///proj/f/stock.py", RELEVANT)
    complete(engine, "file:///proj/f/main.py", CURRENT)
    assert idle(engine) == 0
    assert repo_header(engine) not in complete(engine, "file:///proj/f/main.py", CURRENT + " ").prompt_ids
